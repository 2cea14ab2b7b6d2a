"""No device-to-host transfer between logging intervals, with a logger and the progress bar on."""

import csv
import json

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from models import RegressionModel
from torch import nn

from lightning_trn.pytorch.callbacks.progress_bar import HostSyncFreeMetricsMixin
from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.both

LOG_EVERY = 10


class CountersAtStep(Callback):
    def __init__(self) -> None:
        self.metrics = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics[trainer.global_step] = get_runtime().metrics()


@pytest.mark.parametrize("bar", [None, TQDMProgressBar(), RichProgressBar()], ids=["default", "tqdm", "rich"])
def test_no_transfers_between_logging_steps(tmp_path, bar, redraw_clock):
    counters = CountersAtStep()
    # the bars redraw on a clock: every 2nd batch here (0.12 s >= 1/10 s), at steps 1, 3, ..., 9, 11, so the first
    # redraw after logging step 10 falls inside the measured interval; the device must still be read only at step 10
    callbacks = [counters, redraw_clock.advance_per_batch(0.06)] + ([bar] if bar is not None else [])
    trainer = Trainer(
        accelerator="neuron",
        max_steps=3 * LOG_EVERY,
        log_every_n_steps=LOG_EVERY,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        enable_checkpointing=False,
    )
    trainer.fit(RegressionModel())

    assert isinstance(trainer.progress_bar_callback, HostSyncFreeMetricsMixin)
    between = counters.metrics[2 * LOG_EVERY - 1] - counters.metrics[LOG_EVERY + 1]
    assert between.device_to_host == 0 and between.scalar_reads == 0
    # the bar still shows the logged loss, refreshed at the logging interval
    shown = trainer.progress_bar_callback.get_metrics(trainer, trainer.lightning_module)
    assert isinstance(shown["train_loss"], float)
    assert trainer.logged_metrics["train_loss"] is not None


class LogsThreeValues(RegressionModel):
    """Three values per step: two on the progress bar and in the logger, one in the logger only."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.layer(x)
        loss = nn.functional.mse_loss(out, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_mae", (out - y).abs().mean(), prog_bar=True)
        self.log("out_mean", out.mean())
        return loss


class LoggingStepReads(Callback):
    """Counters from the start of the first logging step's batch to the start of the next batch (the bar's read at
    the batch's end and the logger's after it), that step's loss (a device tensor, read after `fit`) and what the
    bar shows then (its cached values: no read)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == LOG_EVERY - 1:
            self.before = get_runtime().metrics()
        elif batch_idx == LOG_EVERY:
            self.during = get_runtime().metrics() - self.before
            self.shown = trainer.progress_bar_callback.get_metrics(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == LOG_EVERY - 1:
            self.loss = outputs["loss"].detach()


def test_a_logging_step_reads_all_its_values_in_one_transfer(tmp_path, redraw_clock):
    """The bar shows two step values and the CSV logger writes three at the same logging step: one device->host
    transfer for all of them (on the native backend one host sync), no `.item()` read; what both show is the step's
    loss."""
    reads = LoggingStepReads()
    trainer = Trainer(
        accelerator="neuron",
        max_steps=LOG_EVERY + 1,
        log_every_n_steps=LOG_EVERY,
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path, name="csv"),
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[reads, redraw_clock.advance_per_batch(0.06)],
    )
    trainer.fit(LogsThreeValues())

    # XLA: every transfer is a host sync; native: the copies are queued and waited for once
    assert reads.during.host_syncs == 1 and reads.during.scalar_reads == 0
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        (row,) = [row for row in csv.DictReader(f) if row["step"] == str(LOG_EVERY - 1)]
    assert {name for name, value in row.items() if value} == {"epoch", "step", "train_loss", "train_mae", "out_mean"}
    loss = reads.loss.item()
    # the same float32 values, read once, written as floats: rel 1e-6 only absorbs float32/float64 conversions (6e-8)
    assert float(row["train_loss"]) == pytest.approx(loss, rel=1e-6)
    assert reads.shown["train_loss"] == pytest.approx(loss, rel=1e-6)
    assert reads.shown["train_mae"] == pytest.approx(float(row["train_mae"]), rel=1e-6)


def test_progress_bar_metrics_are_numbers_after_fit(tmp_path):
    """Kept as device tensors during the run, they are plain numbers afterwards, as in Lightning (JSON-ready)."""
    trainer = Trainer(
        accelerator="neuron", max_steps=3, default_root_dir=tmp_path, logger=False, enable_checkpointing=False
    )
    trainer.fit(RegressionModel())
    assert trainer.strategy.hook_contract.defer_progress_bar_metrics
    metrics = trainer.progress_bar_metrics
    assert isinstance(metrics["train_loss"], float)
    assert json.loads(json.dumps(metrics)) == metrics


def test_custom_progress_bar_keeps_lightning_behaviour(tmp_path):
    class MyBar(TQDMProgressBar):
        pass

    trainer = Trainer(accelerator="neuron", max_steps=3, default_root_dir=tmp_path, callbacks=[MyBar()], logger=False)
    trainer.fit(RegressionModel())
    assert type(trainer.progress_bar_callback) is MyBar
    assert not trainer.strategy.hook_contract.defer_progress_bar_metrics
    assert isinstance(trainer.progress_bar_metrics["train_loss"], float)


def test_result_metric_move_is_skipped_only_when_already_on_that_device(monkeypatch, neuron_run_hooks):
    from lightning.pytorch.trainer.connectors.logger_connector import result

    walks = []
    real_apply = result.apply_to_collection
    monkeypatch.setattr(result, "apply_to_collection", lambda *a, **k: walks.append(1) or real_apply(*a, **k))
    metadata = result._Metadata(fx="training_step", name="loss", on_step=True, on_epoch=True)
    metadata.sync = result._Sync()
    logged = result._ResultMetric(metadata, is_tensor=True)
    device = get_runtime().device()

    logged.to(device)
    logged.to(device)  # already there: no walk
    assert len(walks) == 1 and logged.value.device.type == device.type
    logged.to(torch.device("cpu"))  # elsewhere: moved in full (Lightning does this at every epoch end)
    assert len(walks) == 2 and logged.value.device.type == "cpu"
    logged.to(device)  # back: moved again, not skipped
    assert len(walks) == 3 and logged.value.device.type == device.type
