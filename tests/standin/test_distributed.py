"""The stand-in's `neuron` process-group backend across 2 torchrun processes on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import free_port

pytestmark = pytest.mark.native_only

SCRIPT = Path(__file__).parents[1] / "scripts" / "collectives.py"
CHECKS = [
    "all_reduce_SUM",
    "all_reduce_AVG",
    "all_reduce_MAX",
    "all_reduce_MIN",
    "all_reduce_AVG_int",
    "collectives_read_nothing_to_the_host",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "async_work_completes",
    "object_collectives",
    "ddp_equals_single_process",
    "funcol_all_reduce",
    "dtensor_shard",
    "dtensor_redistribute",
    "fsdp2_grads_equal_single_process",
    "no_point_to_point",
    "barrier_default_group_only",
    "no_monitored_barrier",
    "visible_cores_from_local_rank",
]
RANK_ONLY = {"reduce": 0}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = tmp_path_factory.mktemp("collectives")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(SCRIPT),
        str(out),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", CHECKS)
def test_on_both_ranks(results: list[dict[str, object]], name: str) -> None:
    assert [r.get(name) for r in results] == [True, True]  # else the value is the error the check's section raised


@pytest.mark.parametrize("name", sorted(RANK_ONLY))
def test_on_one_rank(results: list[dict[str, object]], name: str) -> None:
    assert results[RANK_ONLY[name]].get(name) is True


def test_a_device_tensor_before_the_process_group_is_refused_as_on_torchneuron(tmp_path: Path) -> None:
    """TorchNeuron's `init_process_group("neuron")` asserts that the runtime has not started: the first device
    tensor starts it. Both ranks allocate first, so both are refused (before any collective: nothing hangs)."""
    script = tmp_path / "early.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from lightning_trn import standin\n"
        "torch.neuron.set_device(0); torch.neuron.manual_seed(0); torch.neuron.device_count()  # none starts it\n"
        "torch.zeros(1, device='neuron')\n"
        "dist.init_process_group('neuron')\n"
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert (
        run.stderr.count("AssertionError: Neuron runtime should not be initialized before the init_process_group") >= 1
    ), run.stderr[-3000:]
