"""Mid-epoch resumes on a Neuron run continue exactly at the first batch not trained on: after
an `OnExceptionCheckpoint` (the failed batch is trained on again, as its step never finished) and from a checkpoint
a CPU run wrote mid-epoch (it holds no state of the plugin's loader). Run by both suites."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_trn  # noqa: F401  registers accelerator="neuron"

pytestmark = pytest.mark.both

BATCHES = 8
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0}


class Failure(Exception):
    pass


class Recorder(LightningModule):
    """Records (epoch, sample) for every training batch; raises once at `fail_at` (epoch 0)."""

    def __init__(self, fail_at: int = -1) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.fail_at = fail_at
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        if self.current_epoch == 0 and batch_idx == self.fail_at:
            raise Failure(f"batch {batch_idx}")
        x, y = batch
        self.seen.append((self.current_epoch, int(x.cpu().item())))
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader() -> DataLoader:
    x = torch.arange(BATCHES, dtype=torch.float32).unsqueeze(1)
    return DataLoader(TensorDataset(x, 2 * x), batch_size=1)


def resumed_run(checkpoint: Path) -> list[tuple[int, int]]:
    """What a neuron run resumed from `checkpoint` trains on, to the end of epoch 1."""
    model = Recorder()
    Trainer(accelerator="neuron", max_epochs=2, enable_checkpointing=False, **QUIET).fit(
        model, loader(), ckpt_path=str(checkpoint)
    )
    return model.seen


EXACT = [(0, i) for i in range(3, BATCHES)] + [(1, i) for i in range(BATCHES)]


def test_resume_after_a_failed_batch_trains_on_it(tmp_path: Path):
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path, filename="failed")
    trainer = Trainer(accelerator="neuron", max_epochs=2, callbacks=[on_exception], **QUIET)
    with pytest.raises(Failure):
        trainer.fit(Recorder(fail_at=3), loader())
    assert resumed_run(tmp_path / "failed.ckpt") == EXACT


def test_resume_from_a_cpu_runs_mid_epoch_checkpoint(tmp_path: Path):
    # start the device first: a CPU backward before it would leave autograd without a worker for it
    Trainer(accelerator="neuron", max_steps=1, enable_checkpointing=False, **QUIET).fit(Recorder(), loader())
    every_3 = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=3)
    cpu = Trainer(accelerator="cpu", max_steps=3, callbacks=[every_3], **QUIET)
    cpu.fit(Recorder(), loader())
    assert resumed_run(tmp_path / "mid.ckpt") == EXACT


class Stream(torch.utils.data.IterableDataset):
    """The same samples as `loader()`'s, from an iterable-style dataset (no `len()`)."""

    def __iter__(self):
        for i in range(BATCHES):
            yield torch.tensor([float(i)]), torch.tensor([2.0 * i])


@pytest.mark.parametrize("limit", [None, 3])
@pytest.mark.parametrize("iterable", [False, True])
def test_resume_from_a_neuron_runs_mid_epoch_checkpoint(tmp_path: Path, iterable: bool, limit):
    """With `limit_train_batches=3` the checkpoint at step 3 ends the (shortened) epoch: the next one starts at 0."""
    data = (lambda: DataLoader(Stream(), batch_size=None)) if iterable else loader
    every_3 = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=3)
    Trainer(accelerator="neuron", max_steps=3, limit_train_batches=limit, callbacks=[every_3], **QUIET).fit(
        Recorder(), data()
    )
    model = Recorder()
    Trainer(accelerator="neuron", max_epochs=2, limit_train_batches=limit, enable_checkpointing=False, **QUIET).fit(
        model, data(), ckpt_path=str(tmp_path / "mid.ckpt")
    )
    assert model.seen == ([(1, i) for i in range(3)] if limit else EXACT)
