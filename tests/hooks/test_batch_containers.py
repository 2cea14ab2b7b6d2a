"""Batches reach the steps with the containers the DataLoader produced (tuple, namedtuple, dict subclass,
dataclass), on the device, in training, validation and prediction, as with Lightning's own transfer. Run by both
suites (XLA's prefetcher rebuilds containers; the native one moves batches with Lightning's function)."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.both

Sample = namedtuple("Sample", ["x", "y"])


class Features(dict):
    """A dict subclass, as tokenizers return (`BatchEncoding`)."""


@dataclass
class Extra:
    weight: torch.Tensor
    note: str


def collate(rows: list[int]) -> tuple:
    n = len(rows)
    x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)
    extra = Extra(torch.full((n, 1), 0.5), "kept")
    return Sample(x, x.sum(dim=1, keepdim=True)), Features(mask=torch.ones(n, 1)), extra


def structure(batch: tuple) -> tuple:
    """The container types, non-tensor values and tensor devices of a batch."""
    sample, features, extra = batch
    return (
        type(batch),
        type(sample),
        type(features),
        type(extra),
        extra.note,
        frozenset(t.device.type for t in (sample.x, sample.y, features["mask"], extra.weight)),
    )


class Recorder(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.seen: dict[str, set] = {"train": set(), "val": set(), "predict": set()}

    def _loss(self, batch: tuple, stage: str) -> torch.Tensor:
        self.seen[stage].add(structure(batch))
        sample, features, extra = batch
        return ((self.layer(sample.x) - sample.y) ** 2 * features["mask"] * extra.weight).mean()

    def training_step(self, batch, batch_idx):
        return self._loss(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._loss(batch, "val")

    def predict_step(self, batch, batch_idx):
        return self._loss(batch, "predict")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_batch_containers_survive_the_move_to_the_device(tmp_path) -> None:
    model = Recorder()
    loader = DataLoader(range(12), batch_size=4, collate_fn=collate)
    trainer = Trainer(
        accelerator="neuron",
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, loader)
    trainer.predict(model, loader)
    expected = {(tuple, Sample, Features, Extra, "kept", frozenset({get_runtime().device_type}))}
    assert model.seen == {"train": expected, "val": expected, "predict": expected}
