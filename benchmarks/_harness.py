"""What the benchmarks share: the recipe workloads, a step clock, and the two training loops they compare.

- `run_plugin`: `Trainer(accelerator="neuron")` with a CSVLogger and the (default) progress bar, checkpointing off.
- `run_baseline`: the hand-written loop on the same module, data, batch and device. On XLA: `MpDeviceLoader`, the
  module's own `training_step`, `loss.backward()`, `xm.optimizer_step(opt)`, one `torch_xla.sync()` per step. On the
  native backend (TorchNeuron, or the stand-in): batches moved with `.to(device)`, `training_step`, `backward`,
  `opt.step()`: the eager loop of AWS's TorchNeuron examples.

Both also run on the CPU (`accelerator="cpu"`: stock Lightning, and a plain PyTorch loop), to measure what
Lightning's own loop costs per step without lightning_trn or XLA in it.

Both time only steady-state steps: the clock starts at the first step after `warmup` (once the device is idle) and
stops after the last step once the device finished (`xm.wait_device_ops()`, which waits without cutting a graph;
`torch.neuron.synchronize()` natively).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from lightning_trn.recipes.cli import load_config
from lightning_trn.recipes.common import Recipe
from lightning_trn.runtime import RuntimeMetrics, get_runtime


@dataclass(frozen=True)
class Workload:
    """A recipe (`recipes.<name>`, imported when first used) with small overrides, and how many steps to warm up
    (compiles) and to time."""

    name: str
    overrides: tuple[str, ...]
    warmup: int
    steps: int
    log_every_n_steps: int

    @property
    def recipe(self) -> Recipe:
        return importlib.import_module(f"lightning_trn.recipes.{self.name}").RECIPE


#: warm-up covers the first epoch end (MNIST-5k: 110 batches of 32) so every graph variant has compiled before timing;
#: BERT logs every 10 steps so that its ~20 timed steps include logging steps; the LLM logs every 10 steps (its
#: recipe's setting) and warms up past its first logging step (its epoch, 360 batches, does not end in the run)
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("mlp", (), warmup=120, steps=1000, log_every_n_steps=50),
        Workload("vit", (), warmup=115, steps=120, log_every_n_steps=50),
        Workload("bert", ("data.batch_size=8", "data.max_length=64"), warmup=4, steps=20, log_every_n_steps=10),
        Workload("llm", (), warmup=12, steps=40, log_every_n_steps=10),
    )
}


def add_workload_args(parser: argparse.ArgumentParser, repeats: int | None = None) -> None:
    """`--workloads`, `--steps`, `--warmup` (and `--repeats` when `repeats` is given as its default)."""
    parser.add_argument(
        "--workloads", nargs="+", choices=list(WORKLOADS), default=None, help="recipes to run (default: all)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per run (default per workload: "
        + ", ".join(f"{w.name} {w.steps}" for w in WORKLOADS.values())
        + ")",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed warm-up steps per run (default per workload: "
        + ", ".join(f"{w.name} {w.warmup}" for w in WORKLOADS.values())
        + ")",
    )
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats, help=f"runs per side (default {repeats})")


def selected_workloads(args: argparse.Namespace) -> list[Workload]:
    """The workloads named on the command line with `--steps` / `--warmup` applied."""
    chosen = [WORKLOADS[name] for name in args.workloads] if args.workloads else list(WORKLOADS.values())
    return [
        replace(
            w,
            steps=args.steps if args.steps is not None else w.steps,
            warmup=args.warmup if args.warmup is not None else w.warmup,
        )
        for w in chosen
    ]


@functools.cache
def _config_and_loader(name: str) -> tuple[DictConfig, DataLoader]:
    workload = WORKLOADS[name]
    cfg = load_config(workload.recipe, workload.overrides)
    return cfg, workload.recipe.build_data(cfg).train_dataloader()


def config_and_loader(workload: Workload) -> tuple[DictConfig, DataLoader]:
    """The recipe config and its training DataLoader (built once per process and shared by both sides)."""
    return _config_and_loader(workload.name)


def fresh_module(workload: Workload) -> pl.LightningModule:
    """A new module with the recipe's seed, so every run starts from the same weights and no Trainer is attached."""
    cfg, _ = config_and_loader(workload)
    pl.seed_everything(cfg.seed, verbose=False)
    return workload.recipe.build_model(cfg)


def clip_args(cfg: DictConfig) -> dict[str, Any]:
    """The recipe's gradient clipping (`trainer.gradient_clip_val` / `_algorithm`), as Trainer arguments."""
    return {
        key: cfg.trainer.get(key)
        for key in ("gradient_clip_val", "gradient_clip_algorithm")
        if cfg.trainer.get(key) is not None
    }


def clip_gradients(module: torch.nn.Module, cfg: DictConfig) -> None:
    """The recipe's gradient clipping by hand, as Lightning applies it before each optimizer step (none if unset)."""
    clip = clip_args(cfg)
    if "gradient_clip_val" not in clip:
        return
    if clip.get("gradient_clip_algorithm", "norm") == "norm":
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip["gradient_clip_val"])
    else:
        torch.nn.utils.clip_grad_value_(module.parameters(), clip["gradient_clip_val"])


@dataclass
class Optimization:
    """A module's optimizer and LR scheduler, as a hand-written loop drives them."""

    optimizer: torch.optim.Optimizer
    scheduler: Any | None = None
    #: Lightning's `interval`: "step" (after every optimizer step) or "epoch"
    interval: str = "epoch"

    def after_step(self) -> None:
        if self.scheduler is not None and self.interval == "step":
            self.scheduler.step()

    def after_epoch(self) -> None:
        if self.scheduler is not None and self.interval == "epoch":
            self.scheduler.step()


def configure_optimization(module: pl.LightningModule, total_steps: int) -> Optimization:
    """The module's own `configure_optimizers()` without a Trainer: a schedule that asks
    `trainer.estimated_stepping_batches` gets `total_steps` (the optimizer steps the hand-written loop runs, which is
    what Lightning answers for the same job). Lightning's return formats for one optimizer and at most one scheduler."""
    module.trainer = SimpleNamespace(estimated_stepping_batches=total_steps)  # type: ignore[assignment]
    try:
        conf = module.configure_optimizers()
    finally:
        module.trainer = None  # type: ignore[assignment]
    if isinstance(conf, torch.optim.Optimizer):
        return Optimization(conf)
    if isinstance(conf, dict) and set(conf) <= {"optimizer", "lr_scheduler"}:
        scheduler = conf.get("lr_scheduler")
        if isinstance(scheduler, dict):
            if set(scheduler) - {"scheduler", "interval", "frequency", "name"} or scheduler.get("frequency", 1) != 1:
                raise NotImplementedError(f"LR scheduler options beyond interval: {scheduler}")
            return Optimization(conf["optimizer"], scheduler["scheduler"], scheduler.get("interval", "epoch"))
        return Optimization(conf["optimizer"], scheduler)
    raise NotImplementedError(f"configure_optimizers() returned {type(conf).__name__}: one optimizer expected")


def wait_for_device() -> None:
    """Block until the device has run everything launched so far (on XLA without cutting the pending graph)."""
    if get_runtime().name == "xla":
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
    else:
        get_runtime().sync(wait=True)


@dataclass
class Measurement:
    """One run: steady-state steps/s and the runtime counters over the timed steps."""

    steps_per_s: float
    #: CPU time of this process (all its threads) per timed step: on XLA:CPU the device is the host, and this is
    #: less sensitive than wall time to other processes on the machine
    cpu_ms_per_step: float
    #: counters over the timed steps
    window: RuntimeMetrics
    #: counters over the whole run, warm-up included
    whole: RuntimeMetrics
    #: counters per timed step (from one step's start to the next's, so epoch ends count in the step that ends the
    #: epoch), when recorded
    per_step: list[RuntimeMetrics] = field(default_factory=list)
    #: per recorded step: "logging" (the logger writes this step), "epoch end" or "other"
    step_kinds: list[str] = field(default_factory=list)


class StepClock:
    """Call `step_start(i)` before every step `i` (0-based) and `finish()` after the last one."""

    def __init__(self, warmup: int, steps: int, record_steps: bool = False) -> None:
        self.warmup, self.steps, self.record_steps = warmup, steps, record_steps
        self._t0 = self._cpu0 = 0.0
        self._start = get_runtime().metrics()
        self._snapshots: list[RuntimeMetrics] = []
        self.step_kinds: list[str] = []
        self.result: Measurement | None = None

    def step_start(self, index: int) -> None:
        if index == self.warmup:
            wait_for_device()
            self._t0, self._cpu0 = time.perf_counter(), time.process_time()
            self._snapshots = [get_runtime().metrics()]
        elif index > self.warmup and self.record_steps:
            self._snapshots.append(get_runtime().metrics())

    def finish(self) -> None:
        wait_for_device()
        elapsed, cpu = time.perf_counter() - self._t0, time.process_time() - self._cpu0
        end = get_runtime().metrics()
        per_step = (
            [b - a for a, b in zip(self._snapshots, [*self._snapshots[1:], end], strict=True)]
            if self.record_steps
            else []
        )
        kinds = self.step_kinds[self.warmup :] or ["other"] * len(per_step)  # the hand-written loop never logs
        self.result = Measurement(
            self.steps / elapsed, 1e3 * cpu / self.steps, end - self._snapshots[0], end - self._start, per_step, kinds
        )


class _ClockCallback(pl.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.seen = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.clock.step_start(self.seen)
        self.seen += 1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.clock.record_steps:
            if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
                self.clock.step_kinds.append("epoch end")
            else:
                self.clock.step_kinds.append("logging" if trainer._logger_connector.should_update_logs else "other")
        if self.seen == self.clock.warmup + self.clock.steps:
            self.clock.finish()


def run_plugin(
    workload: Workload,
    record_steps: bool = False,
    bar_and_logger: bool = True,
    module_logging: bool = True,
    accelerator: str = "neuron",
) -> Measurement:
    """`Trainer(accelerator="neuron")`, CSVLogger + default progress bar, no checkpointing, no validation; the
    recipe's gradient clipping, and its LR scheduler as the module configures it.

    For a breakdown of the per-step cost: `bar_and_logger=False` turns the progress bar and the logger off,
    `module_logging=False` makes the module's `self.log` a no-op (as in the hand-written loop), and
    `accelerator="cpu"` runs stock Lightning on the CPU instead (no lightning_trn code in the loop).
    """
    cfg, loader = config_and_loader(workload)
    module = fresh_module(workload)
    if not module_logging:
        module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    clock = StepClock(workload.warmup, workload.steps, record_steps)
    with tempfile.TemporaryDirectory() as out:
        trainer = pl.Trainer(
            accelerator=accelerator,
            devices=1,
            max_epochs=-1,
            max_steps=workload.warmup + workload.steps,
            logger=CSVLogger(out, name="bench") if bar_and_logger else False,
            enable_progress_bar=bar_and_logger,
            log_every_n_steps=workload.log_every_n_steps,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=out,
            callbacks=[_ClockCallback(clock)],
            **clip_args(cfg),
        )
        trainer.fit(module, train_dataloaders=loader)
    del trainer, module
    gc.collect()
    assert clock.result is not None
    return clock.result


def _device_batches(loader: DataLoader, device: torch.device, loader_cuts: bool) -> Iterator[Any]:
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    # `batches_per_execution=sys.maxsize`: the loader never syncs (the plugin's setting)
    options = {} if loader_cuts else {"batches_per_execution": sys.maxsize}
    while True:  # one MpDeviceLoader per epoch, as the plugin's prefetcher
        yield from MpDeviceLoader(loader, device, **options)


def _host_batches(loader: DataLoader, device: torch.device | None = None) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, moved to `device` if given."""
    while True:
        for batch in loader:
            yield batch if device is None else move_data_to_device(batch, device)


def run_baseline(
    workload: Workload, record_steps: bool = False, accelerator: str = "neuron", loader_cuts: bool = True
) -> Measurement:
    """The hand-written loop around the module's own `training_step` (its `self.log` is a no-op here): torch_xla's
    on XLA, the eager one on the native backend; with `accelerator="cpu"`, the plain PyTorch loop on the CPU
    (`optimizer.step()`, no device, no sync). The recipe's gradient clipping before each optimizer step and the
    module's step-interval LR scheduler after it, as in the plugin's run (`configure_optimization`).

    `loader_cuts=False` builds `MpDeviceLoader` so that it never syncs, as the plugin does: by default it syncs before
    every batch, and that sync, with nothing left to run after the step's own, takes about the step's execution
    time, in which the host does not trace the next step."""
    cfg, loader = config_and_loader(workload)
    module = fresh_module(workload)
    optimizer_step: Callable[[torch.optim.Optimizer], Any]
    if accelerator == "cpu" or get_runtime().name == "native":
        device = torch.device("cpu") if accelerator == "cpu" else get_runtime().device()
        module.to(device)
        batches = _host_batches(loader, None if accelerator == "cpu" else device)

        def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
            optimizer.step()
    else:
        import torch_xla
        import torch_xla.core.xla_model as xm

        device = torch_xla.device()
        module.to(device)
        batches = _device_batches(loader, device, loader_cuts)

        def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
            xm.optimizer_step(optimizer)
            torch_xla.sync()

    module.train()
    optimization = configure_optimization(module, workload.warmup + workload.steps)
    optimizer = optimization.optimizer
    clock = StepClock(workload.warmup, workload.steps, record_steps)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")  # "no Trainer reference": the log is skipped
        for index in range(workload.warmup + workload.steps):
            clock.step_start(index)
            batch = next(batches)
            optimizer.zero_grad()
            loss = module.training_step(batch, index)
            loss.backward()
            clip_gradients(module, cfg)
            optimizer_step(optimizer)
            optimization.after_step()
    clock.finish()
    del module, optimizer, optimization, batches
    gc.collect()
    assert clock.result is not None
    return clock.result


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (pasteable into benchmarks/README.md)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def describe_machine() -> str:
    """One line: date, backend and device, host cores, versions, for the results table."""
    runtime = get_runtime()
    if runtime.name == "xla":
        import torch_xla.runtime as xr

        device = f"XLA device {xr.device_type()}"
    else:
        device = f"native backend, {runtime.detect_platform().reason}"
    return (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {device}, {os.cpu_count()} host cores, "
        f"torch {torch.__version__}, lightning {pl.__version__}"
    )
