"""`lightning_trn.estimate`'s verdict and advice, without a simulation: a job fits when
`peak * (1 + margin) + reserved <= capacity`, each platform's numbers and their sources are printed with what was not
simulated; the advice names what the caller can change; an environment that cannot simulate (the XLA stack's torch,
an untested torch) is refused with a paragraph before anything is patched."""

from __future__ import annotations

import importlib.util

import pytest

from lightning_trn.estimate import PLATFORMS, Collective, Estimate, EstimateError, RankMemory, estimate
from lightning_trn.estimate.__main__ import main
from lightning_trn.estimate.report import STAGE_RECV, STAGE_SEND, PipelineEstimate, bubble_fraction

pytestmark = pytest.mark.both

GIB = 2**30


def _result(peak: int, caller: str = "api", activations: bool = True) -> Estimate:
    state = 0 if activations else peak
    rank = RankMemory(
        0, parameters=state, gradients=0, optimizer_state=0, activations=peak - state, temporaries=0, peak=peak
    )
    return Estimate(64, "trn2", 24 * GIB, [rank], caller=caller)


def test_fits_keeps_the_margin_and_the_reserved_memory() -> None:
    budget = PLATFORMS["trn2"]
    assert budget.margin > 0 and budget.reserved >= 2 * 96 * 2**20  # AWS's micro-code of 2 physical cores
    largest = int((24 * GIB - budget.reserved) / (1 + budget.margin))
    assert _result(largest).fits
    assert not _result(largest + 2**20).fits  # below the capacity, above the budget
    assert largest + 2**20 < 24 * GIB
    text = _result(largest + 2**20).format()
    assert "margin 0.7 %: the H100 measurement" in text
    assert "96 MB of runtime micro-code per physical NeuronCore" in text and "conservative default" in text
    assert "not simulated: validation, checkpoint saving" in text
    assert "does not fit" in text.splitlines()[-3]
    assert text.splitlines()[-1].startswith("peak device memory per rank:")


def test_advice_fits_the_caller() -> None:
    """The Python API's advice names Trainer/strategy arguments, the recipe command's the recipe's keys."""
    api, recipe = _result(30 * GIB).advice(), _result(30 * GIB, caller="recipe").advice()
    assert "FSDPStrategy(activation_checkpointing_policy=" in api and "data.batch_size" not in api
    assert "model.activation_checkpointing=true" in recipe and "Strategy(" not in recipe
    state = _result(30 * GIB, activations=False).advice()
    assert "strategy='neuron_zero1'" in state and "model.tensor_parallel_size" not in state


def test_an_environment_that_cannot_simulate_is_refused_with_a_paragraph(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the XLA stack (torch 2.9 + torch_xla) there is no stand-in: a paragraph saying so, not "install
    torch_xla", from the Python API and the command line (exit 2); the native environment's torch made untested
    gives the same refusal."""
    from packaging.version import Version

    from lightning_trn.hooks import registry

    xla = importlib.util.find_spec("torch_xla") is not None
    if not xla:
        monkeypatch.setattr(registry, "TESTED_TORCH_SIMULATION", (Version("2.0"), Version("2.1")))
    with pytest.raises(EstimateError) as raised:
        estimate(lambda: None, {}, accelerator="neuron", devices=2)
    message = str(raised.value)
    assert "platform='trn1'" in message and "lightning-trn[standin]" in message
    assert ("no simulation is possible" in message) == xla
    assert "install torch_xla" not in message.lower()
    assert main(["llm", "preset=trn2-8b"]) == 2
    assert capsys.readouterr().err.strip() == message


@pytest.mark.parametrize(
    ("schedule", "ranks", "microbatches", "stages_per_rank", "bubble"),
    [
        ("GPipe", 4, 8, 1, 3 / 11),  # (p-1)/(m+p-1)
        ("1F1B", 4, 4, 1, 3 / 7),
        ("1F1B", 1, 4, 1, 0.0),
        ("Interleaved1F1B", 4, 8, 2, 3 / 19),  # (p-1)/(v*m+p-1)
        ("ZBVZeroBubble", 4, 8, 2, 0.0),
    ],
)
def test_bubble_fraction_of_each_schedule(
    schedule: str, ranks: int, microbatches: int, stages_per_rank: int, bubble: float
) -> None:
    assert bubble_fraction(schedule, ranks, microbatches, stages_per_rank) == pytest.approx(bubble)  # float64 quotients


def test_bubble_fraction_refuses_an_unknown_schedule() -> None:
    with pytest.raises(ValueError, match="expected one of GPipe, 1F1B"):
        bubble_fraction("DualPipeV", 4, 8)


def _staged(peaks: dict[int, int], activation: int, microbatches: int) -> Estimate:
    """A 4-stage 1F1B job with ranks 0 (first), 16 (middle) and 48 (last) simulated; each stage sends and receives
    `activation` bytes per microbatch per neighbour (the first and last stages have one neighbour, a middle two)."""
    stages = {0: [0], 16: [1], 48: [3]}
    neighbours = {0: 1, 16: 2, 48: 1}
    collectives = {
        rank: [
            Collective("allreduce_", 1, 4),
            Collective(STAGE_SEND, microbatches * neighbours[rank], activation * microbatches * neighbours[rank]),
            Collective(STAGE_RECV, microbatches * neighbours[rank], activation * microbatches * neighbours[rank]),
        ]
        for rank in stages
    }
    ranks = [RankMemory(rank, 0, 0, 0, peak, 0, peak) for rank, peak in peaks.items()]
    pipeline = PipelineEstimate("1F1B", 4, microbatches, 1, stages, collectives)
    return Estimate(64, "trn2", 24 * GIB, ranks, collectives[0], pipeline=pipeline)


def test_a_pipeline_report_has_a_row_per_stage_the_bubble_and_the_transfers() -> None:
    """Every stage must fit (the largest stage's peak decides); the report names each row's stages, the schedule's
    bubble with its formula, and each stage's point-to-point bytes: activation x microbatches x 2 directions per
    neighbour."""
    activation, microbatches = 3 * 2**20, 8
    result = _staged({0: 2 * GIB, 16: 3 * GIB, 48: 30 * GIB}, activation, microbatches)
    assert result.peak == 30 * GIB and not result.fits  # the last stage alone is over
    assert _staged({0: 2 * GIB, 16: 3 * GIB, 48: 4 * GIB}, activation, microbatches).fits
    assert result.pipeline is not None
    for rank, neighbours in ((0, 1), (16, 2), (48, 1)):
        sent, received = result.pipeline.point_to_point(rank)
        assert sent + received == activation * microbatches * 2 * neighbours
    lines = result.format().splitlines()
    # a stage's activations: more, smaller microbatches of the same batch, not a smaller batch
    assert "model.pipeline_microbatches" not in result.advice()
    assert "NeuronModelParallelStrategy(pipeline_microbatches=...)" in result.advice()
    result.caller = "recipe"
    assert "model.pipeline_microbatches" in result.advice() and "data.batch_size" not in result.advice()
    assert lines[0] == "world size 64, trn2: 24 GiB per rank"
    assert lines[1].startswith("pipeline: 1F1B, 4 pipeline ranks, 8 microbatches: bubble (p-1)/(m+p-1) = 27.3 % ")
    rows = [[cell.strip() for cell in line.split("|")] for line in lines if line.lstrip().startswith(("0 |", "16 |"))]
    assert [row[:2] for row in rows] == [["0", "0 (first)"], ["16", "1 (middle)"]]
    assert any(line.split("|")[1].strip() == "3 (last)" for line in lines if line.lstrip().startswith("48 |"))
    assert "point-to-point bytes per step, rank 16: 48.00 MiB sent, 48.00 MiB received" in "\n".join(lines)
    assert lines[-1] == "peak device memory per rank: 30.00 GiB of 24.00 GiB"


def test_a_pipeline_whose_temporaries_dominate_is_told_to_divide_its_stages_layers() -> None:
    """Under pipeline x FSDP2 a stage's gathered layers and float32 gradients stay from the first microbatch to the
    step's end: more microbatches do not lower them, more stages or tensor parallelism do."""
    result = _staged({0: 2 * GIB, 16: 3 * GIB, 48: 30 * GIB}, 2**20, 4)
    result.ranks = [RankMemory(48, GIB, 0, 2 * GIB, 3 * GIB, 24 * GIB, 30 * GIB)]
    result.caller = "recipe"
    assert "temporaries dominate" in result.advice() and "model.pipeline_parallel_size" in result.advice()
    assert "model.pipeline_microbatches" not in result.advice()
    result.ranks = [RankMemory(48, GIB, 0, 2 * GIB, 24 * GIB, 3 * GIB, 30 * GIB)]
    assert "activations dominate" in result.advice() and "model.pipeline_microbatches" in result.advice()


def test_a_report_without_stages_keeps_its_format() -> None:
    """No `stages` column, no bubble line, one collectives table for the job."""
    lines = _result(2 * GIB).format().splitlines()
    assert lines[0] == "world size 64, trn2: 24 GiB per rank" and lines[1] == ""
    assert lines[2].split("|")[1].strip() == "parameters"
    assert lines[5] == "collectives of one training step (per rank)"
    assert not any(line.startswith(("pipeline:", "point-to-point")) for line in lines)
