"""Profilers on a Neuron run. Lightning's `XLAProfiler`: its traces stay open around the strategy's steps, where the
strategy cuts the graph; training, validation, test and predict (and manual optimization, whose optimizer step cuts
inside `training_step`) run to the end, with the same steps and no compile after warm-up. The run is also recorded as
a TensorBoard trace (docs/operations.md, "Profiling"); `PyTorchProfiler` keeps the graph-cut rhythm on XLA and
records the `neuron` device's ops natively (the PrivateUse1 activity)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.profilers import PyTorchProfiler, XLAProfiler
from models import RegressionModel, regression_loader
from torch import nn
from torch.profiler import ProfilerActivity

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.both


class Evaluated(RegressionModel):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])


class ManualOptimization(RegressionModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.manual_backward(loss)
        optimizer.step()  # the strategy's graph cut, inside the profiler's `training_step` trace
        return loss


class CompilesAfterWarmup(Callback):
    """Graphs compiled from the start of training batch `warmup` to the end of the last one (with validation every
    2 steps, batch 5 comes after two validation rounds, and after the first step following one)."""

    def __init__(self, warmup: int = 5) -> None:
        self.warmup, self.start, self.end = warmup, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.start = get_runtime().metrics().compiles

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end = get_runtime().metrics().compiles


@pytest.mark.xla_only
@pytest.mark.parametrize(("model", "port"), [(Evaluated, 9021), (ManualOptimization, 9022)])
def test_xla_profiler_profiles_every_stage(model, port, tmp_path):
    compiles = CompilesAfterWarmup()
    trainer = Trainer(
        accelerator="neuron",
        max_steps=8,
        limit_val_batches=2,
        val_check_interval=2,
        profiler=XLAProfiler(port=port),
        callbacks=[compiles],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    module = model()
    trainer.fit(module, regression_loader(n=8 * 16), regression_loader(n=32, shuffle=False))
    assert trainer.global_step == 8
    assert compiles.end - compiles.start == 0
    if model is Evaluated:
        assert trainer.test(module, regression_loader(n=32, shuffle=False), verbose=False)[0]["val_loss"] >= 0
        predictions = trainer.predict(module, regression_loader(n=32, shuffle=False))
        assert [p.shape for p in predictions] == [torch.Size([16, 1])] * 2


def _fit_profiled(tmp_path: Path, profiler) -> tuple[Trainer, CompilesAfterWarmup]:
    compiles = CompilesAfterWarmup()
    trainer = Trainer(
        accelerator="neuron",
        max_steps=8,
        limit_val_batches=2,
        val_check_interval=2,
        profiler=profiler,
        callbacks=[compiles],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Evaluated(), regression_loader(n=8 * 16), regression_loader(n=32, shuffle=False))
    return trainer, compiles


@pytest.mark.xla_only
def test_xla_profiler_records_a_tensorboard_trace(tmp_path: Path):
    trainer, compiles = _fit_profiled(tmp_path, XLAProfiler(port=9023))
    assert trainer.global_step == 8 and compiles.end - compiles.start == 0
    (trace,) = (tmp_path / "xla_trace" / "plugins" / "profile").glob("*/*.trace.json.gz")
    assert list(trace.parent.glob("*.xplane.pb"))
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = [event.get("name", "") for event in events]
    # Lightning's step traces, the graphs the strategy cut and the device's execution of them
    assert sum(name.endswith(".training_step") for name in names) == 8
    assert sum(name.endswith(".validation_step") for name in names) == 2 * 4 + 2  # 4 rounds + sanity check
    assert any("ExecuteComputation" in name for name in names)


@pytest.mark.xla_only
def test_pytorch_profiler_keeps_the_graph_cut_rhythm(tmp_path: Path):
    trainer, compiles = _fit_profiled(tmp_path, PyTorchProfiler(dirpath=tmp_path, filename="prof"))
    plain, plain_compiles = _fit_profiled(tmp_path / "plain", None)
    assert trainer.global_step == plain.global_step == 8
    assert compiles.end - compiles.start == plain_compiles.end - plain_compiles.start == 0


@pytest.mark.native_only
def test_pytorch_profiler_with_the_neuron_activity(tmp_path: Path):
    """The PrivateUse1 (`neuron`) activity is accepted and the steps' ops are recorded. The stand-in has no device
    timeline (no profiler plugin): TorchNeuron adds one (docs/operations.md)."""
    profiler = PyTorchProfiler(
        dirpath=tmp_path,
        filename="prof",
        export_to_chrome=True,
        activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1],
    )
    trainer, _ = _fit_profiled(tmp_path, profiler)
    assert trainer.global_step == 8
    events = [e for trace in tmp_path.glob("*.pt.trace.json") for e in json.loads(trace.read_text())["traceEvents"]]
    names = {e["name"] for e in events if e.get("cat") in ("cpu_op", "user_annotation")}
    assert "aten::linear" in names and any(name.endswith(".validation_step") for name in names)
