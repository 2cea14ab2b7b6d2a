"""Lightning's `XLAProfiler` on a Neuron run (issue 17, item 4): its traces stay open around the strategy's steps,
where the strategy cuts the graph; training, validation, test and predict (and manual optimization, whose optimizer
step cuts inside `training_step`) run to the end, with the same steps and no compile after warm-up."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.profilers import XLAProfiler
from torch import nn

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.runtime import get_runtime
from models import RegressionModel, regression_loader

pytestmark = pytest.mark.xla_only


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


@pytest.mark.parametrize(("model", "port"), [(Evaluated, 9021), (ManualOptimization, 9022)])
def test_xla_profiler_profiles_every_stage(model, port, tmp_path):
    compiles = CompilesAfterWarmup()
    trainer = Trainer(accelerator="neuron", max_steps=8, limit_val_batches=2, val_check_interval=2,
                      profiler=XLAProfiler(port=port), callbacks=[compiles], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    module = model()
    trainer.fit(module, regression_loader(n=8 * 16), regression_loader(n=32, shuffle=False))
    assert trainer.global_step == 8
    assert compiles.end - compiles.start == 0
    if model is Evaluated:
        assert trainer.test(module, regression_loader(n=32, shuffle=False), verbose=False)[0]["val_loss"] >= 0
        predictions = trainer.predict(module, regression_loader(n=32, shuffle=False))
        assert [p.shape for p in predictions] == [torch.Size([16, 1])] * 2
