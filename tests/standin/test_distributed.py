"""The stand-in's `neuron` process-group backend across 2 torchrun processes on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "collectives.py"
CHECKS = [
    "all_reduce_SUM", "all_reduce_AVG", "all_reduce_MAX", "all_reduce_MIN", "all_reduce_AVG_int",
    "collectives_read_nothing_to_the_host", "broadcast", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "async_work_completes", "object_collectives", "exchange", "ddp_equals_single_process",
    "funcol_all_reduce", "dtensor_shard", "dtensor_redistribute", "fsdp2_grads_equal_single_process",
]
RANK_ONLY = {"reduce": 0, "send_recv": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = tmp_path_factory.mktemp("collectives")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", str(SCRIPT), str(out),
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
