"""The strategies' shape, as docs/architecture.md describes it: at most 4 of our classes in any strategy's MRO, every
override marked `@override`, and the setup step lists of the document equal to those the classes run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from lightning_trn.fabric import strategies as fabric_strategies
from lightning_trn.pytorch import strategies as trainer_strategies

pytestmark = pytest.mark.both

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
#: the most of our classes a strategy's MRO may hold: its own, its API's base, the shared core and one more
MAX_OWN_CLASSES = 4


def _strategies(package: Any) -> list[type]:
    classes = [getattr(package, name) for name in package.__all__]
    return [cls for cls in classes if getattr(cls, "strategy_name", None) is not None]


TRAINER = _strategies(trainer_strategies)
FABRIC = _strategies(fabric_strategies)
ALL = [*TRAINER, *FABRIC]


def _own(cls: type) -> bool:
    return cls.__module__.startswith("lightning_trn.")


def test_every_exported_strategy_is_checked() -> None:
    assert {cls.__name__ for cls in TRAINER} == {cls.__name__ for cls in FABRIC} == {
        "SingleDeviceNeuronStrategy", "NeuronDDPStrategy", "NeuronModelParallelStrategy", "NeuronFSDPStrategy"}


@pytest.mark.parametrize("strategy", ALL, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_at_most_four_of_our_classes_in_a_strategy_mro(strategy: type) -> None:
    own = [cls.__name__ for cls in strategy.__mro__ if _own(cls)]
    assert len(own) <= MAX_OWN_CLASSES, own


def _unmarked_overrides(strategy: type) -> list[str]:
    """`Class.method` for each method one of our classes in `strategy`'s MRO defines that a class after it (ours or
    Lightning's) also defines, without `@override` (typing_extensions sets `__override__`)."""
    mro = strategy.__mro__
    unmarked = []
    for index, cls in enumerate(mro):
        if not _own(cls):
            continue
        for name, attribute in vars(cls).items():
            if name.startswith("__") or not any(name in vars(base) for base in mro[index + 1:] if base is not object):
                continue
            function = attribute.fget if isinstance(attribute, property) else getattr(attribute, "__func__", attribute)
            if callable(function) and not getattr(function, "__override__", False):
                unmarked.append(f"{cls.__qualname__}.{name}")
    return unmarked


@pytest.mark.parametrize("strategy", ALL, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_override_is_marked(strategy: type) -> None:
    assert _unmarked_overrides(strategy) == []


def test_an_unmarked_override_is_found() -> None:
    class Base:
        def step(self) -> None: ...

    class Unmarked(Base):
        __module__ = "lightning_trn.example"

        def step(self) -> None: ...

    assert _unmarked_overrides(Unmarked) == [f"{Unmarked.__qualname__}.step"]


def _bullets(section: str) -> dict[str, str]:
    """`- \\`Name\\` [\\`attribute\\`]: text` bullets of a section (continuation lines joined), by 'Name attribute'."""
    bullets: dict[str, str] = {}
    for match in re.finditer(r"^- `(\w+)`(?: `(\w+)`)?[^:]*:\s+(.*?)(?=^- |^\s*$)", section, re.M | re.S):
        name, attribute, text = match.groups()
        bullets[f"{name} {attribute or ''}".strip()] = " ".join(text.split())
    return bullets


def _doc_sections() -> tuple[dict[str, str], dict[str, str]]:
    text = DOC.read_text()
    strategies = text[text.index("## Strategies"):text.index("## The contract")]
    trainer = strategies[strategies.index("Trainer (`lightning_trn.pytorch.strategies`)"):strategies.index("Fabric (")]
    fabric = strategies[strategies.index("Fabric (`lightning_trn.fabric.strategies`)"):]
    return _bullets(trainer + "\n"), _bullets(fabric + "\n")


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(","))


@pytest.mark.parametrize("strategy", TRAINER, ids=lambda cls: cls.__name__)
def test_trainer_setup_steps_are_the_documented_ones(strategy: type) -> None:
    documented, _ = _doc_sections()
    assert _names(documented[strategy.__name__]) == strategy.setup_steps
    for attribute in ("configure_model_steps",):
        if hasattr(strategy, attribute):
            assert _names(documented[f"{strategy.__name__} {attribute}"]) == getattr(strategy, attribute)


@pytest.mark.parametrize("strategy", FABRIC, ids=lambda cls: cls.__name__)
def test_fabric_setup_steps_are_the_documented_ones(strategy: type) -> None:
    _, documented = _doc_sections()
    parts = dict(part.strip().split(": ", 1) for part in documented[strategy.__name__].split(";"))
    assert _names(parts["module"]) == strategy.setup_module_steps
    assert _names(parts["optimizer"]) == strategy.setup_optimizer_steps


@pytest.mark.parametrize("strategy", ALL, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_step_is_a_method(strategy: type) -> None:
    steps = [*getattr(strategy, "setup_steps", ()), *getattr(strategy, "configure_model_steps", ()),
             *getattr(strategy, "setup_module_steps", ()), *getattr(strategy, "setup_optimizer_steps", ())]
    assert steps
    assert [step for step in steps if not callable(getattr(strategy, f"_{step}", None))] == []
