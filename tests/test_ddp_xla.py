"""NeuronDDPStrategy on the XLA backend: Neuron env mapping, collectives, world-size checks (2-process training,
shared with the native backend, is in test_ddp_training.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
import pytest
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed import ReduceOp

import lightning_trn
from lightning_trn import NeuronDDPStrategy
from lightning_trn.pytorch.strategies.host_signals import install_host_sigterm_sync
from lightning_trn.runtime import XlaRuntime
from lightning_trn.runtime.collectives import check_world_size, reduce_op_name
from lightning_trn.runtime.discovery import NEURON, Platform
from lightning_trn.runtime.environment import EnvironmentPatch
from lightning_trn.runtime.neuron_env import neuron_process_env

pytestmark = pytest.mark.xla_only


# ---------------------------------------------------------------- Neuron environment mapping (faked environment)

RANKS = dict(global_rank=3, local_rank=1, world_size=4, local_world_size=2, main_address="10.0.0.7")


def test_neuron_env_for_self_launched_worker() -> None:
    assert neuron_process_env({}, **RANKS) == {
        "NEURON_RT_ROOT_COMM_ID": "10.0.0.7:62182",
        "NEURON_PJRT_PROCESS_INDEX": "3",
        "PJRT_LOCAL_PROCESS_RANK": "1",
        "NEURON_RT_VISIBLE_CORES": "1",
        "NEURON_PJRT_WORLD_SIZE": "4",
        "PJRT_LOCAL_PROCESS_COUNT": "2",
    }


def test_neuron_env_matches_torch_xla_torchrun_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun torch_xla maps the ranks itself; ours must agree, and applying ours afterwards changes nothing."""
    neuron = pytest.importorskip("torch_xla._internal.neuron")
    for name in list(os.environ):
        if name.startswith(("NEURON_", "PJRT_LOCAL", "TORCHELASTIC")) or name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    torchrun = {"TORCHELASTIC_RUN_ID": "job", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7", "NEURON_RT_VISIBLE_CORES": "4-5"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    ours = neuron_process_env(before, **RANKS)
    neuron.configure_pjrt_environment()
    torch_xla_set = {k: v for k, v in os.environ.items() if before.get(k) != v}
    assert ours == {**torch_xla_set, "NEURON_RT_VISIBLE_CORES": "5"}
    again = neuron_process_env(dict(os.environ), **RANKS)
    assert {name: os.environ[name] for name in again} == again


def test_neuron_env_picks_local_core_from_visible_range() -> None:
    env = neuron_process_env({"NEURON_RT_VISIBLE_CORES": "8-11"}, **{**RANKS, "local_world_size": 4, "local_rank": 2})
    assert env["NEURON_RT_VISIBLE_CORES"] == "10"


def test_neuron_env_keeps_user_values() -> None:
    env = neuron_process_env(
        {"NEURON_PJRT_WORLD_SIZE": "4", "NEURON_RT_ROOT_COMM_ID": "head:1234", "NEURON_RT_VISIBLE_CORES": "7"},
        **RANKS,
    )
    assert env["NEURON_RT_ROOT_COMM_ID"] == "head:1234"
    assert env["NEURON_RT_VISIBLE_CORES"] == "7"  # already narrowed to one core for this process
    assert "NEURON_PJRT_WORLD_SIZE" not in env and "PJRT_LOCAL_PROCESS_COUNT" not in env


def test_neuron_env_ipv6_root_address() -> None:
    assert neuron_process_env({}, **{**RANKS, "main_address": "fd00::1"})["NEURON_RT_ROOT_COMM_ID"] == "[fd00::1]:62182"


def test_neuron_env_rejects_visible_cores_that_do_not_match_processes() -> None:
    with pytest.raises(ValueError, match="lists 4 NeuronCores but this node runs 2 processes"):
        neuron_process_env({"NEURON_RT_VISIBLE_CORES": "0-3"}, **RANKS)


@pytest.fixture
def neuron_runtime(monkeypatch: pytest.MonkeyPatch) -> XlaRuntime:
    """An XlaRuntime that believes it is on a 2-core Neuron host whose XLA runtime has not started yet."""
    torch_xla = pytest.importorskip("torch_xla")
    for name in ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_ROOT_COMM_ID", "NEURON_PJRT_PROCESS_INDEX",
                 "NEURON_PJRT_WORLD_SIZE", "NEURON_PJRT_PROCESSES_NUM_DEVICES", "PJRT_LOCAL_PROCESS_RANK",
                 "PJRT_LOCAL_PROCESS_COUNT"):
        monkeypatch.delenv(name, raising=False)
    runtime = XlaRuntime()
    monkeypatch.setattr(runtime, "detect_platform", lambda: Platform(NEURON, 2, "faked"))
    monkeypatch.setattr(torch_xla._XLAC, "_xla_runtime_is_initialized", lambda: False)
    return runtime


def test_runtime_configures_neuron_worker_and_restores(neuron_runtime: XlaRuntime) -> None:
    patch = EnvironmentPatch()
    neuron_runtime.configure_process(env=patch, **{**RANKS, "global_rank": 1, "world_size": 2})
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "1"
    assert os.environ["NEURON_PJRT_PROCESS_INDEX"] == "1" and os.environ["NEURON_PJRT_WORLD_SIZE"] == "2"
    patch.restore()
    assert "NEURON_RT_VISIBLE_CORES" not in os.environ and "NEURON_PJRT_WORLD_SIZE" not in os.environ


def test_runtime_refuses_to_remap_a_started_neuron_runtime(
    neuron_runtime: XlaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch_xla

    monkeypatch.setattr(torch_xla._XLAC, "_xla_runtime_is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="XLA runtime started before this data-parallel worker"):
        neuron_runtime.configure_process(env=EnvironmentPatch(), **RANKS)


# ---------------------------------------------------------------- collectives and checks


@pytest.mark.parametrize(
    ("op", "name"),
    [("sum", "sum"), ("mean", "mean"), ("avg", "mean"), ("MAX", "max"), ("min", "min"), (None, "mean"),
     (ReduceOp.SUM, "sum"), (ReduceOp.AVG, "mean"), (ReduceOp.MAX, "max"), (ReduceOp.MIN, "min")],
)
def test_reduce_op_names(op: object, name: str) -> None:
    assert reduce_op_name(op) == name


def test_reduce_op_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="Unsupported reduce op"):
        reduce_op_name("product")


def test_world_size_mismatch_fails_instead_of_reducing_over_fewer_processes() -> None:
    with pytest.raises(RuntimeError, match="process group has 2 processes but the XLA runtime's collectives span 1"):
        check_world_size(2, 1, cross_process=True)
    check_world_size(2, 2, cross_process=True)
    check_world_size(2, 1, cross_process=False)  # XLA:CPU: gloo carries the collectives, the runtime's size is moot


def test_xla_backend_refused_on_xla_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forcing the `xla` process group on XLA:CPU would make every process reduce only with itself."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # the launcher sets them in this process; restore them afterwards
    trainer = pl.Trainer(
        accelerator="neuron", devices=1, strategy=NeuronDDPStrategy(process_group_backend="xla"),
        default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False,
    )
    with pytest.raises(RuntimeError, match="process_group_backend='xla' on XLA:CPU"):
        trainer.fit(BoringModel())
    assert not dist.is_initialized()


def test_several_devices_or_nodes_pick_neuron_ddp() -> None:
    trainer = pl.Trainer(accelerator="neuron", devices=1, num_nodes=2, logger=False)
    assert isinstance(trainer.strategy, lightning_trn.NeuronDDPStrategy)
    assert trainer.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert trainer._accelerator_connector.is_distributed  # enables the sampler injection and sync_dist


@pytest.fixture
def single_process_gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sigterm_flag_is_shared_on_the_host_without_device_tensors(single_process_gloo: None) -> None:
    killed = []
    connector = SimpleNamespace(received_sigterm=False, _sigterm_notifier_fn=None)
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_broadcast_sigterm_tensor=None)),
        _signal_connector=connector,
        global_rank=0,
        strategy=SimpleNamespace(launcher=SimpleNamespace(kill=killed.append)),
    )
    assert install_host_sigterm_sync(trainer, None)  # type: ignore[arg-type]
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # no signal: training goes on
    connector._sigterm_notifier_fn(15, None)
    assert connector.received_sigterm and killed == [15]  # the handler forwards to children, no collective
    with pytest.raises(SIGTERMException):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
