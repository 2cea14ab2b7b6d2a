"""The benchmark scripts run end to end with a few MLP steps, through their documented command lines, on the backend
of the suite (`overhead` and `device_behaviour` on both; `compile_cache` on XLA only; `memory` natively); the LLM
workload of `overhead` and `job_economy` with a few steps too."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.both, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def run_benchmark(*args: str) -> list[dict[str, str]]:
    """`python -m benchmarks.<name> ...` from the repo root; the rows of the Markdown table it prints last."""
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in row.strip("|").split("|")), strict=True)) for row in table[1:]]


def test_overhead_prints_both_sides_and_their_ratio():
    (row,) = run_benchmark(
        "benchmarks.overhead",
        "--workloads",
        "mlp",
        "--repeats",
        "1",
        "--warmup",
        "3",
        "--steps",
        "5",
        "--breakdown",
        "--lightning-on-cpu",
    )
    plugin, hand_written = float(row["plugin steps/s (median)"]), float(row["hand-written steps/s (median)"])
    assert plugin > 0 and hand_written > 0
    # one pair: the ratio is the rates' quotient, printed to 3 decimals, the rates to 3 significant digits (each
    # <= 0.5% off), so their quotient is within ~1% of it
    assert float(row["ratio (median of pairs)"]) == pytest.approx(plugin / hand_written, rel=0.01)
    # the loop floors, on XLA and in stock Lightning on the CPU, in ms per step over their hand-written loops
    for column in ("loop floor on XLA: ms/step over hand-written", "loop floor on CPU: ms/step over hand-written"):
        assert math.isfinite(float(row[column]))


@pytest.mark.native_only  # CI time: the harness's LLM path does not depend on the backend; the XLA suite checks
# the LLM job's graphs in test_job_economy_llm_twin_does_the_plugins_work and tests/runtime/test_precompile.py
def test_overhead_prints_the_llm_row():
    """The LLM recipe's module (AdamW with its LR schedule, clipping) in both loops; past the first two steps (the one
    creating AdamW's state, then the steady one) nothing compiles."""
    (row,) = run_benchmark(
        "benchmarks.overhead", "--workloads", "llm", "--repeats", "1", "--warmup", "2", "--steps", "3"
    )
    assert row["workload"] == "llm" and row["warm-up + timed steps"] == "2 + 3"
    plugin, hand_written = float(row["plugin steps/s (median)"]), float(row["hand-written steps/s (median)"])
    assert plugin > 0 and hand_written > 0
    assert float(row["ratio (median of pairs)"]) == pytest.approx(plugin / hand_written, rel=0.01)  # as above
    assert row["compiles while timed (max)"] == "0"


def test_device_behaviour_finds_no_transfers_or_fallbacks_between_logging_steps():
    # warm-up past the first logging step (50) and epoch end (110): their graphs compile once, then the timed steps
    # include the logging step 150
    rows = run_benchmark("benchmarks.device_behaviour", "--workloads", "mlp", "--warmup", "115", "--steps", "40")
    plugin = next(row for row in rows if row["loop"] == "plugin")
    assert plugin["compiles after warm-up"] == "0"
    assert plugin["none on other steps"] == "yes"
    assert "logging" in plugin["D2H transfers + scalar reads / steps, by kind of step"]
    assert plugin["CPU fallbacks (whole run)"] == "0"


@pytest.mark.xla_only  # the persistent compile cache is torch_xla's
def test_compile_cache_warm_run_finds_every_graph_of_the_cold_run():
    cold, warm, _ = run_benchmark("benchmarks.compile_cache", "--workload", "mlp", "--steps", "2")
    assert (cold["run"], warm["run"]) == ("cold", "warm")
    assert int(cold["cache misses"]) == int(cold["compiles"]) > 0 and cold["cache hits"] == "0"
    assert warm["cache misses"] == "0"
    assert int(warm["cache hits"]) + int(warm["unloadable"]) == int(cold["cache misses"])


@pytest.mark.xla_only  # the expert twin is torch_xla code
def test_job_economy_twin_does_the_plugins_work_with_the_experts_costs():
    """The MLP recipe's whole job through the plugin, its hand-written twin and the plugin with the bare loop (issue
    19): the twin and the bare loop train the same steps to the same test loss and accuracy; the twin with the
    expert's graphs (materialising the module's states, first step, steady step, one evaluation step shared with
    test) and one transfer per epoch-mean read and checkpoint. Three of the recipe's ten epochs (CI time): every count
    below is per job phase or per epoch."""
    from benchmarks.job_economy import main

    ((plugin, expert, floor),) = main(["--workloads", "mlp", "--floor", "--set", "trainer.max_epochs=3"]).values()
    for other in (expert, floor):
        assert plugin.phases["train"].steps == other.phases["train"].steps == 3 * 110
        # the same SGD steps: the accuracy over 1000 test rows moves by 1e-3 per other prediction (1e-6: its float32
        # rounding); the loss (~0.3) is the same batch losses grouped otherwise, a few float32 ulps (~1e-7) apart
        assert plugin.test["test_acc"] == pytest.approx(other.test["test_acc"], abs=1e-6)
        assert plugin.test["test_loss"] == pytest.approx(other.test["test_loss"], abs=1e-5)
    assert floor.phases["train"].metrics.compiles == plugin.phases["train"].metrics.compiles  # the same graphs
    compiles = expert.per_phase("compiles")
    assert compiles == {
        "setup": 0,
        "train": 3,
        "validation": 1,
        "epoch end": 0,
        "checkpoint": 0,
        "test": 0,
        "teardown": 0,
    }
    transfers = expert.per_phase("device_to_host")
    assert transfers == {
        "setup": 0,
        "train": 0,
        "validation": 3,
        "epoch end": 3,
        "checkpoint": 3,
        "test": 1,
        "teardown": 0,
    }
    assert sum(p.metrics.compiles for p in plugin.phases.values()) > 0  # measured on the plugin side too


#: the LLM recipe's job shortened: 2 epochs of 12 steps (logging steps 10 and 20), 3 validation and test batches,
#: a narrower model than the recipe's (same layers and ops; CI time)
LLM_JOB = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=12",
    "trainer.limit_val_batches=3",
    "trainer.limit_test_batches=3",
    "data.vocab_size=300",
    "data.seq_len=32",
    "model.hidden_size=32",
    "model.intermediate_size=64",
]


@pytest.mark.xla_only  # the counts are torch_xla's
def test_job_economy_llm_twin_does_the_plugins_work():
    """The LLM recipe's job through the plugin and its hand-written twin (AdamW with the recipe's warm-up + cosine
    schedule stepped per step, gradient clipping, `train_loss` read at each logging step, token-weighted validation
    and test): the same steps to the same test loss and perplexity; the twin's graphs (materialising the module's
    states, first step creating AdamW's state, steady step, one evaluation step shared with test) and transfers
    (one per logging step, evaluation split and checkpoint); the plugin compiles no more, and reads the device only
    at logging steps while training."""
    from benchmarks.job_economy import main

    ((plugin, expert),) = main(["--workloads", "llm", "--set", *LLM_JOB]).values()
    assert plugin.phases["train"].steps == expert.phases["train"].steps == 2 * 12
    # not derived from the computation (tests/tolerance.py has no float64 twin of an XLA job yet): 24 AdamW steps of
    # two XLA graphs of the same ops; held under every ATEN_CPU_CAPABILITY tried (XLA compiles its own kernels)
    assert plugin.test["test_loss"] == pytest.approx(expert.test["test_loss"], abs=1e-5)
    assert plugin.test["test_ppl"] == pytest.approx(expert.test["test_ppl"], rel=1e-5)
    assert expert.per_phase("compiles") == {
        "setup": 0,
        "train": 3,
        "validation": 1,
        "epoch end": 0,
        "checkpoint": 0,
        "test": 0,
        "teardown": 0,
    }
    assert expert.per_phase("device_to_host") == {
        "setup": 0,
        "train": 2,
        "validation": 2,
        "epoch end": 0,
        "checkpoint": 2,
        "test": 1,
        "teardown": 0,
    }
    compiles = plugin.per_phase("compiles")
    assert compiles["train"] == 2 and compiles["validation"] == compiles["test"] == 0
    assert sum(compiles.values()) <= sum(expert.per_phase("compiles").values())
    # the 2 logging steps only (the bar's and the logger's read of train_loss), not one per step
    assert 0 < plugin.phases["train"].metrics.device_to_host <= 2 * 2


@pytest.mark.native_only  # the allocator figures exist natively only; XLA prints n/a
def test_memory_prints_the_checkpointing_pair_with_the_allocators_activation_peak():
    """The activation peak comes from the stand-in's allocator (deterministic); checkpointing lowers it."""
    (row,) = run_benchmark(
        "benchmarks.memory",
        "--pairs",
        "checkpointing",
        "--width",
        "64",
        "--depth",
        "4",
        "--batch",
        "256",
        "--steps",
        "2",
        "--warmup",
        "1",
    )
    assert row["pair (tool vs baseline)"].startswith("activation checkpointing")
    assert float(row["activation ratio"]) < 0.5
    checkpointed, plain = (float(value) for value in row["steps/s"].split(" / "))
    assert checkpointed > 0 and plain > 0


@pytest.mark.native_only  # FSDP2 runs on the native backend only
def test_memory_prints_the_fsdp_pair_with_half_the_optimizer_state_per_rank():
    """FSDP2 over 2 processes keeps half of Adam's moments on rank 0 (plus each parameter's unsharded step count)."""
    (row,) = run_benchmark(
        "benchmarks.memory",
        "--pairs",
        "fsdp",
        "--width",
        "64",
        "--depth",
        "2",
        "--batch",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
    )
    assert row["pair (tool vs baseline)"].startswith("FSDP2 vs DDP")
    # printed to 2 decimals (+-0.005); the step counts each rank keeps whole add < 0.1% of the state's bytes
    assert float(row["optimizer ratio"]) == pytest.approx(0.5, abs=0.02)
    assert float(row["peak ratio"]) < 1


@pytest.mark.native_only  # FSDP2 runs on the native backend only
def test_pretrained_load_reads_each_ranks_shard_against_the_whole_files():
    """Each of 2 FSDP2 ranks reads its half of the folder's bytes (`load_pretrained`), the baseline all of them."""
    rows = run_benchmark("benchmarks.pretrained_load", "--hidden", "128", "--layers", "2", "--vocab", "1000")
    assert [row["rank"] for row in rows] == ["0", "1"]
    for row in rows:
        model, shard = float(row["model MB"]), float(row["shard MB"])
        assert row["read MB"] == row["shard MB"] and row["read MB (whole)"] == row["model MB"]
        # every dim-0 size (vocabulary 1000, hidden 128, MLP 448, k/v 32) is even: the shard is exactly half, and
        # both are printed to 2 decimals (+-0.005)
        assert shard == pytest.approx(model / 2, abs=0.01) and float(row["time ratio"]) > 0


@pytest.mark.native_only  # the simulation runs on the native stand-in
def test_step_time_prints_predicted_over_published_per_row():
    """`benchmarks.step_time --tiny`: TorchTitan's own 8B job shrunk (eager and compiled) and the Trn1 row through
    the recipe, each a positive prediction whose ratio column is predicted / published (the published figures are
    the full jobs', so the ratios of `--tiny` mean nothing)."""
    rows = run_benchmark("benchmarks.step_time", "--tiny", "--rows", "titan-8b-8,trn1-8b")
    assert [row["row"] for row in rows] == [
        "TorchTitan 8B, 8 H100",
        "TorchTitan 8B, 8 H100 + compile",
        "AWS NeuronX Distributed 8B, 32 trn1.32xlarge",
    ]
    for row in rows:
        published, predicted = (float(row[key].replace(",", "")) for key in ("published tok/s/chip", "predicted"))
        # both printed rounded: to the token/s (at least 767 of them) and to 2 decimals
        ratio = float(row["predicted / published"])
        assert predicted > 0 and ratio == pytest.approx(predicted / published, rel=1e-3, abs=0.01)
    # compiled blocks fuse memory-bound chains: the same step, faster
    assert float(rows[1]["predicted"].replace(",", "")) > float(rows[0]["predicted"].replace(",", ""))
