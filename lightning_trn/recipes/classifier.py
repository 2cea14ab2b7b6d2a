"""`ClassifierModule`: the training/validation/test steps the three recipes share."""

from __future__ import annotations

import copy
from abc import abstractmethod

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import ThroughputMonitor
from typing_extensions import override

from lightning_trn.recipes.metrics import MaskedAccuracy

Batch = dict[str, torch.Tensor]


class ClassifierModule(pl.LightningModule):
    """Cross-entropy on `batch["y"]` weighted by `batch["weight"]` (0 for padding rows), plus masked accuracy.

    Nothing here reads a value back to the host: the loss and the accuracy states stay on the device and Lightning
    reduces them at the end of the epoch (`on_step=False`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = MaskedAccuracy()
        self.val_acc = MaskedAccuracy()
        self.test_acc = MaskedAccuracy()

    @abstractmethod
    def logits(self, batch: Batch) -> torch.Tensor:
        """Class logits (batch, classes) for a batch."""

    def _step(self, batch: Batch, stage: str) -> torch.Tensor:
        logits = self.logits(batch)
        weight = batch["weight"].to(torch.float32)
        losses = F.cross_entropy(logits.float(), batch["y"], reduction="none")
        loss = (losses * weight).sum() / weight.sum().clamp_min(1.0)
        metric: MaskedAccuracy = getattr(self, f"{stage}_acc")
        metric.update(logits.argmax(dim=-1), batch["y"], weight)
        batch_size = len(weight)
        # on_epoch only: `sync_dist` averages over the ranks once, at the end of the epoch, not per step
        self.log(
            f"{stage}_loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch_size, sync_dist=True
        )
        self.log(f"{stage}_acc", metric, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch_size)
        return loss

    @override
    def setup(self, stage: str) -> None:
        """With a `ThroughputMonitor`, count the FLOPs of one training batch (forward and backward of the logits) on
        a meta-device copy, without running the model: the monitor turns them into TFLOPS and MFU. Here, not before
        `fit`: a backward pass (even on the meta device) before the Neuron device starts leaves autograd without a
        worker for it."""
        if stage != "fit":
            return
        # Lightning's connectors set `callbacks` and `datamodule` on the Trainer; its class does not declare them
        callbacks = self.trainer.callbacks  # type: ignore[attr-defined]  # see above
        if not any(isinstance(c, ThroughputMonitor) for c in callbacks):
            return
        batch = next(iter(self.trainer.datamodule.train_dataloader()))  # type: ignore[attr-defined]  # see above
        trainer, self._trainer = self._trainer, None  # not deep-copied with the module
        try:
            meta = copy.deepcopy(self).to("meta")
        finally:
            self._trainer = trainer
        meta_batch = {key: torch.empty_like(value, device="meta") for key, value in batch.items()}
        self.flops_per_batch = measure_flops(meta, lambda: meta.logits(meta_batch), lambda logits: logits.sum())

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "val")

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._step(batch, "test")
