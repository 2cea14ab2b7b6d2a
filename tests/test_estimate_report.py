"""`lightning_trn.estimate`'s verdict and advice, without a simulation: a job fits when
`peak * (1 + margin) + reserved <= capacity`, each platform's numbers and their sources are printed with what was not
simulated; the advice names what the caller can change; an environment that cannot simulate (the XLA stack's torch,
an untested torch) is refused with a paragraph before anything is patched."""

from __future__ import annotations

import importlib.util

import pytest

from lightning_trn.estimate import PLATFORMS, Estimate, EstimateError, RankMemory, estimate
from lightning_trn.estimate.__main__ import main

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
