"""Throughput and MFU (docs/operations.md): Lightning's `ThroughputMonitor` on a Neuron run gets the NeuronCore's dense
peak for the precision's compute dtype, adds no device read, and CPU runs keep Lightning's own answers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities import throughput as fabric_throughput
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ThroughputMonitor, throughput_monitor
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.precision import MixedPrecision
from models import RegressionModel, regression_loader

import lightning_trn  # noqa: F401  registers accelerator="neuron" and the throughput hooks
from lightning_trn.hooks.throughput import CHIP_ENV, PEAK_FLOPS, peak_flops
from lightning_trn.runtime import discovery, get_runtime

pytestmark = pytest.mark.both

STEPS = 8
WINDOW = 3
#: FLOPs one step of the model below claims (any fixed figure: MFU is flops/s over the peak)
FLOPS_PER_BATCH = 10**9


def test_peaks_per_device_count_logical_cores(monkeypatch: pytest.MonkeyPatch):
    assert peak_flops("trn1", torch.bfloat16) == 95e12 and peak_flops("trn1", torch.float32) == 23.75e12
    assert peak_flops("trn2", torch.bfloat16, cores_per_device=2) == 158e12
    assert peak_flops("trn3", torch.float32) == 20e12
    assert peak_flops("trn2", torch.float64) is None
    with pytest.raises(ValueError, match="Unknown Neuron chip 'trn9'"):
        peak_flops("trn9", torch.bfloat16)


@pytest.mark.parametrize(
    ("name", "chip"), [("Trainium1", "trn1"), ("Trainium2", "trn2"), ("Trainium3", "trn3"), ("Inferentia2", None)]
)
def test_chip_is_read_from_the_driver_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name, chip):
    path = tmp_path / "device_name"
    path.write_text(f"{name}\n")
    monkeypatch.setattr(discovery, "CHIP_NAME_FILE", str(path))
    assert discovery.neuron_chip() == chip


def test_other_devices_and_plugins_get_lightnings_answers(monkeypatch: pytest.MonkeyPatch):
    """The wrappers hand other devices and plugins to the function they wrap, untouched, without choosing a backend."""
    from lightning_trn.hooks.throughput import _available_flops, _compute_dtype

    for module in (fabric_throughput, throughput_monitor):
        for name in ("get_available_flops", "_plugin_to_compute_dtype"):
            assert getattr(module, name).__wrapped__ is not getattr(module, name)
    asked = []
    available_flops = _available_flops(lambda device, dtype: asked.append((device, dtype)) or 123)
    compute_dtype = _compute_dtype(lambda plugin: asked.append(plugin) or torch.int8)
    get_runtime.cache_clear()
    for device in (torch.device("cpu"), torch.device("cuda", 1), torch.device("mps")):
        assert available_flops(device, torch.bfloat16) == 123
    plugin = MixedPrecision("bf16-mixed", "cpu")
    assert compute_dtype(plugin) is torch.int8
    assert asked == [
        (torch.device("cpu"), torch.bfloat16),
        (torch.device("cuda", 1), torch.bfloat16),
        (torch.device("mps"), torch.bfloat16),
        plugin,
    ]
    assert get_runtime.cache_info().currsize == 0  # no backend was chosen for them


class Flops(RegressionModel):
    flops_per_batch = FLOPS_PER_BATCH


class Recorder(Logger):
    """Keeps every logged row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []

    name = "recorder"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class Transfers(Callback):
    """Device reads from the end of the first step to the end of the last (the monitor reads the host clock only)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        reads = get_runtime().metrics()
        reads = reads.device_to_host + reads.scalar_reads
        if batch_idx == 0:
            self.start = reads
        self.total = reads - self.start


def _fit(tmp_path: Path, precision: str, monitor: bool) -> tuple[Recorder, Transfers]:
    logger, transfers = Recorder(), Transfers()
    callbacks = [transfers] + (
        [ThroughputMonitor(batch_size_fn=lambda b: len(b[0]), window_size=WINDOW)] if monitor else []
    )
    trainer = Trainer(
        accelerator="neuron",
        devices=1,
        precision=precision,
        max_steps=STEPS,
        log_every_n_steps=1,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Flops(), regression_loader(n=16 * STEPS))
    return logger, transfers


@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_mfu_against_the_chips_peak_without_device_reads(tmp_path, monkeypatch, precision, dtype):
    monkeypatch.setenv(CHIP_ENV, "trn1")
    logger, transfers = _fit(tmp_path, precision, monitor=True)
    rows = [row for row in logger.rows if "train/device/mfu" in row]
    assert len(rows) == STEPS - WINDOW + 1
    for row in rows:  # the same products and quotients in another order: float rounding, far under approx's 1e-6
        assert row["train/device/flops_per_sec"] == pytest.approx(FLOPS_PER_BATCH * row["train/device/batches_per_sec"])
        assert row["train/device/mfu"] == pytest.approx(row["train/device/flops_per_sec"] / PEAK_FLOPS["trn1"][dtype])
    _, unmonitored = _fit(tmp_path / "plain", precision, monitor=False)
    assert transfers.total == unmonitored.total


def test_no_peak_on_xla_cpu_or_the_standin_is_said_once(tmp_path, monkeypatch):
    monkeypatch.delenv(CHIP_ENV, raising=False)
    from lightning_trn.hooks import throughput

    throughput._say_no_peak.cache_clear()
    with pytest.warns(UserWarning, match=f"no peak FLOP/s for {get_runtime().cpu_platform}") as warned:
        logger, _ = _fit(tmp_path, "32-true", monitor=True)
    assert sum("no peak FLOP/s" in str(w.message) for w in warned) == 1
    assert not any("train/device/mfu" in row for row in logger.rows)
    assert any("train/device/samples_per_sec" in row for row in logger.rows)


def test_tensor_parallel_groups_count_once(monkeypatch):
    """8 processes as 4 data-parallel replicas x tensor parallel over 2 (a real `DeviceMesh` over PyTorch's fake
    process group): each group of 2 works on one batch, so totals count 4 replicas, not 8, and MFU is measured
    against the group's 2 devices. Without the `setup` wrapper every figure would be 2x. As a Trn2 run at LNC=2,
    tokens/s and FLOP/s are also given per physical core (a group's over its 2 x 2 cores) and per chip (8 cores), as
    TorchTitan gives them per device."""
    import torch.distributed as dist
    from lightning.pytorch.trainer.states import RunningStage
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_trn.hooks import throughput
    from lightning_trn.hooks.throughput import tensor_parallel_size

    peak, batch, seconds = 100e12, 4, 0.5
    monkeypatch.setattr(throughput_monitor, "get_available_flops", lambda device, dtype: peak)
    monkeypatch.setattr(throughput, "_is_neuron_device", lambda device: True)
    monkeypatch.setenv(CHIP_ENV, "trn2")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    seq_len = 16
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        module = Flops()
        module._device_mesh = mesh
        assert tensor_parallel_size(module) == 2 and tensor_parallel_size(Flops()) == 1
        # what `ThroughputMonitor.setup` reads of a Trainer
        trainer = SimpleNamespace(
            precision_plugin=MixedPrecision("bf16-mixed", "cpu"),
            enable_validation=True,
            strategy=SimpleNamespace(root_device=torch.device("cpu")),
            world_size=8,
            state=SimpleNamespace(stage=RunningStage.TRAINING),
        )
        monitor = ThroughputMonitor(batch_size_fn=len, window_size=2)
        monitor.setup(trainer, module, "fit")
        training = monitor._throughputs[RunningStage.TRAINING]
        for step in range(2):
            done = step + 1
            training.update(
                time=step * seconds,
                batches=done,
                samples=done * batch,
                lengths=done * batch * seq_len,
                flops=FLOPS_PER_BATCH,
            )
        metrics = training.compute()
        # a later setup (validate after fit) counts its own per group, and leaves fit's alone
        trainer.state.stage = RunningStage.VALIDATING
        monitor.setup(trainer, module, "validate")
    finally:
        dist.destroy_process_group()
    assert metrics["device/samples_per_sec"] == batch / seconds  # per tensor-parallel group
    assert metrics["samples_per_sec"] == 4 * batch / seconds
    assert metrics["flops_per_sec"] == 4 * FLOPS_PER_BATCH / seconds
    # below, approx's default rel 1e-6: the same quotients and products in another order, float64 rounding only
    assert metrics["device/mfu"] == pytest.approx(FLOPS_PER_BATCH / seconds / (2 * peak))
    tokens = batch * seq_len / seconds  # one group's
    assert metrics["core/items_per_sec"] == pytest.approx(tokens / 4)
    assert metrics["chip/items_per_sec"] == pytest.approx(tokens / 4 * 8)
    assert metrics["core/flops_per_sec"] == pytest.approx(FLOPS_PER_BATCH / seconds / 4)
    assert metrics["chip/flops_per_sec"] == pytest.approx(FLOPS_PER_BATCH / seconds / 4 * 8)
    assert monitor._throughputs[RunningStage.TRAINING] is training
    for counted in (training, monitor._throughputs[RunningStage.VALIDATING]):
        assert (counted.world_size, counted.available_flops) == (4, 2 * peak)
