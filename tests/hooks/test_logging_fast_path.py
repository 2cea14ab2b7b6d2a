"""Repeated `self.log` calls in Neuron runs skip Lightning's per-call validation and log exactly what Lightning does."""

import csv

import pytest
import torch
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from models import regression_loader
from torch import nn
from torchmetrics import MeanMetric

from lightning_trn.hooks import logging as logging_hooks
from lightning_trn.hooks.contract import HookContract
from lightning_trn.pytorch.strategies import SingleDeviceNeuronStrategy

pytestmark = pytest.mark.xla_only


class LogsEverything(LightningModule):
    """Logs with every option that changes how Lightning stores or reduces a value."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.mean_abs_error = MeanMetric(nan_strategy="disable")

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.layer(x)
        loss = nn.functional.mse_loss(prediction, y)
        self.mean_abs_error.update((prediction - y).abs().mean())
        self.log("loss", loss, on_step=True, on_epoch=True, prog_bar=True)  # forked: loss_step / loss_epoch
        self.log("loss_sum", loss, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("loss_max", loss, on_epoch=True, reduce_fx="max", logger=True)
        self.log("prediction", prediction.mean(), on_epoch=True, batch_size=7)
        self.log("first_prediction", prediction[0], on_step=False, on_epoch=True)  # shape (1,): stored 0-dim
        self.log("mae", self.mean_abs_error, on_step=False, on_epoch=True, prog_bar=True)
        self.log_dict({"double": loss * 2, "triple": loss * 3}, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y), prog_bar=True)  # one key per dataloader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.fixture
def fast_path_calls(monkeypatch):
    """How often the fast path updated a stored result (True) or handed the call back to Lightning (False)."""
    calls = []
    real = logging_hooks._update_stored
    monkeypatch.setattr(logging_hooks, "_update_stored", lambda *args: calls.append(real(*args)) or calls[-1])
    return calls


def fit(
    tmp_path, fast_log: bool, model_class=LogsEverything, max_epochs: int = 2, epoch_values_on_host: bool = True
) -> Trainer:
    seed_everything(0)
    model = model_class()
    strategy = SingleDeviceNeuronStrategy()
    strategy.hook_contract = HookContract(fast_log=fast_log, epoch_values_on_host=epoch_values_on_host)
    trainer = Trainer(
        accelerator="neuron",
        strategy=strategy,
        max_epochs=max_epochs,
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    val_loaders = [regression_loader(n=64, shuffle=False, seed=1), regression_loader(n=48, shuffle=False, seed=2)]
    trainer.fit(model, train_dataloaders=regression_loader(n=150), val_dataloaders=val_loaders)
    return trainer


def logged(trainer: Trainer) -> dict:
    csv_path = f"{trainer.logger.log_dir}/metrics.csv"
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    return {
        "logged": convert_tensors_to_scalars(dict(trainer.logged_metrics)),
        "callback": convert_tensors_to_scalars(dict(trainer.callback_metrics)),
        "progress_bar": convert_tensors_to_scalars(dict(trainer.progress_bar_metrics)),
        "shapes": {key: tuple(value.shape) for key, value in trainer.callback_metrics.items()},
        "csv": rows,
    }


def test_fast_path_logs_exactly_what_lightning_logs(tmp_path, fast_path_calls):
    lightning = logged(fit(tmp_path / "lightning", fast_log=False))
    assert fast_path_calls == []  # switched off: every call went through Lightning

    fast = logged(fit(tmp_path / "fast", fast_log=True))
    # 10 train steps (the last one of 6 rows) x 8 calls x 2 epochs: all but each key's first call per epoch are fast
    assert fast_path_calls.count(True) >= 8 * 9 * 2
    assert set(fast["logged"]) >= {
        "loss_step",
        "loss_epoch",
        "loss_sum",
        "loss_max_epoch",
        "prediction_step",
        "mae",
        "first_prediction",
        "double",
        "triple",
        "val_loss/dataloader_idx_0",
        "val_loss/dataloader_idx_1",
    }
    assert fast == lightning


def test_lightning_errors_still_raise_after_the_fast_path_warmed_up(tmp_path, fast_path_calls):
    class LogsAVectorLater(LogsEverything):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("late", loss if batch_idx < 3 else torch.stack([loss, loss]))
            return loss

    with pytest.raises(ValueError, match="must have a single element"):
        fit(tmp_path, fast_log=True, model_class=LogsAVectorLater, max_epochs=1)
    assert True in fast_path_calls

    class ChangesArguments(LogsEverything):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss, on_step=True, on_epoch=True, prog_bar=batch_idx < 3)
            return loss

    with pytest.raises(MisconfigurationException, match="twice in `training_step` with different arguments"):
        fit(tmp_path, fast_log=True, model_class=ChangesArguments, max_epochs=1)


def test_epoch_values_computed_on_the_host_are_lightnings(tmp_path, monkeypatch):
    """Hook 4: with the states copied to the host in one transfer, Lightning's own epoch-end computation logs exactly
    the values it computes on the device (means, sums, max, a torchmetrics metric, two dataloaders)."""
    from lightning_trn.hooks import metric_states

    on_host = []
    real = metric_states.epoch_values_on_host
    monkeypatch.setattr(
        logging_hooks,
        "epoch_values_on_host",
        lambda *args: on_host.append(len(metric_states._epoch_states(args[0]))) or real(*args),
    )
    device = logged(fit(tmp_path / "device", fast_log=True, epoch_values_on_host=False))
    assert on_host == []
    host = logged(fit(tmp_path / "host", fast_log=True))
    assert sum(on_host) >= 2 * 8  # both epochs' training values (loss_max, mae's states, ...) came from host copies
    assert host == device
    assert {type(value) for value in host["logged"].values()} == {float}
