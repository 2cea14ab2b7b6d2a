"""NeuronDDPStrategy on the XLA backend: Neuron env mapping, collectives, world-size checks (2-process training,
shared with the native backend, is in test_ddp_training.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed import ReduceOp
from typing_extensions import override

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

RANKS = {"global_rank": 3, "local_rank": 1, "world_size": 4, "local_world_size": 2, "main_address": "10.0.0.7"}


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
    torchrun = {
        "TORCHELASTIC_RUN_ID": "job",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.7",
        "NEURON_RT_VISIBLE_CORES": "4-5",
    }
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    ours = neuron_process_env(before, **RANKS)
    # torch_xla sets variables monkeypatch does not know of: later tests (and their child jobs) must not inherit them
    with mock.patch.dict(os.environ):
        neuron.configure_pjrt_environment()
        torch_xla_set = {k: v for k, v in os.environ.items() if before.get(k) != v}
        again = neuron_process_env(dict(os.environ), **RANKS)
        assert {name: os.environ[name] for name in again} == again
    assert ours == {**torch_xla_set, "NEURON_RT_VISIBLE_CORES": "5"}


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
    for name in (
        "NEURON_RT_VISIBLE_CORES",
        "NEURON_RT_ROOT_COMM_ID",
        "NEURON_PJRT_PROCESS_INDEX",
        "NEURON_PJRT_WORLD_SIZE",
        "NEURON_PJRT_PROCESSES_NUM_DEVICES",
        "PJRT_LOCAL_PROCESS_RANK",
        "PJRT_LOCAL_PROCESS_COUNT",
    ):
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
    [
        ("sum", "sum"),
        ("mean", "mean"),
        ("avg", "mean"),
        ("MAX", "max"),
        ("min", "min"),
        (None, "mean"),
        (ReduceOp.SUM, "sum"),
        (ReduceOp.AVG, "mean"),
        (ReduceOp.MAX, "max"),
        (ReduceOp.MIN, "min"),
    ],
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
        accelerator="neuron",
        devices=1,
        strategy=NeuronDDPStrategy(process_group_backend="xla"),
        default_root_dir=tmp_path,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
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


class RecordingSignalConnector(_SignalConnector):
    """Lightning's signal connector with the SLURM requeue (HPC save, `scontrol requeue`) recorded, not run."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.requeues: list[int] = []

    @override
    def _slurm_sigusr_handler_fn(self, signum: Any, _: Any) -> None:
        self.requeues.append(signum)


def _signal_trainer(fn: TrainerFn, world_size: int = 2) -> Any:
    """What `install_host_sigterm_sync` reads of a Trainer. The 1-process gloo group stands in for the host group,
    where the max over ranks is this rank's flag (the agreement of 2 ranks: test_fault_tolerance.py's DDP job)."""
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_broadcast_sigterm_tensor=None)),
        global_rank=0,
        world_size=world_size,
        state=SimpleNamespace(fn=fn),
        killed=[],
        _accelerator_connector=SimpleNamespace(cluster_environment=SLURMEnvironment(auto_requeue=True)),
    )
    trainer.strategy = SimpleNamespace(launcher=SimpleNamespace(kill=trainer.killed.append))
    trainer._signal_connector = RecordingSignalConnector(trainer)
    return trainer


def test_signals_while_fitting_are_acted_on_at_the_next_batch_on_the_host(single_process_gloo: None) -> None:
    trainer = _signal_trainer(TrainerFn.FITTING)
    connector = trainer._signal_connector
    assert install_host_sigterm_sync(trainer, None)
    agree = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor
    before = [signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)]
    connector.register_signal_handlers()  # Lightning's, with SLURM auto-requeue: it registers the replacements
    try:
        agree()  # no signal: training goes on
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        # recorded: no requeue inside the handler, and no flag that would stop this rank alone after its step;
        # SIGTERM is forwarded to launched children at once
        assert (connector.requeues, connector.received_sigterm, trainer.killed) == ([], False, [signal.SIGTERM])
        with pytest.raises(SIGTERMException):
            agree()  # every rank acts here
        assert connector.received_sigterm and connector.requeues == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)  # from another rank, after the agreement: one requeue per run
        with pytest.raises(SIGTERMException):
            agree()
        assert connector.requeues == [signal.SIGUSR1]
    finally:
        connector.teardown()
    assert [signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)] == before


def test_sigterm_after_the_last_agreement_is_still_reported(single_process_gloo: None) -> None:
    trainer = _signal_trainer(TrainerFn.FITTING)
    connector = trainer._signal_connector
    assert install_host_sigterm_sync(trainer, None)
    connector._sigterm_notifier_fn(signal.SIGTERM, None)  # during the last step: no batch follows
    assert not connector.received_sigterm
    connector.teardown()
    assert connector.received_sigterm  # what `trainer.received_sigterm` says after `fit` returns


def test_signals_outside_fit_act_at_once_and_one_process_keeps_lightnings_handlers(
    single_process_gloo: None,
) -> None:
    trainer = _signal_trainer(TrainerFn.VALIDATING)
    connector = trainer._signal_connector
    assert install_host_sigterm_sync(trainer, None)
    connector._slurm_sigusr_handler_fn(signal.SIGUSR1, None)
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert connector.requeues == [signal.SIGUSR1] and connector.received_sigterm  # no per-batch agreement to wait for
    single = _signal_trainer(TrainerFn.FITTING, world_size=1)
    assert not install_host_sigterm_sync(single, None)  # Lightning checks its own flag; nothing to agree on
    assert single.fit_loop.epoch_loop._broadcast_sigterm_tensor is None
    assert "_sigterm_notifier_fn" not in vars(single._signal_connector)
