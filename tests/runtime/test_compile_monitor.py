"""CompileMonitor on real short fits, on both backends: silent for fixed shapes, names the dimension that varies,
and the ops that ran on the CPU (XLA:CPU's own fallbacks; on the stand-in, ops made CPU-fallback ops)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_trn
from benchmarks._harness import wait_for_device
from lightning_trn.pytorch.callbacks import CompileMonitor
from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.both


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    """Every test starts with no compiled graphs (native: Dynamo's per-code-object cache spans module instances)."""
    torch._dynamo.reset()


class RecordingLogger(Logger):
    """Keeps what the Trainer logs, to check what reaches a real logger and how often."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[dict[str, float], int]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((dict(metrics), step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class SequenceBatches(Dataset):
    """Whole batches of `(batch, length)` sequences, so each batch can have its own shape."""

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        self.shapes = shapes

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length = self.shapes[index]
        x = torch.randn(batch, length, generator=torch.Generator().manual_seed(index))
        return x, x.sum(dim=1, keepdim=True)


class SequenceLoss(nn.Module):
    """The loss of a sequence-sum regressor; optionally uses an op XLA cannot lower (median)."""

    def __init__(self, use_median: bool) -> None:
        super().__init__()
        self.use_median = use_median
        self.layer = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        feature = x.median(dim=1, keepdim=True).values if self.use_median else x.mean(dim=1, keepdim=True)
        return nn.functional.mse_loss(self.layer(feature) * x.shape[1], y)


class SequenceRegressor(LightningModule):
    """Predicts the sum of a sequence from its mean (or median). Its loss goes through `lightning_trn.compile`:
    graphs per shape with `torch.compile(backend="neuron")` on the native backend, unchanged on XLA."""

    def __init__(
        self,
        shapes: list[tuple[int, int]],
        val_shapes: list[tuple[int, int]],
        use_median: bool = False,
        growing_window: bool = False,
    ) -> None:
        super().__init__()
        self.shapes, self.val_shapes = shapes, val_shapes
        self.growing_window = growing_window
        self.loss = lightning_trn.compile(SequenceLoss(use_median))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.growing_window and self.training:  # a graph that changes every step although inputs do not
            x = x[:, : 1 + self.global_step]
        return self.loss(x, y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(SequenceBatches(self.shapes), batch_size=None)

    def val_dataloader(self):
        return DataLoader(SequenceBatches(self.val_shapes), batch_size=None)


class IdleDeviceAtReads(Callback):
    """Waits (without cutting a graph) until the device is idle at each hook where the monitor reads the counters;
    listed before the monitor. torch_xla counts an execution when it finishes and the monitor does not wait, so
    without this a step still running at a phase boundary is counted in the next phase."""

    def _wait(self, *args: Any) -> None:
        wait_for_device()

    on_train_batch_end = on_validation_start = on_validation_end = on_train_epoch_end = _wait


def fit(
    model: LightningModule, epochs: int = 2, idle_at_reads: bool = False
) -> tuple[CompileMonitor, RecordingLogger, list[str]]:
    monitor, logger = CompileMonitor(warmup_steps=2), RecordingLogger()
    callbacks = [IdleDeviceAtReads(), monitor] if idle_at_reads else [monitor]
    trainer = Trainer(
        accelerator="neuron",
        max_epochs=epochs,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return monitor, logger, [str(w.message) for w in caught if "CompileMonitor" in str(w.message)]


def test_fixed_shapes_stay_silent_and_figures_reach_the_logger_once_per_epoch():
    monitor, logger, messages = fit(SequenceRegressor([(4, 11)] * 6, [(4, 11)] * 2), epochs=4, idle_at_reads=True)
    assert messages == []
    if get_runtime().name == "xla":  # graph executions: an eager device has none to count
        # one graph per training step: 4 epochs x 6 steps, minus the 2 warm-up steps
        assert monitor.summary["steady"]["executions"] == 4 * 6 - 2
    compile_calls = [metrics for metrics, _ in logger.calls if "compile/steady_compiles" in metrics]
    assert len(compile_calls) == 4  # at each epoch end, not per step
    # once train/validation switching has been seen (epochs 0-1), nothing compiles any more
    assert compile_calls[-1]["compile/steady_compiles"] == compile_calls[1]["compile/steady_compiles"]
    assert compile_calls[-1]["compile/validation_compiles"] == compile_calls[1]["compile/validation_compiles"]
    assert compile_calls[-1]["compile/cpu_fallbacks"] == 0


def test_variable_sequence_length_is_flagged_and_named():
    shapes = [(4, 13), (4, 13), (4, 14), (4, 15), (4, 16), (4, 17)]
    monitor, _, messages = fit(SequenceRegressor(shapes, [(4, 13)]), epochs=1)
    assert monitor.summary["steady"]["compiles"] >= 4
    assert len(messages) == 1
    assert "steady-state training compiled" in messages[0]
    assert "input 0 dim 1 took sizes 13, 14, 15, 16, 17 (sequence length" in messages[0]
    assert "dim 0" not in messages[0]


@pytest.mark.xla_only  # Dynamo stops recompiling a frame after 8 graphs (`cache_size_limit`): no epoch-2 compiles
def test_graph_changing_with_constant_inputs_is_flagged_once_switches_settled():
    monitor, _, messages = fit(SequenceRegressor([(4, 40)] * 5, [(4, 40)], growing_window=True), epochs=3)
    steady = [m for m in messages if "steady-state training compiled" in m]
    assert len(steady) == 1 and "in epoch 2" in steady[0]
    assert "input shapes did not change" in steady[0]


def test_smaller_last_batch_is_named_as_a_batch_size_change():
    monitor, _, messages = fit(SequenceRegressor([(6, 19)] * 4 + [(3, 19)], [(6, 19)]), epochs=1)
    assert monitor.summary["steady"]["compiles"] >= 1
    assert any("input 0 dim 0 took sizes 3, 6 (batch size: set `drop_last=True`)" in m for m in messages)


def median_on_the_host() -> contextlib.AbstractContextManager:
    """XLA:CPU runs `aten::median` on the host by itself; the stand-in does once told to, as TorchNeuron would."""
    if get_runtime().name == "native":
        from lightning_trn import standin

        return standin.host_ops(["aten::median"])
    return contextlib.nullcontext()


def test_cpu_fallbacks_are_reported_once():
    with median_on_the_host():
        _, logger, messages = fit(SequenceRegressor([(4, 21)] * 4, [(4, 21)], use_median=True))
    fallback_messages = [m for m in messages if "ran on the CPU" in m]
    assert len(fallback_messages) == 1 and "aten::median" in fallback_messages[0]
    last = [metrics for metrics, _ in logger.calls if "compile/cpu_fallbacks" in metrics][-1]
    assert last["compile/cpu_fallbacks"] > 0


def test_warmup_must_cover_the_first_step():
    with pytest.raises(ValueError, match="warmup_steps=0"):
        CompileMonitor(warmup_steps=0)
