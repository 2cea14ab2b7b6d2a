"""`python -m benchmarks.step_vs_torchtitan --tiny`: the LLM recipe's step against TorchTitan's own (torchtitan 0.3.0's
Llama 3 and Qwen3 models, plans and step, `benchmarks/_torchtitan.py`), both presets shrunk to dp 2 x tp 2, 2 layers,
simulated by the estimator; and `simulate_torchtitan`'s result as another benchmark reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.native_only, pytest.mark.slow]  # tensor parallel and FSDP2 run on the native backend only

REPO = Path(__file__).resolve().parents[2]
LAYERS = 2  # `--tiny`


def run(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, env=dict(os.environ), timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def table_rows(stdout: str) -> list[dict[str, str]]:
    """Every row of the Markdown tables the benchmark prints (one per preset and family), headers dropped."""
    rows, header = [], None
    for line in stdout.splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == "preset":
            header = cells
        elif not line.startswith("|---"):
            assert header is not None
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


@pytest.fixture(scope="module")
def tiny() -> tuple[dict[tuple[str, str, str], dict[str, str]], str]:
    stdout = run("-m", "benchmarks.step_vs_torchtitan", "--tiny").stdout
    rows = {(row["preset"], row["family"], row["collective / memory"]): row for row in table_rows(stdout)}
    return rows, stdout


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize("preset", ["trn2-8b", "trn2-70b"])
def test_the_two_plans_shard_alike(tiny, preset, family):
    """The same parameters per rank, the same tensor-parallel traffic, FSDP2's reduce-scatters alike; TorchTitan's
    extra FSDP2 all-gather of its [norm, lm_head] unit (its chunked loss reshards it) and, with full activation
    checkpointing (trn2-70b), its recompute's extra reduce-scatter per layer (`early_stop=False`)."""
    rows, _ = tiny

    def row(label: str) -> dict[str, str]:
        return rows[(preset, family, label)]

    assert row("parameters per rank (elements)")["ratio"] == "1.00"
    for label in ("all_gather over tp", "reduce_scatter over dp_shard"):
        assert row(label)["recipe bytes"] == row(label)["TorchTitan bytes"] != "0 B", row(label)
    gathers = row("all_gather over dp_shard")
    assert int(gathers["TorchTitan count"]) == int(gathers["recipe count"]) + 1
    scatters = row("reduce_scatter over tp")
    checkpointed = preset == "trn2-70b"
    assert int(scatters["TorchTitan count"]) == int(scatters["recipe count"]) + (LAYERS if checkpointed else 0)
    # the loss: TorchTitan's 8 chunks, 3 all-reduces each, against loss_parallel's 3; the same bytes
    assert row("all_reduce over tp")["ratio"] == "1.00"
    assert float(row("**all collectives (bytes)**")["ratio"]) <= 1.0


def test_every_difference_has_its_reason_and_the_stand_ins_are_named(tiny):
    rows, stdout = tiny
    differing = {
        label
        for (_, _, label), row in rows.items()
        if (row["ratio"] != "1.00" or row["recipe count"] != row["TorchTitan count"])
        and not label.startswith(("estimator: ", "**all"))
    }
    assert differing >= {"all_gather over dp_shard", "all_reduce over batch", "at peak: gradients"}
    for label in differing:
        reason = "peak" if label == "**peak per rank**" else label
        assert f"  reason: {reason}:" in stdout, label
    assert "not analysed" not in stdout
    # TorchTitan's Hugging Face backend: what it did with the recipe's model, in its own words
    for preset in ("trn2-8b", "trn2-70b"):
        assert f"{preset}: TorchTitan's transformers_modeling_backend on the recipe's LlamaForCausalLM" in stdout
    assert "FlexAttention compiles its kernel with Inductor" in stdout


SCRIPT = """
import json, os
os.environ["LIGHTNING_TRN_STANDIN_DEVICES"] = "64"
os.environ.setdefault("LIGHTNING_TRN_BACKEND", "native")
from benchmarks._torchtitan import ModelShape, simulate_torchtitan
from lightning_trn.estimate import simulation

shape = ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=4096)
step = simulate_torchtitan(
    "qwen3", shape, world_size=8, devices_per_node=4, tp=2, dp_replicate=2, ac="selective", local_batch=2, seq_len=256
)
print(json.dumps({
    "same": simulation._collectives(step.modes) == step.collectives,
    "modes": len(step.modes),
    "calls": sum(c.count for c in step.collectives),
    "by_dim": sum(step.counts.values()),
    "dims": sorted({dim for _, dim in step.counts}),
    "across": sum(c.across_nodes for c in step.collectives),
    "layout": [step.tp, step.dp_shard, step.dp_replicate],
    "parameters": step.parameters,
    "peak": step.peak,
}))
"""


def test_simulate_torchtitan_keeps_the_measured_steps_modes():
    """HSDP over 2 nodes with selective activation checkpointing: the result holds the measured step's counting
    modes (which total to its collectives), every collective filed under one of TorchTitan's mesh dimensions, the
    replicas' all-reduce across the nodes."""
    result = json.loads(run("-c", SCRIPT).stdout.splitlines()[-1])
    assert result["same"] and result["modes"] == 1
    assert result["calls"] == result["by_dim"] > 0
    assert "?" not in result["dims"] and {"fsdp", "tp", "dp_replicate", "batch"} <= set(result["dims"])
    assert result["across"] > 0
    assert result["layout"] == [2, 2, 2] and result["parameters"] > 0 and result["peak"] > 0
