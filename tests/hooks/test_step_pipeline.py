"""Where Neuron runs cut the graph: once per optimizer step and once per evaluation step, never in the data loader,
so the host traces the next step while the device runs the last one; and batches the prefetcher already placed on
the device skip Lightning's transfer walk."""

import sys

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from models import RegressionModel, regression_loader

from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.xla_only

STEPS_PER_EPOCH = 32  # regression_loader(): 512 samples / batch 16


@pytest.fixture
def sync_calls(monkeypatch):
    """Every `torch_xla.sync()` call, by the file that made it (the strategy's runtime, torch_xla's loader, ...)."""
    calls: list[str] = []
    real = torch_xla.sync

    def counted(*args, **kwargs):
        calls.append(sys._getframe(1).f_code.co_filename)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_xla, "sync", counted)
    return calls


class Snapshots(Callback):
    """Runtime counters and `torch_xla.sync()` call counts at the end of every training and validation batch, taken
    once the device is idle (executions are counted when they finish, and the last one may still be running)."""

    def __init__(self, sync_calls: list) -> None:
        self.sync_calls = sync_calls
        self.train: list[tuple] = []
        self.val: list[tuple] = []

    def snapshot(self) -> tuple:
        xm.wait_device_ops()  # waits without cutting a graph
        return get_runtime().metrics(), len(self.sync_calls)

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.train.append(self.snapshot())

    def on_validation_batch_end(self, trainer, pl_module, *args):
        self.val.append(self.snapshot())


def _fit(
    tmp_path, model: LightningModule, max_steps: int, callbacks: tuple = (), datamodule=None, **trainer_kwargs
) -> Trainer:
    """`Trainer(accelerator="neuron")` without logger, checkpoints or progress bar, fitted on `regression_loader()`
    (or on `datamodule`)."""
    trainer = Trainer(
        accelerator="neuron",
        max_steps=max_steps,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=list(callbacks),
        **trainer_kwargs,
    )
    if datamodule is None:
        trainer.fit(model, train_dataloaders=regression_loader())
    else:
        trainer.fit(model, datamodule=datamodule)
    return trainer


def _between(snapshots: list, start: int, end: int) -> tuple:
    (m0, s0), (m1, s1) = snapshots[start], snapshots[end]
    return m1 - m0, s1 - s0


def test_training_cuts_once_per_step_and_the_loader_never(tmp_path, sync_calls):
    snapshots = Snapshots(sync_calls)
    _fit(tmp_path, RegressionModel(), max_steps=2 * STEPS_PER_EPOCH, callbacks=(snapshots,))

    start, end = STEPS_PER_EPOCH + 2, 2 * STEPS_PER_EPOCH - 2
    metrics, syncs = _between(snapshots.train, start, end)
    assert syncs == end - start  # the optimizer step's cut only: torch_xla's loader adds none
    assert metrics.executions == end - start
    assert metrics.compiles == 0
    assert not any("parallel_loader" in caller for caller in sync_calls)


class AccumulatingModel(RegressionModel):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)


def test_batches_without_an_optimizer_step_are_cut_before_the_next_batch(tmp_path, sync_calls):
    """With gradient accumulation every other batch has no optimizer step: its forward/backward is cut at the next
    batch's start, so every batch is one graph of a fixed shape and nothing recompiles."""
    snapshots = Snapshots(sync_calls)
    _fit(tmp_path, AccumulatingModel(), max_steps=STEPS_PER_EPOCH, callbacks=(snapshots,), accumulate_grad_batches=2)

    start, end = STEPS_PER_EPOCH + 2, 2 * STEPS_PER_EPOCH - 2
    metrics, syncs = _between(snapshots.train, start, end)
    assert syncs == end - start
    assert metrics.executions == end - start
    assert metrics.compiles == 0


class EvaluatedModel(AccumulatingModel):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def val_dataloader(self):
        return regression_loader(shuffle=False)


def test_each_validation_step_is_its_own_graph(tmp_path, sync_calls):
    snapshots = Snapshots(sync_calls)
    trainer = _fit(
        tmp_path, EvaluatedModel(), max_steps=1, callbacks=(snapshots,), limit_train_batches=1, num_sanity_val_steps=0
    )

    assert len(snapshots.val) == STEPS_PER_EPOCH
    metrics, syncs = _between(snapshots.val, 2, STEPS_PER_EPOCH - 1)
    assert syncs == STEPS_PER_EPOCH - 3
    assert metrics.executions == STEPS_PER_EPOCH - 3  # one per batch: not one graph growing over the whole loop
    assert metrics.compiles == 0
    assert trainer.callback_metrics["val_loss"] > 0


def test_the_prefetcher_moves_batches_without_cutting_the_graph():
    device = get_runtime().device()
    pending = torch.zeros(1, device=device)
    before = get_runtime().metrics()
    for x, _ in get_runtime().prefetch(regression_loader(n=64), device):
        pending = pending + x.sum()  # traced, not run: only a cut would run it
    xm.wait_device_ops()
    during = get_runtime().metrics() - before
    expected = sum(x.sum() for x, _ in regression_loader(n=64))
    # torch_xla's loader cuts once when it is exhausted; a cut per batch would run 4 graphs
    assert during.executions <= 1
    # 512 standard normals (sum ~32) summed in other orders: rounding errors of random sign grow as sqrt(512), ~25 x
    # 6e-8 x partial sums (<= ~32) = 5e-5 each side, under 1e-5 x 32
    assert torch.allclose(pending.cpu(), expected.reshape(1), rtol=1e-5)


class TransferCounter:
    """Counts Lightning's batch-transfer walks (`LightningModule._apply_batch_transfer_handler`)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = LightningModule._apply_batch_transfer_handler

        def counted(module, *args, **kwargs):
            self.calls += 1
            return real(module, *args, **kwargs)

        monkeypatch.setattr(LightningModule, "_apply_batch_transfer_handler", counted)


def test_prefetched_batches_skip_lightnings_transfer_walk(tmp_path, monkeypatch):
    transfers = TransferCounter(monkeypatch)
    model = RegressionModel()
    _fit(tmp_path, model, max_steps=8)
    assert transfers.calls == 0
    assert model.batch_devices == {"xla"}


class ShiftsTargets(RegressionModel):
    """Overrides a batch-transfer hook: Lightning's transfer path must run, and its effect must show."""

    def __init__(self) -> None:
        super().__init__()
        self.targets_seen: list[float] = []

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x, y + 1000.0

    def training_step(self, batch, batch_idx):
        self.targets_seen.append(float(batch[1].min().cpu()))
        return super().training_step(batch, batch_idx)


class TransferringData(LightningDataModule):
    """Overrides `transfer_batch_to_device` on the datamodule, which Lightning also honours."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers = 0

    def train_dataloader(self):
        return regression_loader()

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.transfers += 1
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


def test_an_overridden_module_batch_transfer_hook_still_runs(tmp_path, monkeypatch):
    transfers = TransferCounter(monkeypatch)
    model = ShiftsTargets()
    _fit(tmp_path, model, max_steps=4)
    assert transfers.calls == 4
    assert min(model.targets_seen) > 900.0


def test_an_overridden_datamodule_batch_transfer_hook_still_runs(tmp_path, monkeypatch):
    transfers = TransferCounter(monkeypatch)
    datamodule = TransferringData()
    _fit(tmp_path, RegressionModel(), max_steps=4, datamodule=datamodule)
    assert transfers.calls == 4
    assert datamodule.transfers == 4
