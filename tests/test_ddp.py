"""NeuronDDPStrategy: Neuron env mapping, collectives, world-size checks, and 2-process training on XLA:CPU.

The slow tests launch `tests/scripts/ddp_train.py` the ways users do (plain `python`, torchrun, two torchrun "nodes")
and compare the saved weights with a one-process run on the same global batches.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed import ReduceOp

import lightning_trn
from lightning_trn import NeuronDDPStrategy
from lightning_trn.runtime import XlaRuntime
from lightning_trn.runtime.collectives import check_world_size, reduce_op_name
from lightning_trn.runtime.discovery import NEURON, Platform
from lightning_trn.runtime.environment import EnvironmentPatch
from lightning_trn.runtime.neuron_env import neuron_process_env
from lightning_trn.strategies.host_signals import install_host_sigterm_sync

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
#: float32 SGD on a 2-process mean of means vs a 1-process mean: equal up to summation order
WEIGHT_TOLERANCE = 1e-6
#: a launch (2 interpreters importing torch_xla, compiling and training 5 steps) finishes well within this
RUN_TIMEOUT_S = 150

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


# ---------------------------------------------------------------- 2-process training on XLA:CPU (slow)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    """This environment minus any launcher variables, so each launch sets its own ranks and ports."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("TORCHELASTIC", "PL_"))}
    env.update(PJRT_DEVICE="CPU", MASTER_ADDR="127.0.0.1", PYTHONPATH=str(PROJECT_ROOT))
    return env


def _train_args(out: Path, devices: int, num_nodes: int = 1, *extra: str) -> list[str]:
    batch_size = 8 // (devices * num_nodes)
    return [str(SCRIPT), "--out", str(out), "--devices", str(devices), "--num-nodes", str(num_nodes),
            "--batch-size", str(batch_size), "--steps", str(STEPS), *extra]


def _run(command: list[str], out: Path) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, env=_env(), cwd=out, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _torchrun(nproc: int, nnodes: int = 1, node_rank: int = 0, port: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
            f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port or _free_port()}"]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.ckpt", weights_only=True)["state_dict"]


def _run_summary(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def _assert_trained_like_reference(out: Path, reference: dict[str, torch.Tensor], reference_loss: float) -> None:
    summary = _run_summary(out)
    assert summary["last_loss"] == pytest.approx(reference_loss, abs=WEIGHT_TOLERANCE)  # `sync_dist=True` averaged it
    assert summary["samples"] == 8 * STEPS  # the torchmetrics state summed over both ranks (2 x batch 4 per step)
    # no `.item()` on a device tensor between steps: Lightning's per-step SIGTERM broadcast would add one per step
    assert summary["scalar_reads"] == 0
    weights = _weights(out)
    assert weights.keys() == reference.keys()
    assert all(w.device.type == "cpu" for w in weights.values())
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, atol=WEIGHT_TOLERANCE, rtol=0, msg=name)
    assert (out / "saved_by.txt").read_text().split() == ["0"]  # written once, by global rank 0
    results = json.loads((out / "collectives.json").read_text())
    assert results["world_size"] == 2
    assert {op: results[op] for op in ("sum", "mean", "max", "min")} == {
        "sum": [3.0], "mean": [1.5], "max": [2.0], "min": [1.0]
    }
    assert results["gathered"] == [[1.0], [2.0]]
    assert results["broadcast"] == {"from_rank": 0}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], float]:
    """One process, batch 8: the weights (and last loss) 2 processes with batch 4 each must reach."""
    out = tmp_path_factory.mktemp("single")
    result = _run([sys.executable, *_train_args(out, devices=1)], out)
    assert result.returncode == 0, result.stderr[-3000:]
    return _weights(out), _run_summary(out)["last_loss"]


@pytest.mark.slow
def test_self_launched_two_processes_match_one_process(tmp_path: Path, reference: tuple) -> None:
    """`python train.py` with devices=2: the strategy starts rank 1 itself."""
    result = _run([sys.executable, *_train_args(tmp_path, devices=2)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_trained_like_reference(tmp_path, *reference)


@pytest.mark.slow
def test_torchrun_two_processes_match_one_process(tmp_path: Path, reference: tuple) -> None:
    result = _run([*_torchrun(nproc=2), *_train_args(tmp_path, devices=2)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_trained_like_reference(tmp_path, *reference)


@pytest.mark.slow
def test_two_nodes_train_and_checkpoint_once(tmp_path: Path, reference: tuple) -> None:
    """Two torchrun "nodes" on this machine, one process each, sharing the output directory."""
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [*_torchrun(nproc=1, nnodes=2, node_rank=rank, port=port), *_train_args(tmp_path, devices=1, num_nodes=2)],
            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=RUN_TIMEOUT_S)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["final.ckpt"]
    _assert_trained_like_reference(tmp_path, *reference)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_dead_rank_fails_the_others_instead_of_hanging(tmp_path: Path, launcher: str) -> None:
    """Rank 1 exits abruptly at step 3; rank 0 must stop with an error naming the cause, not wait forever."""
    prefix = [sys.executable] if launcher == "python" else _torchrun(nproc=2)
    command = [*prefix, *_train_args(tmp_path, 2, 1, "--die-rank", "1", "--die-step", "3", "--timeout-s", "30")]
    result = _run(command, tmp_path)  # raises subprocess.TimeoutExpired if rank 0 hangs
    assert result.returncode != 0
    # rank 0's failed all-reduce names the cause; if the launcher notices the dead rank first (Lightning's process
    # observer polls every 5 s, torchrun's agent every 0.1 s) and stops rank 0, the launcher names the dead rank instead
    clear_errors = ("another rank exited or stopped answering", "terminated with code 3", "failed (exitcode: 3)")
    assert any(message in result.stderr for message in clear_errors), result.stderr[-3000:]
    assert not (tmp_path / "final.ckpt").exists()
