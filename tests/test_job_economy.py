"""Compile and transfer economy of a whole job (docs/job-economy.md): counts per phase that
`benchmarks/job_economy.py` measures for the recipes, asserted here for a small model so a regression fails CI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from models import RegressionModel, regression_loader
from torch import nn

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.xla_only  # the counts are torch_xla's


class Deep(RegressionModel):
    """Several layers (10 parameter tensors) and SGD momentum buffers: a checkpoint holds 20 device tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(
            nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(8, 1)
        )

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
    trainer = Trainer(
        accelerator="neuron",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[saver],
    )
    trainer.fit(Deep(), regression_loader(n=64))
    assert saver.transfers == 1
    saved = torch.load(saver.path, weights_only=True)
    momentum = [state["momentum_buffer"] for state in saved["optimizer_states"][0]["state"].values()]
    assert len(saved["state_dict"]) == 10 and len(momentum) == 10
    assert all(t.device.type == "cpu" for t in [*saved["state_dict"].values(), *momentum])
    assert all(torch.equal(saved["state_dict"][name], weight) for name, weight in saver.weights.items())


SHORT_JOB = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=5",
    "trainer.limit_val_batches=3",
    "trainer.limit_test_batches=3",
]


def test_a_recipe_job_compiles_and_moves_what_it_must_per_phase():
    """The MLP recipe's job as users run it (progress bar, CSV logger, checkpoints, validation, test), shortened to
    2 epochs, each side in a fresh process: the plugin compiles one evaluation graph (shared by validation and test)
    and two training graphs (first step, steady step), reads nothing with `.item()`, and moves to the host once per
    epoch-end value set, per checkpoint file and per teardown."""
    from benchmarks.job_economy import main

    ((plugin, expert),) = main(["--workloads", "mlp", "--set", *SHORT_JOB]).values()
    compiles = plugin.per_phase("compiles")
    assert compiles == {
        "setup": 1,
        "train": 2,
        "validation": 0,
        "epoch end": 0,
        "checkpoint": 0,
        "test": 0,
        "teardown": 0,
    }
    transfers = plugin.per_phase("device_to_host")
    # setup: the sanity check's values; per epoch: the validation values, the training values, last.ckpt and the
    # epoch's checkpoint file; test: its values; teardown: fit's and test's moves to the host
    assert transfers == {
        "setup": 1,
        "train": 0,
        "validation": 2,
        "epoch end": 2,
        "checkpoint": 4,
        "test": 1,
        "teardown": 2,
    }
    assert sum(p.metrics.scalar_reads for p in plugin.phases.values()) == 0
    assert sum(p.metrics.compiles for p in plugin.phases.values()) <= sum(
        p.metrics.compiles for p in expert.phases.values()
    )
    # a ratio of counts: one other prediction moves it by 1/96 (3 test batches of 32); 1e-6 only absorbs the float32
    # rounding of the ratio (<= 6e-8)
    assert plugin.test["test_acc"] == pytest.approx(expert.test["test_acc"], abs=1e-6)


def _compiles_since(before) -> int:
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()
    return (get_runtime().metrics() - before).compiles


def test_metric_states_enter_every_step_graph_as_inputs():
    """A metric whose 0-dim states start at 0 (and are reset to 0) compiles its update graph once, not once with the
    zeros baked in as constants and again with the previous step's results as inputs; a reset gives torchmetrics'
    values, dtypes and device."""
    import torch_xla

    from lightning_trn.core.scalars import place_scalars
    from lightning_trn.hooks import registry as lightning_hooks
    from lightning_trn.recipes.metrics import MaskedAccuracy

    runtime = get_runtime()
    device = runtime.device()
    metric = MaskedAccuracy()
    metric.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
    place_scalars(metric, device)
    metric.to(device)
    preds, target, weight = (torch.tensor(v).to(device) for v in ([1, 2, 3, 3], [1, 2, 0, 3], [1.0, 1.0, 1.0, 0.0]))
    lightning_hooks.acquire()
    try:
        before = get_runtime().metrics()
        for _ in range(2):
            for _ in range(3):
                metric.update(preds, target, weight)
                metric.count += 1
                torch_xla.sync()
            assert metric.correct.item() == 6.0 and metric.total.item() == 9.0 and metric.count.item() == 3
            metric.reset()
            assert [(t.item(), t.dtype, t.device) for t in (metric.correct, metric.total, metric.count)] == [
                (0.0, torch.float32, device),
                (0.0, torch.float32, device),
                (0, torch.long, device),
            ]
        assert _compiles_since(before) == 1  # the update step, once: reads and resets compile nothing
    finally:
        lightning_hooks.release()


class WithMetric(Deep):
    """`Deep` logging a torchmetrics metric and an epoch mean: the teardown moves metric states and results too."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics import MeanMetric

        self.error = MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.error.update(loss.detach())
        self.log("error", self.error, on_step=False, on_epoch=True)
        self.log("loss_mean", loss, on_step=False, on_epoch=True)
        return loss


class Snapshot(Callback):
    """At the end of training: each device tensor the teardown will move, read one by one (Lightning's way), and the
    runtime counters."""

    def on_train_end(self, trainer, pl_module):
        import torch_xla.core.xla_model as xm

        self.params = {name: p.detach().cpu() for name, p in pl_module.named_parameters()}
        self.optimizer = [{k: v.cpu() for k, v in s.items()} for s in trainer.optimizers[0].state.values()]
        self.states = {name: getattr(pl_module.error, name).cpu() for name in pl_module.error._defaults}
        xm.wait_device_ops()
        self.before = get_runtime().metrics()


def test_the_teardown_moves_everything_to_the_host_in_one_transfer(tmp_path: Path):
    snapshot = Snapshot()
    trainer = Trainer(
        accelerator="neuron",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[snapshot],
    )
    model = WithMetric()
    trainer.fit(model, regression_loader(n=64))
    teardown = get_runtime().metrics() - snapshot.before
    assert (teardown.device_to_host, teardown.compiles) == (1, 0)
    # Lightning's result: everything on the host, with the values it had on the device
    params = dict(model.named_parameters())
    assert all(isinstance(p, nn.Parameter) and p.device.type == "cpu" and p.requires_grad for p in params.values())
    assert all(torch.equal(params[name], value) for name, value in snapshot.params.items())
    states = list(trainer.optimizers[0].state.values())
    assert all(
        torch.equal(state[k], v) and state[k].device.type == "cpu"
        for state, saved in zip(states, snapshot.optimizer, strict=True)
        for k, v in saved.items()
    )
    assert all(torch.equal(getattr(model.error, name), value) for name, value in snapshot.states.items())
    assert model.error.device.type == "cpu"
    assert {value.device.type for value in trainer.callback_metrics.values()} == {"cpu"}


def test_host_copies_hand_out_distinct_tensors():
    """Two `.cpu()` calls of one device tensor give two tensors, as without `HostCopies`; other moves are real."""
    from lightning_trn.hooks.host_copies import HostCopies

    runtime = get_runtime()
    device = runtime.device()
    tensor, other = torch.arange(4.0).to(device), torch.ones(2).to(device)
    with HostCopies(runtime, [tensor]):
        first, second, to_cpu = tensor.cpu(), tensor.cpu(), tensor.to("cpu")
        as_double, elsewhere = tensor.to(torch.float64), other.cpu()
        probe = torch.zeros(1, device=device)
        probe_host = probe.cpu()
    assert len({id(first), id(second), id(to_cpu)}) == 3
    assert all(torch.equal(t, torch.arange(4.0)) for t in (first, second, to_cpu))
    first.add_(1)
    assert torch.equal(second, torch.arange(4.0))
    assert as_double.device == device and as_double.dtype == torch.float64
    assert torch.equal(elsewhere, torch.ones(2)) and torch.equal(probe_host, torch.zeros(1))
