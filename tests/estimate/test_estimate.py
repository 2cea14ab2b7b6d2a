"""`lightning_trn.estimate`: one training step simulated at a job's world size on a fake process group and fake
tensors, against the same job run for real.

What is checked: for FSDP2 (with and without activation checkpointing), tensor parallelism and ZeRO-1 on 2 stand-in
`neuron` processes, and FSDP2 x tensor parallelism with activation checkpointing on 4 (the LLM recipe's model,
about 21 M parameters), the estimated per-rank peak is within 10 % of the stand-in allocator's peak over the second
training step (`torch.neuron.max_memory_allocated()`; measured here: within 100 bytes), and so is each pipeline
stage's (2 stages, 1F1B, one simulated rank per stage) against the real rank holding it; the command line prints the
tables, ends with the `peak device memory per rank` line and exits 0 when the job fits, 1 with one line of advice
when it does not, without allocating the model; `--plan` lists the largest micro-batch that fits per layout,
fastest first; the collectives' bytes in groups that span nodes are told apart from those within a node (FSDP2
against HSDP). The simulations run in this process: a simulation leaves it as it found it
(tests/estimate/test_estimate_patterns.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_trn.estimate.__main__ import main
from tests.launch import child_env

pytestmark = pytest.mark.native_only

SCRIPT = Path(__file__).parents[1] / "scripts" / "estimate_measured.py"
sys.path.insert(0, str(SCRIPT.parent))
import estimate_measured as measured  # noqa: E402

RUN_TIMEOUT_S = 300
LAST_LINE = re.compile(r"^peak device memory per rank: (\d+\.\d\d) GiB of (\d+\.\d\d) GiB$")


@pytest.fixture(autouse=True)
def _keeps_the_process_state() -> Iterator[None]:
    """The command line's `main` selects the stand-in through the environment, as a fresh process would; the tests
    run it in this one, so the environment is put back. The simulation must leave torch's thread count as it was."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    yield
    os.environ.clear()
    os.environ.update(environ)
    assert torch.get_num_threads() == threads


def _measured_peaks(out: Path, strategy: str, checkpointing: bool, devices: int) -> list[list[int]]:
    """Each rank's allocator peaks over the two steps of the worker script's real run on `devices` processes."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        str(SCRIPT),
        "--out",
        str(out),
        "--strategy",
        strategy,
        "--ac",
        str(int(checkpointing)),
        "--devices",
        str(devices),
    ]
    env = child_env(LIGHTNING_TRN_STANDIN="1", LIGHTNING_TRN_STANDIN_DEVICES=str(devices))
    result = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"peak-{rank}.json").read_text()) for rank in range(devices)]


@pytest.mark.slow  # a real multi-process run per layout: CI, not the inner loop
@pytest.mark.parametrize(
    ("strategy", "checkpointing", "devices"),
    [
        ("fsdp", False, 2),
        ("fsdp", True, 2),
        ("tp", False, 2),
        ("zero1", False, 2),
        ("tp", True, 4),
        ("tp", False, 4),  # FSDP2 over 2 x tensor parallel over 2
    ],
)
def test_estimated_peak_matches_the_allocator(tmp_path: Path, strategy: str, checkpointing: bool, devices: int) -> None:
    """The simulated rank's peak against every real rank's (alike: even shards), within 10 %."""
    result = measured.estimated(strategy, checkpointing, devices)  # in this process: a simulation leaves it as it was
    peaks = _measured_peaks(tmp_path, strategy, checkpointing, devices)
    for first, second in peaks:
        assert first <= second  # the job's peak is the second step's, the one estimated
        assert abs(result.peak - second) <= 0.10 * second, (result.peak, peaks)
    rank = result.ranks[0]
    parts = rank.parameters + rank.gradients + rank.optimizer_state + rank.activations + rank.temporaries
    assert parts == rank.peak and rank.optimizer_state > 0  # the second step, with the optimizer state
    if strategy != "zero1":  # AdamW's two moments of this rank's parameters (ZeRO-1's state is in chunks), plus,
        # where the peak falls inside the optimizer step (gradients are freed before the forward, so the forward's
        # peak can be the lower one), the step's one moment-sized temporary, which the tracker counts as state
        assert 1.99 * rank.parameters <= rank.optimizer_state <= 3.01 * rank.parameters
    assert result.collectives and all(c.count > 0 and c.bytes_per_rank > 0 for c in result.collectives)


@pytest.mark.slow  # a real multi-process run: CI, not the inner loop
def test_estimated_stage_peaks_match_the_allocator(tmp_path: Path) -> None:
    """Pipeline stages (2 ranks, 1F1B over 4 microbatches): one simulated rank per stage, the schedule run in the
    simulation, each stage's peak within 5 % of the real rank holding that stage (measured here: 2.1 % over on the
    first stage, whose peak is its optimizer step, 0.2 % on the last, whose peak holds its microbatches' logits);
    the stage transfers counted are every microbatch's activation, forward and back."""
    result = measured.estimated("pp", False, 2)
    peaks = _measured_peaks(tmp_path, "pp", False, 2)
    assert result.pipeline is not None and result.pipeline.stages == {0: [0], 1: [1]}
    assert [rank.rank for rank in result.ranks] == [0, 1]
    for rank, (_, second) in zip(result.ranks, peaks, strict=True):  # 5 %: the optimizer's form (9 % off) shows
        assert abs(rank.peak - second) <= 0.05 * second, (result.ranks, peaks)
    first, last = result.ranks
    assert last.activations > first.activations  # the last stage's logits and loss
    microbatch = measured.BATCH_SIZE // measured.MICROBATCHES
    activation = microbatch * measured.MODEL["seq_len"] * (measured.MODEL["hidden_size"] // 2) * 4  # fp32
    for rank in (0, 1):  # each stage sends one way and receives the other, once per microbatch
        sent, received = result.pipeline.point_to_point(rank)
        assert sent + received == activation * measured.MICROBATCHES * 2
    assert result.pipeline.bubble == pytest.approx(1 / 5)  # (p-1)/(m+p-1), up to float64 rounding
    assert result.fits and result.peak == last.peak


def _cli(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, list[str]]:
    small = [
        "trainer.devices=2",
        "trainer.strategy=model_parallel",
        "model.tensor_parallel_size=2",
        "data.vocab_size=4096",
        "data.seq_len=256",
        "data.batch_size=8",
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "model.num_layers=2",
    ]
    code = main(["llm", *small, *overrides])
    return code, capsys.readouterr().out.strip().splitlines()


def test_cli_prints_the_tables_and_exits_0_when_it_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _cli(capsys)
    assert code == 0
    assert any(line.split("|")[0].strip() == "0" for line in lines)  # rank 0's row
    assert any("all_reduce" in line for line in lines)  # tensor parallelism's collectives
    peak, capacity = map(float, LAST_LINE.match(lines[-1]).groups())
    assert 0 < peak < capacity == 24.0  # Trn2's logical core by default


def test_cli_exits_1_with_advice_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """A micro-batch whose logits alone exceed a Trn1 core (4 x 2048 x 2**20 x 4 bytes: 32 GiB): reported, not run
    out of memory (nothing is allocated)."""
    code, lines = _cli(capsys, "data.batch_size=4", "data.seq_len=2048", "data.vocab_size=1048576", "--platform=trn1")
    assert code == 1
    peak, capacity = map(float, LAST_LINE.match(lines[-1]).groups())
    assert peak > capacity == 16.0
    assert lines[-2].startswith("does not fit:") and "activation checkpointing" in lines[-2]


#: `--plan` on a Trn1 core for a job whose logits (micro-batch x 2048 x 262144, fp32) stop every layout below
#: micro-batch 4
PLAN_JOB = (
    "trainer.devices=2",
    "trainer.strategy=model_parallel",
    "data.vocab_size=262144",
    "data.seq_len=2048",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=1",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "--platform=trn1",
    "--plan",
)


def _plan_rows(capsys: pytest.CaptureFixture[str]) -> tuple[list[list[str]], list[str]]:
    lines = capsys.readouterr().out.strip().splitlines()
    return [[cell.strip() for cell in line.split("|")] for line in lines if re.match(r"^\s+\d+ \|", line)], lines


def test_cli_plan_lists_the_largest_micro_batch_per_layout(capsys: pytest.CaptureFixture[str]) -> None:
    """`--plan`: each tensor-parallel size that divides the devices and key/value heads (1, 2), with and without
    checkpointing, at micro-batches 1, 2, 4, ...: the largest below 4 per layout."""
    assert main(["llm", *PLAN_JOB]) == 0
    rows, lines = _plan_rows(capsys)
    assert sorted((row[0], row[1]) for row in rows) == [("1", "false"), ("1", "true"), ("2", "false"), ("2", "true")]
    assert all(row[2] in ("1", "2") and float(row[3].split()[0]) <= 16.0 for row in rows)
    assert any(line.startswith("capacity per rank: 16.00 GiB") for line in lines)
    # fastest first: the step-time model's tokens/s per chip, in decreasing order
    speeds = [float(row[4].replace(",", "")) for row in rows]
    assert speeds == sorted(speeds, reverse=True) and speeds[-1] > 0


def test_cli_plan_options_narrow_the_search(capsys: pytest.CaptureFixture[str]) -> None:
    """`--tensor-parallel=`, `--checkpointing=` and `--micro-batches=` leave one layout and two micro-batches to try:
    1 fits, 4 does not, so 1 (micro-batch 2, which fits, is not tried); values outside a list are refused before
    any simulation, and so are the options without `--plan`."""
    assert main(["llm", *PLAN_JOB, "--tensor-parallel=2", "--checkpointing=true", "--micro-batches=1,4"]) == 0
    rows, _ = _plan_rows(capsys)
    assert [row[:3] for row in rows] == [["2", "true", "1"]]
    with pytest.raises(SystemExit, match=r"--tensor-parallel=3: expected a comma-separated list of 1, 2\.$"):
        main(["llm", *PLAN_JOB, "--tensor-parallel=3"])
    with pytest.raises(SystemExit, match=r"--checkpointing=yes: expected a comma-separated list of false, true\.$"):
        main(["llm", *PLAN_JOB, "--checkpointing=yes"])
    with pytest.raises(SystemExit, match=r"^--micro-batches: options of --plan\.$"):
        main(["llm", *PLAN_JOB[:-1], "--micro-batches=2"])


#: one column of a collectives row: kind | count | bytes | across nodes
COLLECTIVE_ROW = re.compile(r"^\s*(\S+) \|\s+(\d+) \|\s+(.+?) \|\s+(.+)$")
TOTAL_LINE = re.compile(r"^bytes per rank and step: (.+) in all, (.+) in groups that span nodes, (.+) within a node$")


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


@pytest.mark.parametrize("replicas", [1, 2])
def test_cli_counts_the_bytes_that_cross_nodes(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, replicas: int
) -> None:
    """2 nodes of 2 ranks: FSDP2 over all 4 gathers and reduce-scatters across the nodes; HSDP (2 replicas, one per
    node, of 2-way FSDP2) keeps them within a node and only its all-reduce of the gradients over the replicas
    crosses. The table's column and the total line say so."""
    job = ["trainer.devices=2", "trainer.num_nodes=2", "trainer.strategy=model_parallel"]
    job.append("trainer.precision=bf16-mixed")
    small = ["data.vocab_size=4096", "data.seq_len=256", "data.batch_size=2", "model.hidden_size=64"]
    assert main(["llm", *job, *small, "model.num_layers=2", f"model.replicate_size={replicas}"]) == 0
    assert "resume is not exact" not in caplog.text  # a simulated step resumes nothing (its strategy is a copy)
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {m[1]: (int(m[2]), _bytes(m[3]), _bytes(m[4])) for m in map(COLLECTIVE_ROW.match, lines) if m}
    gathers = [row for kind, row in rows.items() if "allgather" in kind or "reduce_scatter" in kind]
    assert len(gathers) == 2 and all(count > 0 and size > 0 for count, size, _ in gathers)
    total, across, within = (_bytes(text) for text in next(filter(None, map(TOTAL_LINE.match, lines))).groups())
    if replicas == 1:
        assert all(across == size for _, size, across in gathers)
        assert across == total > 0 and within == 0
    else:
        assert all(across == 0 for _, _, across in gathers)
        count, size, crossing = rows["allreduce_"]  # the gradients' reduction over the replicas
        assert count > 0 and crossing == size > 0
        assert across == crossing and within >= sum(size for _, size, _ in gathers)


def test_cli_simulates_every_kind_of_stage_of_pipeline_x_tensor_parallel(tmp_path: Path) -> None:
    """4 stages x tensor parallel 2 x FSDP2 2 on 2 nodes of 8 ranks, the recipe's microbatches from its global batch
    (8 sequences over 2 data-parallel ranks: 4 each, one per microbatch): the first, a middle and the last stage are
    each simulated, the later ones on ranks with other local devices (4, 12) and on meshes alike but for their
    process groups, which the earlier simulations' caches must not hand them. In a process of its own: autograd
    serves only the devices present at its first backward, and this suite's processes start with 2."""
    job = ["trainer.devices=8", "trainer.num_nodes=2", "trainer.strategy=model_parallel", "data.global_batch_size=8"]
    small = ["data.vocab_size=512", "data.seq_len=64", "model.hidden_size=64", "model.num_layers=4"]
    layout = ["model.pipeline_parallel_size=4", "model.tensor_parallel_size=2"]
    command = [sys.executable, "-m", "lightning_trn.estimate", "llm", *job, *small, *layout]
    env = child_env(LIGHTNING_TRN_STANDIN="1", LIGHTNING_TRN_STANDIN_DEVICES="8")
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert any(line.startswith("pipeline: 1F1B, 4 pipeline ranks, 4 microbatches: bubble") for line in lines)
    stages = [line.split("|")[1].strip() for line in lines if re.match(r"^\s+\d+ \|\s+\d", line)]
    assert stages == ["0 (first)", "1 (middle)", "3 (last)"]


def test_cli_plan_tries_context_parallel_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """`--context-parallel=1,2`: each size a layout of its own, in a column of its own; splitting each 2,048-token
    sequence over 2 ranks halves what the rank holds of it (here mostly the 262,144-wide logits), so it needs less."""
    job = [*PLAN_JOB, "--tensor-parallel=1", "--checkpointing=true", "--micro-batches=1", "--context-parallel=1,2"]
    assert main(["llm", *job]) == 0
    rows, lines = _plan_rows(capsys)
    assert lines[0].split("|")[0].strip() == "context parallel"
    needed = {row[0]: float(row[4].split()[0]) for row in rows}
    assert sorted(needed) == ["1", "2"] and needed["2"] < needed["1"]
