"""Compile and transfer economy of a whole job (issue 19): counts per phase that `benchmarks/job_economy.py` measures
for the recipes, asserted here for a small model so a regression fails CI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch import nn

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.runtime import get_runtime
from models import RegressionModel, regression_loader

pytestmark = pytest.mark.xla_only  # the counts are torch_xla's


class Deep(RegressionModel):
    """Several layers (10 parameter tensors) and SGD momentum buffers: a checkpoint holds 20 device tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8),
                                   nn.Linear(8, 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class SaveMidRun(Callback):
    """Saves a checkpoint after the last training step, while the weights and optimizer state are on the device, and
    counts the device->host transfers it took."""

    def __init__(self, path: Path) -> None:
        self.path, self.transfers = path, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import torch_xla.core.xla_model as xm

        if trainer.global_step == trainer.max_steps:
            xm.wait_device_ops()
            before = get_runtime().metrics()
            trainer.save_checkpoint(self.path)
            xm.wait_device_ops()
            self.transfers = (get_runtime().metrics() - before).device_to_host
            self.weights = {name: p.detach().cpu() for name, p in pl_module.named_parameters()}


def test_a_checkpoint_is_one_device_to_host_transfer(tmp_path: Path):
    saver = SaveMidRun(tmp_path / "last.ckpt")
    trainer = Trainer(accelerator="neuron", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[saver])
    trainer.fit(Deep(), regression_loader(n=64))
    assert saver.transfers == 1
    saved = torch.load(saver.path, weights_only=True)
    momentum = [state["momentum_buffer"] for state in saved["optimizer_states"][0]["state"].values()]
    assert len(saved["state_dict"]) == 10 and len(momentum) == 10
    assert all(t.device.type == "cpu" for t in [*saved["state_dict"].values(), *momentum])
    assert all(torch.equal(saved["state_dict"][name], weight) for name, weight in saver.weights.items())
