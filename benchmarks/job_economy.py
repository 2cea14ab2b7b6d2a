"""What a whole training job costs in graphs, transfers and host syncs: a recipe's job through the plugin
against an expert's hand-written twin of the same job, phase by phase, on the XLA or the native backend.

The job, as users run it (`recipes.common.fit`): `fit` with validation every epoch, the progress bar, the CSV logger
and `last.ckpt` checkpoints, then `test`. The twin does the same work the way an expert writes it for the backend:
the same module, data and padding, the module's optimizer and LR schedule (`configure_optimizers`), the recipe's
gradient clipping, the values the recipe logs accumulated on the device and read where Lightning reads them (the
classifiers' epoch-mean loss and masked accuracy once per epoch in one transfer; the LLM's per-step loss at each
logging step, its token-weighted loss and perplexity once per split), one evaluation step shared by validation and
test. On XLA: one graph per training step
(`MpDeviceLoader`, `xm.optimizer_step`) and `xm.save` checkpoints; natively (TorchNeuron or the stand-in): eager
steps on batches copied with `.to(device, non_blocking=True)` and `torch.save` checkpoints, as for any accelerator.

Per phase (setup and sanity check, training steps, validation, epoch ends, checkpoints, test, teardown) both sides
report: graphs compiled, graph executions, device->host transfers, host syncs, `.item()`-style scalar reads, CPU
fallbacks and main-thread CPU ms (per step for training steps); and per job the time from process start to the first
step done and the wall time. Each side runs in a fresh process, so neither finds graphs the other compiled. The
targets (`targets`) bound the plugin's costs relative to the twin's: on XLA the transfers count, natively the host
syncs (transfers queued without waiting are cheap there).

`--floor` adds a third run: the plugin's job with Lightning's per-step machinery left out (`_BareAdvance`), the host
time per training step that no fix to that machinery could go below.

    PJRT_DEVICE=CPU python -m benchmarks.job_economy                      # MLP, the recipe's default job (~1 min)
    PJRT_DEVICE=CPU python -m benchmarks.job_economy --floor              # and the bare-loop floor (~1.5 min)
    PJRT_DEVICE=CPU python -m benchmarks.job_economy --workloads vit bert  # shortened jobs, counts
    PJRT_DEVICE=CPU python -m benchmarks.job_economy --workloads llm      # the LLM recipe's default job (~2 min)
    LIGHTNING_TRN_STANDIN=1 .venv-native/bin/python -m benchmarks.job_economy  # native, on the stand-in
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loops.fetchers import _DataFetcher
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.utilities.model_helpers import is_overridden

from benchmarks._harness import (
    clip_gradients,
    configure_optimization,
    describe_machine,
    format_table,
    wait_for_device,
)
from lightning_trn.recipes.classifier import ClassifierModule
from lightning_trn.recipes.cli import load_config
from lightning_trn.recipes.common import Recipe, build_trainer
from lightning_trn.runtime import RuntimeMetrics, get_runtime

#: phases in job order
PHASES = ("setup", "train", "validation", "epoch end", "checkpoint", "test", "teardown")

#: the job per workload: the recipe's defaults for MLP and the LLM (one epoch of 160 steps, full validation and test
#: splits); ViT and BERT shortened to 2 epochs of a few batches
JOBS: dict[str, tuple[str, ...]] = {
    "mlp": (),
    "vit": (
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=20",
        "trainer.limit_val_batches=4",
        "trainer.limit_test_batches=4",
    ),
    "bert": (
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=6",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "data.batch_size=8",
        "data.max_length=64",
    ),
    "llm": (),
}


@dataclass
class PhaseCost:
    """What one phase of a job cost: runtime counters and main-thread CPU time, and how often it was entered."""

    metrics: RuntimeMetrics = field(default_factory=RuntimeMetrics)
    cpu_s: float = 0.0
    steps: int = 0

    @property
    def cpu_s_per_step(self) -> float:
        """Main-thread CPU seconds per training step counted in the phase (0 without steps)."""
        return self.cpu_s / self.steps if self.steps else 0.0


class Ledger:
    """Attributes counters and main-thread CPU time to the current phase. `enter(phase)` closes the current one:
    it waits for the device first (without cutting a graph), so executions land in the phase that launched them.
    Its own waits are not charged to any phase (natively each is a host sync)."""

    def __init__(self) -> None:
        self.phases = {name: PhaseCost() for name in PHASES}
        self.current = "setup"
        wait_for_device()  # whatever ran before the ledger: not part of what one wait costs
        before = get_runtime().metrics()
        wait_for_device()
        self._wait_cost = get_runtime().metrics() - before
        self._metrics = get_runtime().metrics()
        self._own = RuntimeMetrics()  # the ledger's own waits since the last `enter`
        self._cpu = time.thread_time()
        self.first_step_done: float | None = None

    def _wait(self) -> None:
        wait_for_device()
        self._own = self._own + self._wait_cost

    def enter(self, phase: str) -> None:
        self._wait()
        metrics, cpu = get_runtime().metrics(), time.thread_time()
        cost = self.phases[self.current]
        cost.metrics = cost.metrics + (metrics - self._metrics - self._own)
        cost.cpu_s += cpu - self._cpu
        self._metrics, self._cpu, self._own = metrics, cpu, RuntimeMetrics()
        self.current = phase

    def step_done(self, start: float) -> None:
        """Count a training step; the first one's end (device finished) is the job's time to first step."""
        self.phases["train"].steps += 1
        if self.first_step_done is None:
            self._wait()
            self.first_step_done = time.monotonic() - start


@dataclass
class JobResult:
    side: str
    phases: dict[str, PhaseCost]
    first_step_s: float
    wall_s: float
    test: dict[str, float]

    def per_phase(self, counter: str) -> dict[str, int]:
        """One runtime counter (`compiles`, `device_to_host`, ...) of each phase, in job order."""
        return {phase: getattr(self.phases[phase].metrics, counter) for phase in PHASES}


class _PhaseCallback(pl.Callback):
    """Moves the ledger from phase to phase at the Trainer's hooks; checkpoints through `trainer.save_checkpoint`."""

    def __init__(self, ledger: Ledger, start: float) -> None:
        self.ledger, self.start = ledger, start

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if "save_checkpoint" in vars(trainer):  # wrapped at `fit`'s setup already
            return
        save = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> None:
            previous = self.ledger.current
            self.ledger.enter("checkpoint")
            save(*args, **kwargs)
            self.ledger.enter(previous)

        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.ledger.current != "train":
            self.ledger.enter("train")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ledger.step_done(self.start)

    def on_validation_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self.ledger.enter("validation")

    def on_validation_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self.ledger.enter("epoch end")

    def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.ledger.current == "train":
            self.ledger.enter("epoch end")

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ledger.enter("teardown")  # the fit loop is done: next come Lightning's and the strategy's teardowns

    def on_test_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ledger.enter("test")

    def on_test_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ledger.enter("teardown")


def _recipe(workload: str) -> Recipe:
    from importlib import import_module

    return import_module(f"lightning_trn.recipes.{workload}").RECIPE


def _build(
    workload: str, out: str, overrides: Sequence[str] = ()
) -> tuple[Any, pl.LightningDataModule, pl.LightningModule]:
    recipe = _recipe(workload)
    cfg = load_config(recipe, [f"out_dir={out}", *JOBS[workload], *overrides])
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    return cfg, recipe.build_data(cfg), recipe.build_model(cfg)


def run_plugin(workload: str, start: float, overrides: Sequence[str] = (), bare_loop: bool = False) -> JobResult:
    """The recipe's job: `recipes.common.build_trainer` (bar, CSV logger, `last.ckpt`), `fit`, then `test`.
    `bare_loop`: its training steps through `_BareAdvance` instead of Lightning's loop (a measurement, see there)."""
    with tempfile.TemporaryDirectory() as out:
        cfg, data, module = _build(workload, out, overrides)
        ledger = Ledger()
        trainer = build_trainer(cfg, _recipe(workload))
        trainer.callbacks.insert(0, _PhaseCallback(ledger, start))
        if bare_loop:
            trainer.fit_loop.epoch_loop.advance = _BareAdvance(trainer.fit_loop.epoch_loop)
        trainer.fit(module, datamodule=data)
        results = trainer.test(module, datamodule=data, verbose=False)[0]
        ledger.enter("teardown")
    return JobResult(
        "plugin, bare loop" if bare_loop else "plugin",
        ledger.phases,
        ledger.first_step_done or 0.0,
        time.monotonic() - start,
        results,
    )


class _BareAdvance:
    """One training step of the recipe's job with Lightning's per-step machinery left out: what the plugin's step
    would cost if Lightning's hook dispatch, closure and optimizer/precision/strategy layers cost nothing. It keeps
    the job's own per-step work: the batch fetch, the callbacks' batch hooks (bar, checkpoint), `training_step` (the
    recipe's metric update and `self.log` calls, through the plugin's logging hooks), zero_grad, backward, the
    optimizer step, the plugin's graph cut, the logger connector, and the batch and step counters the loop reads. A
    floor to measure against, not a loop to train with: the recipe's plain case only (`_check_plain_case`).
    Replaces `loop.advance`; at the first step it checks the case and finds the callbacks' batch hooks once."""

    def __init__(self, loop: _TrainingEpochLoop) -> None:
        self.loop = loop
        #: per batch hook, the callbacks' overrides (bound methods), found at the first step
        self.hooks: dict[str, list[Callable[..., None]]] | None = None

    def __call__(self, data_fetcher: _DataFetcher) -> None:
        loop, trainer = self.loop, self.loop.trainer
        if self.hooks is None:
            _check_plain_case(trainer)
            self.hooks = {
                hook: [
                    getattr(callback, hook)
                    for callback in trainer.callbacks
                    if is_overridden(hook, callback, pl.Callback)
                ]
                for hook in ("on_train_batch_start", "on_train_batch_end")
            }
        module, strategy, connector = trainer.lightning_module, trainer.strategy, trainer._logger_connector
        batch, _, _ = next(data_fetcher)
        batch_idx = loop.batch_idx + 1
        loop.batch_progress.is_last_batch = data_fetcher.done
        batch = strategy.batch_to_device(batch, dataloader_idx=0)
        loop.batch_progress.increment_ready()
        connector.on_batch_start(batch)
        for hook in self.hooks["on_train_batch_start"]:
            hook(trainer, module, batch, batch_idx)
        strategy.on_train_batch_start(batch, batch_idx)
        loop.batch_progress.increment_started()
        optimizer = trainer.optimizers[0]
        module._current_fx_name = "training_step"
        with strategy.precision_plugin.train_step_context():
            loss = module.training_step(batch, batch_idx)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        strategy.runtime.sync()
        strategy._cut_after_step = True
        loop.automatic_optimization.optim_progress.optimizer.step.increment_completed()
        loop.batch_progress.increment_processed()
        outputs = {"loss": loss.detach()}
        for hook in self.hooks["on_train_batch_end"]:
            hook(trainer, module, outputs, batch, batch_idx)
        connector.on_batch_end()
        loop.batch_progress.increment_completed()
        connector.update_train_step_metrics()


def _check_plain_case(trainer: pl.Trainer) -> None:
    """Refuse a job `_BareAdvance` would run differently from Lightning (set by `--set`, say)."""
    plain = {
        "automatic optimization": trainer.lightning_module.automatic_optimization,
        "one optimizer": len(trainer.optimizers) == 1,
        "no LR scheduler": not trainer.lr_scheduler_configs,
        "no gradient accumulation": trainer.accumulate_grad_batches == 1,
        "no gradient clipping": trainer.gradient_clip_val is None,
        "one process": trainer.world_size == 1,
        "precision 32-true or bf16-mixed": trainer.precision in ("32-true", "bf16-mixed"),
    }
    missing = [name for name, holds in plain.items() if not holds]
    if missing:
        raise ValueError(f"--floor measures the plain case only; this job lacks: {', '.join(missing)}.")


class _ClassifierTotals:
    """What the classifier recipes compute (`ClassifierModule._step`): the weighted cross-entropy, and epoch sums on
    the device as Lightning reduces their logs: batch loss x batch rows and batch rows (the loss's epoch mean), correct
    and real (weighted) rows (MaskedAccuracy). Training values are read at each epoch end; nothing per step. One
    transfer reads all four sums."""

    epoch_values, step_values = True, False

    def __init__(self, device: torch.device) -> None:
        # uploaded, not created on the device: a lazy `zeros` would make each epoch's first step a graph of its own
        self.sums = torch.zeros(4).to(device)

    def loss(self, module: ClassifierModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's loss; its values wait for `add`."""
        logits = module.logits(batch)
        weight = batch["weight"].to(torch.float32)
        losses = F.cross_entropy(logits.float(), batch["y"], reduction="none")
        correct = ((logits.argmax(dim=-1) == batch["y"]).to(torch.float32) * weight).sum()
        loss = (losses * weight).sum() / weight.sum().clamp_min(1.0)
        self._pending = (loss, float(len(weight)), correct, weight.sum())
        return loss

    def add(self) -> None:
        loss, rows, correct, weight = self._pending
        self.sums = self.sums + torch.stack([loss.detach() * rows, torch.full_like(loss, rows), correct, weight])

    def read(self, stage: str) -> dict[str, float]:
        loss_rows, rows, correct, weight = self.sums.cpu().tolist()
        return {f"{stage}_loss": loss_rows / rows, f"{stage}_acc": correct / max(weight, 1.0)}


class _TokenTotals:
    """What the LLM recipe computes (`CausalLM`): the training loss per step (mean over its tokens), read at each of
    Lightning's logging steps (`log_every_n_steps`), no training epoch values; per evaluation split the summed
    token losses and the token count on the device (`TokenMean`), read once: mean loss and perplexity."""

    epoch_values, step_values = False, True

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(2).to(device)  # uploaded, as `_ClassifierTotals.sums`

    def loss(self, module: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        total, count = module.loss_sum(batch)
        self._pending = (total, count)
        return total / count

    def add(self) -> None:
        total, count = self._pending
        self.sums = self.sums + torch.stack([total.detach(), count.to(total.dtype)])

    def read(self, stage: str) -> dict[str, float]:
        total, count = self.sums.cpu().tolist()
        mean = total / max(count, 1.0)
        return {f"{stage}_loss": mean, f"{stage}_ppl": math.exp(mean)}


def _totals_for(module: pl.LightningModule) -> type:
    """The twin's values for the recipe's module."""
    from lightning_trn.recipes.llm import CausalLM

    if isinstance(module, ClassifierModule):
        return _ClassifierTotals
    if isinstance(module, CausalLM):
        return _TokenTotals
    raise NotImplementedError(f"no hand-written twin for {type(module).__name__}")


class _XlaTwin:
    """What the expert's job does on torch_xla: batches through `MpDeviceLoader`'s loader, a graph cut after each
    step, `xm.optimizer_step`, `xm.save`."""

    def __init__(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        self._torch_xla, self._xm = torch_xla, xm
        self.device = torch_xla.device()

    def batches(self, loader: Any, count: int) -> Iterator[Any]:
        from torch_xla.distributed.parallel_loader import ParallelLoader

        parallel = ParallelLoader(loader, [self.device])  # what `MpDeviceLoader` iterates, kept to close it
        try:
            yield from itertools.islice(parallel.per_device_loader(self.device), count)
        finally:  # a loader left mid-epoch keeps its threads: joined here, not killed at interpreter exit (abort)
            parallel.close()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._xm.optimizer_step(optimizer)

    def end_step(self) -> None:
        self._torch_xla.sync()

    def save(self, state: dict[str, Any], path: str) -> None:
        self._xm.save(state, path)


class _NativeTwin:
    """What the expert's job does on the native device, as for any PyTorch accelerator: batches copied with
    `.to(device, non_blocking=True)`, eager steps, `torch.save` of the device state."""

    def __init__(self) -> None:
        self.device = get_runtime().device()

    def batches(self, loader: Any, count: int) -> Iterator[Any]:
        for batch in itertools.islice(loader, count):
            yield {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def end_step(self) -> None:
        """Eager: nothing to cut."""

    def save(self, state: dict[str, Any], path: str) -> None:
        torch.save(state, path)


def run_expert(workload: str, start: float, overrides: Sequence[str] = ()) -> JobResult:
    """The same job written by hand for the backend (see the module docstring): the recipe's optimizer and LR
    schedule (`configure_optimizers`, stepped per step or epoch as it asks), its gradient clipping, the values it logs
    (`_totals_for`) read where Lightning reads them."""
    twin = _XlaTwin() if get_runtime().name == "xla" else _NativeTwin()
    with tempfile.TemporaryDirectory() as out:
        cfg, data, module = _build(workload, out, overrides)
        ledger = Ledger()
        module.to(twin.device)
        Totals = _totals_for(module)
        limits = {key: cfg.trainer.get(f"limit_{key}_batches", 1.0) for key in ("train", "val", "test")}

        def count(loader: Any, limit: Any) -> int:
            return len(loader) if isinstance(limit, float) else min(int(limit), len(loader))

        def batches(loader: Any, limit: Any) -> Iterator[Any]:
            return twin.batches(loader, count(loader, limit))

        @torch.no_grad()
        def evaluate(loader: Any, limit: Any, stage: str) -> dict[str, float]:
            module.eval()
            totals = Totals(twin.device)
            for batch in batches(loader, limit):
                totals.loss(module, batch)
                totals.add()
                twin.end_step()
            module.train()
            return totals.read(stage)

        # built once, as Lightning does: the seeded shuffle then differs from epoch to epoch
        train_loader, val_loader = data.train_dataloader(), data.val_dataloader()
        optimization = configure_optimization(module, cfg.trainer.max_epochs * count(train_loader, limits["train"]))
        optimizer, step, logged = optimization.optimizer, 0, []
        for epoch in range(cfg.trainer.max_epochs):
            ledger.enter("train")
            totals = Totals(twin.device)
            for batch in batches(train_loader, limits["train"]):
                optimizer.zero_grad()
                loss = totals.loss(module, batch)
                loss.backward()
                clip_gradients(module, cfg)
                twin.optimizer_step(optimizer)
                optimization.after_step()
                if Totals.epoch_values:
                    totals.add()
                twin.end_step()
                step += 1
                if Totals.step_values and step % cfg.trainer.log_every_n_steps == 0:
                    logged.append(float(loss.detach().cpu()))  # the logger's value, after the step's cut
                ledger.step_done(start)
            ledger.enter("validation")
            evaluate(val_loader, limits["val"], "val")
            ledger.enter("epoch end")
            if Totals.epoch_values:
                totals.read("train")
            optimization.after_epoch()
            ledger.enter("checkpoint")
            state = {"state_dict": module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            if optimization.scheduler is not None:
                state["lr_scheduler"] = optimization.scheduler.state_dict()
            twin.save(state, os.path.join(out, "last.ckpt"))
        ledger.enter("test")
        test = evaluate(data.test_dataloader(), limits["test"], "test")
        ledger.enter("teardown")
    return JobResult("expert", ledger.phases, ledger.first_step_done or 0.0, time.monotonic() - start, test)


def _row(result: JobResult, phase: str) -> list[Any]:
    cost = result.phases[phase]
    m = cost.metrics
    fallbacks = sum(m.cpu_fallbacks.values())
    cpu = f"{1e3 * cost.cpu_s_per_step:.2f} /step" if phase == "train" and cost.steps else f"{1e3 * cost.cpu_s:.0f}"
    return [
        result.side,
        phase,
        m.compiles,
        m.executions,
        m.device_to_host,
        m.host_syncs,
        m.scalar_reads,
        fallbacks,
        cpu,
    ]


def _total(result: JobResult) -> RuntimeMetrics:
    return sum((cost.metrics for cost in result.phases.values()), RuntimeMetrics())


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ("1.00" if a == b else "inf")


#: per backend, the device->host cost `targets` bounds at 2x the twin's: on XLA each transfer waits for its graph (a
#: batch of tensors can be one transfer); natively copies can be queued without waiting, and the waits are the cost
SYNC_COUNTERS = {"xla": ("device->host transfers", "device_to_host"), "native": ("host syncs", "host_syncs")}


def targets(plugin: JobResult, expert: JobResult, backend: str | None = None) -> list[list[Any]]:
    """The plugin's job against the twin's on `backend` (default: this process's), each bound relative to the twin:
    [target, plugin's figure, limit, met]."""
    p, e = _total(plugin), _total(expert)
    per_step = [result.phases["train"].cpu_s_per_step for result in (plugin, expert)]
    sync_name, sync_counter = SYNC_COUNTERS[backend or get_runtime().name]
    rows = [
        ["graphs compiled <= the twin's", p.compiles, e.compiles],
        [f"{sync_name} <= 2x the twin's", getattr(p, sync_counter), 2 * getattr(e, sync_counter)],
        [".item() reads <= the twin's (values read in batched transfers)", p.scalar_reads, e.scalar_reads],
        ["CPU fallbacks <= the twin's", sum(p.cpu_fallbacks.values()), sum(e.cpu_fallbacks.values())],
        ["main-thread CPU ms per training step <= 1.1x", round(1e3 * per_step[0], 2), round(1.1e3 * per_step[1], 2)],
        [
            "process start -> first step done (s) <= 1.05x",
            round(plugin.first_step_s, 2),
            round(1.05 * expert.first_step_s, 2),
        ],
    ]
    return [[name, value, limit, "met" if value <= limit else "MISSED"] for name, value, limit in rows]


def summary(workload: str, plugin: JobResult, expert: JobResult) -> str:
    """The per-phase table and the per-job totals and ratios, as Markdown."""
    header = [
        "side",
        "phase",
        "compiles",
        "executions",
        "D2H transfers",
        "host syncs",
        ".item() reads",
        "CPU fallbacks",
        "main-thread CPU ms",
    ]
    rows = [_row(result, phase) for phase in PHASES for result in (plugin, expert)]
    p, e = _total(plugin), _total(expert)
    train_p, train_e = plugin.phases["train"], expert.phases["train"]
    per_step = [train_p.cpu_s_per_step, train_e.cpu_s_per_step]
    totals = format_table(
        ["per job", "plugin", "expert", "plugin / expert"],
        [
            ["graphs compiled", p.compiles, e.compiles, _ratio(p.compiles, e.compiles)],
            ["executions", p.executions, e.executions, _ratio(p.executions, e.executions)],
            ["device->host transfers", p.device_to_host, e.device_to_host, _ratio(p.device_to_host, e.device_to_host)],
            ["host syncs", p.host_syncs, e.host_syncs, _ratio(p.host_syncs, e.host_syncs)],
            [".item() reads", p.scalar_reads, e.scalar_reads, _ratio(p.scalar_reads, e.scalar_reads)],
            [
                "CPU fallbacks",
                sum(p.cpu_fallbacks.values()),
                sum(e.cpu_fallbacks.values()),
                _ratio(sum(p.cpu_fallbacks.values()), sum(e.cpu_fallbacks.values())),
            ],
            ["training steps", train_p.steps, train_e.steps, _ratio(train_p.steps, train_e.steps)],
            [
                "main-thread CPU ms per training step",
                f"{1e3 * per_step[0]:.2f}",
                f"{1e3 * per_step[1]:.2f}",
                _ratio(*per_step),
            ],
            [
                "process start -> first step done (s)",
                f"{plugin.first_step_s:.2f}",
                f"{expert.first_step_s:.2f}",
                _ratio(plugin.first_step_s, expert.first_step_s),
            ],
            ["wall (s)", f"{plugin.wall_s:.1f}", f"{expert.wall_s:.1f}", _ratio(plugin.wall_s, expert.wall_s)],
            *[
                [f"test: {name}", f"{value:.4f}", f"{expert.test[name]:.4f}", ""]
                for name, value in sorted(plugin.test.items())
                if name in expert.test
            ],
        ],
    )
    goals = format_table(["target", "plugin", "limit", ""], targets(plugin, expert))
    return f"### {workload}\n\n{format_table(header, rows)}\n\n{totals}\n\n{goals}\n"


def _run_side(side: str, workload: str, spawned_at: float, path: str, overrides: Sequence[str]) -> None:
    """In a child process: run one side's job and write its result to `path` (JSON)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if side == "expert":
            result = run_expert(workload, spawned_at, overrides)
        else:
            result = run_plugin(workload, spawned_at, overrides, bare_loop=side == "floor")
    phases = {
        name: {"metrics": asdict(cost.metrics), "cpu_s": cost.cpu_s, "steps": cost.steps}
        for name, cost in result.phases.items()
    }
    Path(path).write_text(json.dumps({**asdict(result), "phases": phases}))


#: what a launcher sets for one process of a multi-process job: a side's job is one process of its own (an inherited
#: `PJRT_LOCAL_PROCESS_RANK=1`, say, makes torch_xla's `xm.save` skip writing on a "non-master" ordinal)
_LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "PJRT_LOCAL_PROCESS_RANK",
    "PJRT_LOCAL_PROCESS_COUNT",
    "NEURON_PJRT_PROCESS_INDEX",
    "NEURON_PJRT_WORLD_SIZE",
    "NEURON_PJRT_PROCESSES_NUM_DEVICES",
)


def _spawn(side: str, workload: str, overrides: Sequence[str]) -> JobResult:
    """One side's job in a fresh process: nothing compiled before it, and its start is the job's start."""
    env = {name: value for name, value in os.environ.items() if name not in _LAUNCHER_VARIABLES}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        spawned_at = time.monotonic()  # CLOCK_MONOTONIC: the same clock in the child
        subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.job_economy",
                "--side",
                side,
                "--workloads",
                workload,
                "--spawned-at",
                repr(spawned_at),
                "--result",
                path,
                "--set",
                *overrides,
            ],
            check=True,
            env=env,
        )
        data = json.loads(Path(path).read_text())
    phases = {
        name: PhaseCost(RuntimeMetrics(**cost["metrics"]), cost["cpu_s"], cost["steps"])
        for name, cost in data.pop("phases").items()
    }
    return JobResult(phases=phases, **data)


def main(argv: Sequence[str] | None = None) -> dict[str, tuple[JobResult, ...]]:
    """Per workload: the plugin's and the twin's results, and with `--floor` the bare loop's after them."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.job_economy", description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(JOBS), default=["mlp"])
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="recipe config overrides for every side's job, e.g. trainer.max_epochs=2",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run the plugin's job with Lightning's per-step machinery left out (`_BareAdvance`): "
        "the host time per step the plugin could reach if that machinery cost nothing",
    )
    parser.add_argument("--side", choices=("plugin", "expert", "floor"), help=argparse.SUPPRESS)  # a child's run
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        _run_side(args.side, args.workloads[0], args.spawned_at, args.result, args.set)
        return {}
    sides = ("plugin", "expert", "floor") if args.floor else ("plugin", "expert")
    results = {workload: tuple(_spawn(side, workload, args.set) for side in sides) for workload in args.workloads}
    print(f"\n{describe_machine()}\n")
    for workload, (plugin, expert, *floor) in results.items():
        print(summary(workload, plugin, expert))
        if floor:
            print(floor_summary(plugin, expert, floor[0]))
    return results


def floor_summary(plugin: JobResult, expert: JobResult, floor: JobResult) -> str:
    """Host time per training step of the plugin, its bare-loop floor and the twin (and the graphs each compiled
    while training: a compile's time counts in the steps), as Markdown."""
    twin_per_step = expert.phases["train"].cpu_s_per_step
    return (
        format_table(
            ["main-thread CPU per training step", "ms", "/ expert", "compiles while training"],
            [
                [
                    result.side,
                    f"{1e3 * result.phases['train'].cpu_s_per_step:.2f}",
                    _ratio(result.phases["train"].cpu_s_per_step, twin_per_step),
                    result.phases["train"].metrics.compiles,
                ]
                for result in (plugin, floor, expert)
            ],
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
