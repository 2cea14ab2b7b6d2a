"""`CompileMonitor`: graph compilations and executions per phase, and warnings when training keeps compiling."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_trn.runtime import RuntimeMetrics, get_runtime

WARMUP, STEADY, VALIDATION = "warmup", "steady", "validation"
#: the first switches between training and validation each compile a graph once (measured on XLA:CPU: the first
#: training step after validation and the second validation run each add one); after this many epochs, with
#: constant input shapes, every graph has been seen and any compile means the graph keeps changing.
SETTLE_EPOCHS = 2


def _batch_shapes(batch: Any) -> tuple[tuple[int, ...], ...]:
    """Shapes of the tensors in a batch, in order (host metadata: reading them does not sync the device)."""
    shapes: list[tuple[int, ...]] = []
    apply_to_collection(batch, torch.Tensor, lambda t: shapes.append(tuple(t.shape)))
    return tuple(shapes)


def describe_shape_changes(shapes: set[tuple[tuple[int, ...], ...]]) -> str:
    """Which input tensor and dimension took more than one size, with the likely cause."""
    if len(shapes) < 2:
        return (
            "input shapes did not change, so look for graph changes from Python values (a step-dependent scalar, "
            "data-dependent control flow, a `.item()` in the step)"
        )
    ordered = sorted(shapes)
    parts = []
    for index in range(max(len(s) for s in ordered)):
        sizes = [s[index] for s in ordered if index < len(s)]
        for dim in range(max(len(size) for size in sizes)):
            seen = sorted({size[dim] for size in sizes if dim < len(size)})
            if len(seen) > 1:
                cause = "batch size: set `drop_last=True`" if dim == 0 else "sequence length: pad to fixed lengths"
                shown = ", ".join(map(str, seen[:8])) + (", ..." if len(seen) > 8 else "")
                parts.append(f"input {index} dim {dim} took sizes {shown} ({cause})")
    if not parts:
        return "the number of input tensors changed between batches"
    return "; ".join(parts)


class CompileMonitor(Callback):
    """Counts compilations and executions in warm-up (first `warmup_steps` training batches), steady-state training
    and validation, from the runtime's cumulative counters, and logs them to the Trainer's loggers at epoch end.

    Warns when steady-state training compiles while input shapes vary (naming the input and dimension: batch size
    or sequence length), or compiles at all once `SETTLE_EPOCHS` epochs of train/validation switches have been seen;
    when validation compiles after its first two runs; and when ops fall back to the CPU. Counters are read only at
    phase boundaries and epoch end, never per step; the monitor never cuts a graph or syncs, so it does not change
    what is compiled.
    """

    def __init__(self, warmup_steps: int = 2) -> None:
        if warmup_steps < 1:
            raise ValueError(f"`warmup_steps={warmup_steps}`: the first training step always compiles; use >= 1.")
        self.warmup_steps = warmup_steps
        #: cumulative {phase: {"compiles": n, "executions": n}} since the start of the run
        self.summary: dict[str, dict[str, int]] = {}
        self._last: RuntimeMetrics | None = None
        self._start: RuntimeMetrics | None = None
        self._phase = WARMUP
        self._train_batches = 0
        self._validation_runs = 0
        self._epoch_steady_compiles = 0
        self._epoch_validation_compiles = 0
        self._train_shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._reported_fallbacks: set[str] = set()

    def _account(self, phase: str) -> int:
        """Attribute the counters since the last read to `phase`; returns the compiles added."""
        now = get_runtime().metrics()
        delta = now - (self._last or now)
        self._last = now
        counts = self.summary.setdefault(phase, {"compiles": 0, "executions": 0})
        counts["compiles"] += delta.compiles
        counts["executions"] += delta.executions
        if phase == STEADY:
            self._epoch_steady_compiles += delta.compiles
        return delta.compiles

    def _train_phase(self) -> str:
        return WARMUP if self._train_batches < self.warmup_steps else STEADY

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._start = self._last = get_runtime().metrics()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._train_batches >= self.warmup_steps:
            self._train_shapes.add(_batch_shapes(batch))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._train_batches += 1
        if self._train_batches == self.warmup_steps:
            self._account(WARMUP)
            self._train_shapes = {_batch_shapes(batch)}  # the steady state is judged against the warm-up shape

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._account(self._train_phase())

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compiles = self._account(VALIDATION)
        self._validation_runs += 1
        if self._validation_runs > SETTLE_EPOCHS:
            self._epoch_validation_compiles += compiles

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._account(self._train_phase())
        epoch = trainer.current_epoch
        if self._epoch_steady_compiles and (len(self._train_shapes) > 1 or epoch >= SETTLE_EPOCHS):
            rank_zero_warn(
                f"CompileMonitor: steady-state training compiled {self._epoch_steady_compiles} new graph(s) in epoch "
                f"{epoch} (after {self.warmup_steps} warm-up steps); each compile stalls training. Likely dynamic "
                f"shapes: {describe_shape_changes(self._train_shapes)}."
            )
        if self._epoch_validation_compiles:
            rank_zero_warn(
                f"CompileMonitor: validation compiled {self._epoch_validation_compiles} new graph(s) in epoch {epoch} "
                "although it ran before: its input shapes change between runs (e.g. a smaller last batch)."
            )
        self._warn_fallbacks()
        self._log(trainer)
        self._epoch_steady_compiles = self._epoch_validation_compiles = 0

    def _warn_fallbacks(self) -> None:
        fallbacks = (self._last - self._start).cpu_fallbacks if self._last and self._start else {}
        new = {name: count for name, count in fallbacks.items() if name not in self._reported_fallbacks}
        if new:
            listed = ", ".join(f"{name} x{count}" for name, count in sorted(new.items()))
            rank_zero_warn(
                f"CompileMonitor: ops ran on the CPU instead of the device ({listed}): each one copies tensors to the "
                "host and splits the graph. Replace them with device-friendly ops (e.g. masks instead of nonzero)."
            )
            self._reported_fallbacks.update(new)

    def _log(self, trainer: pl.Trainer) -> None:
        figures: dict[str, float] = {}
        for phase, counts in self.summary.items():
            figures[f"compile/{phase}_compiles"] = counts["compiles"]
            figures[f"compile/{phase}_executions"] = counts["executions"]
        if self._last and self._start:
            figures["compile/cpu_fallbacks"] = sum((self._last - self._start).cpu_fallbacks.values())
        for logger in trainer.loggers:
            logger.log_metrics(figures, step=trainer.global_step)
