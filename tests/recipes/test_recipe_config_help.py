"""Every recipe's config documents itself: each field of its schema, sections included, carries a help text
(`lightning_trn.recipes.common.doc`), and `--help` prints it under the field's key."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import pytest

from lightning_trn.recipes import cli
from lightning_trn.recipes.common import Recipe

pytestmark = pytest.mark.both

#: every recipe, as its config file names it
NAMES = sorted(path.stem for path in (Path(cli.__file__).parent / "configs").glob("*.yaml"))


def _recipe(name: str) -> Recipe:
    return importlib.import_module(f"lightning_trn.recipes.{name}").RECIPE


def _schema_fields(schema: Any, prefix: str = "") -> Iterator[tuple[str, bool, dataclasses.Field]]:
    """(dotted key, is a section, field) of every field of `schema`, walked with `dataclasses` alone. A section is a
    nested dataclass or an open dict (`trainer`): `--help` heads its keys with `key.*`."""
    hints = get_type_hints(schema)
    for field in dataclasses.fields(schema):
        nested = dataclasses.is_dataclass(hints[field.name])
        yield prefix + field.name, nested or get_origin(hints[field.name]) is dict, field
        if nested:
            yield from _schema_fields(hints[field.name], f"{prefix}{field.name}.")


def test_every_recipe_is_covered():
    assert {"bert", "llm", "mlp", "vit"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_schema_field_has_a_help_text(name: str):
    fields = _schema_fields(_recipe(name).schema)
    lacking = [key for key, _, field in fields if not field.metadata.get("help", "").strip()]
    assert lacking == [], f"{name}: schema fields without a help text (common.doc): {lacking}"


@pytest.mark.parametrize("name", NAMES)
def test_help_prints_every_fields_help_text_under_its_key(name: str, capsys: pytest.CaptureFixture[str]):
    cli.main(_recipe(name), ["--help"])
    lines = capsys.readouterr().out.splitlines()
    for key, section, field in _schema_fields(_recipe(name).schema):
        heading = f"  {key}.*" if section else f"  {key}="
        found = [i for i, line in enumerate(lines) if (line == heading if section else line.startswith(heading))]
        assert len(found) == 1, f"{name}: `--help` shows {key} {len(found)} times"
        below = []
        for line in lines[found[0] + 1 :]:
            if not line.startswith(" " * 6):
                break
            below.append(line.strip())
        assert " ".join(below) == " ".join(field.metadata.get("help", "").split()), f"{name}: help of {key}"
