"""The package's shape, as docs/architecture.md describes it: every module in the document's file tree, every
override in the package marked `@override`, at most 4 of our classes in any strategy's MRO, and the setup step lists
of the document equal to those the classes run."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from typing_extensions import override

import lightning_trn
from lightning_trn.fabric import strategies as fabric_strategies
from lightning_trn.pytorch import strategies as trainer_strategies

pytestmark = pytest.mark.both

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
PACKAGE = Path(lightning_trn.__file__).parent
#: the file tree's description column: a line whose name field (the columns before it) is blank continues the entry
#: above it
DESCRIPTION_COLUMN = 26
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
    assert (
        {cls.__name__ for cls in TRAINER}
        == {cls.__name__ for cls in FABRIC}
        == {"SingleDeviceNeuronStrategy", "NeuronDDPStrategy", "NeuronModelParallelStrategy", "NeuronFSDPStrategy"}
    )


@pytest.mark.parametrize("strategy", ALL, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_at_most_four_of_our_classes_in_a_strategy_mro(strategy: type) -> None:
    own = [cls.__name__ for cls in strategy.__mro__ if _own(cls)]
    assert len(own) <= MAX_OWN_CLASSES, own


def _module_files() -> dict[str, Path]:
    """Every module of the package by dotted name, from its files (a package is its `__init__.py`)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _tree_paths() -> set[str]:
    """The paths the file tree of docs/architecture.md names, relative to lightning_trn/ (a folder's ends in `/`;
    the tree's root, `lightning_trn/` itself, is "")."""
    text = DOC.read_text()
    start = text.index("```\nlightning_trn/") + len("```\n")
    folders: list[str] = []  # the folders open above the current line, one per level of indentation
    paths = {""}
    for line in text[start : text.index("```", start)].splitlines()[1:]:
        if not line[:DESCRIPTION_COLUMN].strip():
            continue
        name = line.split()[0]
        level = (len(line) - len(line.lstrip())) // 2 - 1
        del folders[level:]
        paths.add("".join(folders) + name)
        if name.endswith("/"):
            folders.append(name)
    return paths


def _tree_path(path: Path) -> str:
    """How the file tree names a module: its file relative to lightning_trn/, a package by its folder."""
    relative = path.relative_to(PACKAGE)
    if path.name != "__init__.py":
        return str(relative)
    return "" if relative.parent == Path() else f"{relative.parent}/"


def test_every_module_is_in_the_file_tree() -> None:
    documented = _tree_paths()
    missing = sorted(_tree_path(path) for path in _module_files().values() if _tree_path(path) not in documented)
    assert not missing, f"docs/architecture.md's file tree has no line for {missing}: add one saying what each is for"
    stale = sorted(path for path in documented if not (PACKAGE / path).exists())
    assert not stale, f"docs/architecture.md's file tree names {stale}, which lightning_trn/ does not have"


def _needs_absent_stack(error: Exception) -> bool:
    """Whether importing a module failed only because an optional stack is not in this suite: a package that is not
    installed (torch_xla in the native suite), or the stand-in, which loads only on the native stack's torch and says
    so with its `StandinError` (a class the XLA suite cannot import: the stand-in's package refuses to load)."""
    if isinstance(error, ModuleNotFoundError):
        return error.name is not None and error.name.split(".")[0] != "lightning_trn"
    return any(
        f"{cls.__module__}.{cls.__qualname__}" == "lightning_trn.standin._build.StandinError"
        for cls in type(error).__mro__
    )


def test_only_an_absent_stack_excuses_an_import_error() -> None:
    assert _needs_absent_stack(ModuleNotFoundError("No module named 'torch_xla'", name="torch_xla"))
    assert not _needs_absent_stack(ModuleNotFoundError("No module named 'lightning_trn.x'", name="lightning_trn.x"))
    assert not _needs_absent_stack(ImportError("cannot import name 'NeuronStrategyCore'", name="lightning_trn.core"))
    assert not _needs_absent_stack(RuntimeError("a module failing at import"))


def _importable_modules() -> list[ModuleType]:
    """Every module of the package this suite can import; the modules of a package it cannot are left out too
    (importing one runs the package first)."""
    modules, absent = [], []
    for name in _module_files():
        if any(name.startswith(f"{package}.") for package in absent):
            continue
        try:
            modules.append(importlib.import_module(name))
        except Exception as error:
            if not _needs_absent_stack(error):
                raise
            absent.append(name)
    return modules


def _classes(namespace: ModuleType | type, module: str, seen: set[type]) -> Iterator[type]:
    """The classes defined in `module`, at its top level or nested in one of them."""
    for value in list(vars(namespace).values()):
        if isinstance(value, type) and value.__module__ == module and value not in seen:
            seen.add(value)
            yield value
            yield from _classes(value, module, seen)


def _unmarked_overrides(cls: type) -> list[str]:
    """`module.Class.method` for each method `cls` itself defines that a base (ours, Lightning's, torch's...; not
    `object`) also defines, without `@override` (typing_extensions sets `__override__` on the function, and
    `functools.wraps` carries it to a wrapper). Dunder methods are exempt."""
    unmarked = []
    for name, attribute in vars(cls).items():
        if name.startswith("__") and name.endswith("__"):
            continue
        if not any(name in vars(base) for base in cls.__mro__[1:] if base is not object):
            continue
        if isinstance(attribute, property):
            function = attribute.fget
        elif isinstance(attribute, functools.cached_property):
            function = attribute.func
        else:
            function = getattr(attribute, "__func__", attribute)  # staticmethod, classmethod
        if inspect.isfunction(function) and not getattr(function, "__override__", False):
            unmarked.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return unmarked


def test_every_override_in_the_package_is_marked() -> None:
    unmarked = [
        method
        for module in _importable_modules()
        for cls in _classes(module, module.__name__, set())
        for method in _unmarked_overrides(cls)
    ]
    assert not unmarked, (
        "these methods override a base's without `@override` (from typing_extensions; right above the def, under "
        "@property, @staticmethod or @classmethod):\n" + "\n".join(unmarked)
    )


def test_an_unmarked_override_is_found() -> None:
    class Base:
        def step(self) -> None: ...

        def marked(self) -> None: ...

        @property
        def value(self) -> int:
            return 0

        @classmethod
        def build(cls) -> None: ...

        def __repr__(self) -> str:
            return "base"

    class Child(Base):
        def step(self) -> None: ...

        @override
        def marked(self) -> None: ...

        @property
        def value(self) -> int:
            return 1

        @classmethod
        def build(cls) -> None: ...

        @override
        def __repr__(self) -> str:
            return "child"

        def own(self) -> None: ...

    assert _unmarked_overrides(Child) == [
        f"{__name__}.{Child.__qualname__}.{name}" for name in ("step", "value", "build")
    ]


def _bullets(section: str) -> dict[str, str]:
    """`- \\`Name\\` [\\`attribute\\`]: text` bullets of a section (continuation lines joined), by 'Name attribute'."""
    bullets: dict[str, str] = {}
    for match in re.finditer(r"^- `(\w+)`(?: `(\w+)`)?[^:]*:\s+(.*?)(?=^- |^\s*$)", section, re.M | re.S):
        name, attribute, text = match.groups()
        bullets[f"{name} {attribute or ''}".strip()] = " ".join(text.split())
    return bullets


def _doc_sections() -> tuple[dict[str, str], dict[str, str]]:
    text = DOC.read_text()
    strategies = text[text.index("## Strategies") : text.index("## The contract")]
    trainer = strategies[
        strategies.index("Trainer (`lightning_trn.pytorch.strategies`)") : strategies.index("Fabric (")
    ]
    fabric = strategies[strategies.index("Fabric (`lightning_trn.fabric.strategies`)") :]
    return _bullets(trainer + "\n"), _bullets(fabric + "\n")


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(","))


def _step_names(steps: tuple) -> tuple[str, ...]:
    """The documented names of steps listed by reference (`_materialize` is documented as `materialize`)."""
    return tuple(step.__name__.removeprefix("_") for step in steps)


@pytest.mark.parametrize("strategy", TRAINER, ids=lambda cls: cls.__name__)
def test_trainer_setup_steps_are_the_documented_ones(strategy: type) -> None:
    documented, _ = _doc_sections()
    assert _names(documented[strategy.__name__]) == _step_names(strategy.setup_steps)
    for attribute in ("configure_model_steps",):
        if hasattr(strategy, attribute):
            assert _names(documented[f"{strategy.__name__} {attribute}"]) == _step_names(getattr(strategy, attribute))


@pytest.mark.parametrize("strategy", FABRIC, ids=lambda cls: cls.__name__)
def test_fabric_setup_steps_are_the_documented_ones(strategy: type) -> None:
    _, documented = _doc_sections()
    parts = dict(part.strip().split(": ", 1) for part in documented[strategy.__name__].split(";"))
    assert _names(parts["module"]) == _step_names(strategy.setup_module_steps)
    assert _names(parts["optimizer"]) == _step_names(strategy.setup_optimizer_steps)


@pytest.mark.parametrize("strategy", ALL, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_step_is_a_method(strategy: type) -> None:
    steps = [
        *getattr(strategy, "setup_steps", ()),
        *getattr(strategy, "configure_model_steps", ()),
        *getattr(strategy, "setup_module_steps", ()),
        *getattr(strategy, "setup_optimizer_steps", ()),
    ]
    assert steps
    # each step is a function of a class of the strategy (an editor follows the reference), run by its name
    assert [step for step in steps if getattr(strategy, step.__name__, None) is None] == []
    defined = [function for cls in strategy.__mro__ for function in vars(cls).values() if callable(function)]
    assert [step.__name__ for step in steps if not any(step is function for function in defined)] == []


def _lifecycle_rows() -> list[list[str]]:
    text = DOC.read_text()
    section = text[text.index("## The lifecycle of a run") : text.index("## Strategies")]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip().strip("`") for cell in row] for row in rows if row[0].strip() != "phase"]


def test_every_phase_of_the_lifecycle_table_names_a_method_that_exists() -> None:
    """docs/architecture.md's lifecycle tables: each phase's method of ours is where the table says it is."""
    rows = _lifecycle_rows()
    assert len(rows) >= 20  # the Trainer's and Fabric's tables
    missing = []
    for phase, _caller, method, file in rows:
        module = importlib.import_module("lightning_trn." + file.removesuffix(".py").replace("/", "."))
        owner: object = module
        for part in method.split("."):
            owner = getattr(owner, part, None)
        if owner is None:
            missing.append(f"{phase}: {method} in {file}")
    assert missing == []
