"""NeuronDDPStrategy training with 2 processes, on whichever backend the suite runs (XLA:CPU, or the native
`neuron` stand-in): `tests/scripts/ddp_train.py` is launched the ways users do (plain `python`, torchrun, two torchrun
"nodes") and the saved weights are compared with a one-process run on the same global batches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import child_env, free_port

pytestmark = pytest.mark.both

SCRIPT = Path(__file__).parents[1] / "scripts" / "ddp_train.py"
STEPS = 5
#: float32 SGD (lr 0.1, no momentum, 5 steps) on a 2-process mean of means vs a 1-process mean: a few ulps of each
#: gradient (<= ~1: ~4e-7) move a weight by lr x that a step, ~2e-7 after 5; the last loss (~0.5) moves less
WEIGHT_TOLERANCE = 1e-6
#: a launch (2 interpreters importing torch_xla, compiling and training 5 steps) finishes well within this
RUN_TIMEOUT_S = 150


def _train_args(out: Path, devices: int, num_nodes: int = 1, *extra: str) -> list[str]:
    batch_size = 8 // (devices * num_nodes)
    return [
        str(SCRIPT),
        "--out",
        str(out),
        "--devices",
        str(devices),
        "--num-nodes",
        str(num_nodes),
        "--batch-size",
        str(batch_size),
        "--steps",
        str(STEPS),
        *extra,
    ]


def _run(command: list[str], out: Path) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, env=child_env(), cwd=out, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _torchrun(nproc: int, nnodes: int = 1, node_rank: int = 0, port: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        "--master_addr=127.0.0.1",
        f"--master_port={port or free_port()}",
    ]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.ckpt", weights_only=True)["state_dict"]


def _run_summary(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def _assert_trained_like_reference(
    out: Path, reference: dict[str, torch.Tensor], reference_loss: float, devices_per_node: int = 2
) -> None:
    summary = _run_summary(out)
    assert summary["last_loss"] == pytest.approx(reference_loss, abs=WEIGHT_TOLERANCE)  # `sync_dist=True` averaged it
    assert summary["samples"] == 8 * STEPS  # the torchmetrics state summed over both ranks (2 x batch 4 per step)
    # no `.item()` on a device tensor between steps: Lightning's per-step SIGTERM broadcast would add one per step
    assert summary["scalar_reads"] == 0
    # native: gradients, `sync_dist` and torchmetrics reduce on the device; XLA:CPU reduces on host copies (gloo)
    if summary["backend"] == "native":
        assert summary["device_to_host"] == 0
        # one device per process: its local rank's
        assert [(out / f"device_rank{r}.txt").read_text() for r in (0, 1)] == [
            f"neuron:{r % devices_per_node}" for r in (0, 1)
        ]
    assert [(out / f"tied_rank{r}.txt").read_text() for r in (0, 1)] == ["True", "True"]
    # a gloo group left to the interpreter's teardown aborts the process now and then, after a finished run
    assert [(out / f"groups_destroyed_rank{r}.txt").read_text() for r in (0, 1)] == ["True", "True"]
    weights = _weights(out)
    assert weights.keys() == reference.keys()
    assert all(w.device.type == "cpu" for w in weights.values())
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, atol=WEIGHT_TOLERANCE, rtol=0, msg=name)
    assert (out / "saved_by.txt").read_text().split() == ["0"]  # written once, by global rank 0
    results = json.loads((out / "collectives.json").read_text())
    assert results["world_size"] == 2
    assert {op: results[op] for op in ("sum", "mean", "max", "min")} == {
        "sum": [3.0],
        "mean": [1.5],
        "max": [2.0],
        "min": [1.0],
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
@pytest.mark.numerics
def test_self_launched_two_processes_match_one_process(tmp_path: Path, reference: tuple) -> None:
    """`python train.py` with devices=2: the strategy starts rank 1 itself."""
    result = _run([sys.executable, *_train_args(tmp_path, devices=2)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_trained_like_reference(tmp_path, *reference)


@pytest.mark.slow
@pytest.mark.numerics
def test_torchrun_two_processes_match_one_process(tmp_path: Path, reference: tuple) -> None:
    result = _run([*_torchrun(nproc=2), *_train_args(tmp_path, devices=2)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_trained_like_reference(tmp_path, *reference)


@pytest.mark.slow
def test_two_nodes_train_and_checkpoint_once(tmp_path: Path, reference: tuple) -> None:
    """Two torchrun "nodes" on this machine, one process each, sharing the output directory."""
    port = free_port()
    nodes = [
        subprocess.Popen(
            [*_torchrun(nproc=1, nnodes=2, node_rank=rank, port=port), *_train_args(tmp_path, devices=1, num_nodes=2)],
            env=child_env(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=RUN_TIMEOUT_S)[0] for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        outputs = [node.communicate()[0] for node in nodes]
        pytest.fail(f"a node did not finish within {RUN_TIMEOUT_S} s:\n" + "\n".join(o[-3000:] for o in outputs))
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["final.ckpt"]
    _assert_trained_like_reference(tmp_path, *reference, devices_per_node=1)


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


FABRIC_SCRIPT = Path(__file__).parents[1] / "scripts" / "fabric_train.py"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
@pytest.mark.numerics
def test_fabric_loop_on_two_processes_matches_the_trainer_on_one(tmp_path: Path, reference: tuple, launcher: str):
    """The same job as a Fabric loop written the natural way: `fabric.launch()` self-launch or torchrun,
    batch 4 on each of 2 ranks, ends with the weights of the 1-process Trainer run on batch 8."""
    prefix = [sys.executable] if launcher == "python" else _torchrun(nproc=2)
    args = [str(FABRIC_SCRIPT), "--out", str(tmp_path), "--devices", "2", "--batch-size", "4", "--steps", str(STEPS)]
    result = _run([*prefix, *args], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    weights, reference_loss = reference
    run = _run_summary(tmp_path)
    assert run["world_size"] == 2 and run["tied"]
    assert run["last_loss"] == pytest.approx(reference_loss, abs=WEIGHT_TOLERANCE)
    # between steps: nothing read from the device, no graph compiled after the first steps
    assert (run["scalar_reads"], run["compiles"]) == (0, 0)
    if run["backend"] == "native":
        assert run["device_to_host"] == 0
    assert (run["sum"], run["gathered"], run["broadcast"]) == ([3.0], [[1.0], [2.0]], {"from_rank": 0})
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=True)
    assert saved.keys() >= {"state_dict", "optimizer_states", "lr_schedulers", "pytorch-lightning_version"}
    assert all(w.device.type == "cpu" for w in saved["state_dict"].values())
    for name, value in weights.items():
        torch.testing.assert_close(saved["state_dict"][name], value, atol=WEIGHT_TOLERANCE, rtol=0, msg=name)
