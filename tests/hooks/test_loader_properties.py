"""`trainer.train_dataloader`, `val_dataloaders`, `test_dataloaders` and `predict_dataloaders` return the user's
DataLoaders on a Neuron run, during and after it, as on a CPU run, while the batches still come through the device
prefetcher. Run by both suites."""

from __future__ import annotations

import gc
import threading

import pytest
from lightning.pytorch import Callback, Trainer
from models import RegressionModel, regression_loader
from torch import nn

from lightning_trn.core.device_loader import DevicePrefetchLoader

pytestmark = pytest.mark.both

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


class Evaluated(RegressionModel):
    """Validation, test and predict steps, and a training step that takes a dict of two loaders' batches."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch["a"], batch_idx) + super().training_step(batch["b"], batch_idx)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])


class Seen(Callback):
    """What the trainer's loader properties return while each stage runs, and what the loops iterate."""

    def __init__(self) -> None:
        self.during: dict[str, object] = {}
        self.iterated: dict[str, list[type]] = {}

    def _record(self, trainer: Trainer, stage: str, loader: object, loop: object) -> None:
        self.during[stage] = loader
        self.iterated[stage] = [type(dl) for dl in loop._combined_loader.flattened]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._record(trainer, "train", trainer.train_dataloader, trainer.fit_loop)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self._record(trainer, "val", trainer.val_dataloaders, trainer.fit_loop.epoch_loop.val_loop)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._record(trainer, "test", trainer.test_dataloaders, trainer.test_loop)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._record(trainer, "predict", trainer.predict_dataloaders, trainer.predict_loop)


def run(accelerator: str) -> tuple[dict[str, object], dict[str, object], Seen]:
    """Fit (two train loaders, two val loaders), test and predict; the loaders given, and what the trainer showed."""
    loaders = {
        "train": {"a": regression_loader(n=32, seed=1), "b": regression_loader(n=32, seed=2)},
        "val": [regression_loader(n=16, seed=3, shuffle=False), regression_loader(n=16, seed=4, shuffle=False)],
        "test": regression_loader(n=16, seed=5, shuffle=False),
        "predict": regression_loader(n=16, seed=6, shuffle=False),
    }
    seen = Seen()
    trainer = Trainer(accelerator=accelerator, max_epochs=1, callbacks=[seen], **QUIET)
    model = Evaluated()
    trainer.fit(model, loaders["train"], loaders["val"])
    after = {"train": trainer.train_dataloader, "val": trainer.val_dataloaders}
    trainer.test(model, loaders["test"])
    after["test"] = trainer.test_dataloaders
    trainer.predict(model, loaders["predict"])
    after["predict"] = trainer.predict_dataloaders
    return loaders, after, seen


def described(shown: object, given: object) -> object:
    """`shown` with each loader that is the given object replaced by "given", others by their type and sampler's."""
    if isinstance(given, dict):
        return {key: described(shown[key], given[key]) for key in given} if isinstance(shown, dict) else shown
    if isinstance(given, list):
        return [described(s, g) for s, g in zip(shown, given, strict=True)] if isinstance(shown, list) else shown
    if shown is given:
        return "given"
    return type(shown).__name__, type(getattr(shown, "batch_sampler", None)).__name__


def test_trainer_shows_the_loaders_a_cpu_run_shows_during_and_after_each_stage():
    shown = {}
    for accelerator in ("neuron", "cpu"):
        loaders, after, seen = run(accelerator)
        shown[accelerator] = {
            stage: (described(seen.during[stage], given), described(after[stage], given))
            for stage, given in loaders.items()
        }
        if accelerator == "neuron":
            neuron_iterated = seen.iterated
    assert shown["neuron"] == shown["cpu"]
    # the user's own objects for fit and test; predict's is Lightning's copy indexing its batches, on both
    assert shown["cpu"]["train"] == ({"a": "given", "b": "given"},) * 2
    assert shown["cpu"]["val"] == (["given", "given"],) * 2
    assert shown["cpu"]["test"] == ("given", "given")
    assert shown["cpu"]["predict"] == (("DataLoader", "_IndexBatchSamplerWrapper"),) * 2
    # the Neuron run still iterated every loader through the device prefetcher
    assert all(types == [DevicePrefetchLoader] * len(types) for types in neuron_iterated.values()), neuron_iterated


@pytest.mark.xla_only
def test_a_loop_that_stops_early_leaves_no_loader_threads_running():
    """`limit_*_batches` leaves the prefetcher's iterator unfinished: its background threads (torch_xla's
    `ParallelLoader`, blocked on a full queue) must be stopped and joined, or they wake during interpreter shutdown
    and abort the finished job ("terminate called without an active exception", exit code 134)."""

    def loader_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.endswith(("(_loader_worker)", "(_worker)"))]

    assert not loader_threads()
    trainer = Trainer(
        accelerator="neuron", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=1, **QUIET
    )
    trainer.fit(RegressionModel(), regression_loader(n=640, batch_size=4), regression_loader(n=640, batch_size=4))
    gc.collect()
    assert not loader_threads()
