"""Command line shared by the recipes:
`python -m lightning_trn.recipes.<name> [fit|export] [key=value ...] [--help]`.

`fit` (the default) loads the recipe's config, applies `key=value` overrides (omegaconf dot-list syntax,
e.g. `trainer.max_epochs=2 data.batch_size=64`), prints the resolved config and trains. `export ckpt=PATH out=DIR`
converts a checkpoint for GPU/CPU users.

The config is an omegaconf structured config: `configs/<name>.yaml`, which holds every default, merged into the
recipe's schema (`Recipe.schema`: nested dataclasses with each key's type, value check and help text, and no
defaults, so that the YAML stays their one source). Overrides are typed merges: omegaconf rejects unknown keys and
values it cannot convert, and this module reports them, and values out of range, in one line naming key, value and
expectation.
`trainer` is open (`dict[str, Any]`): its keys go to `lightning.pytorch.Trainer` as they are.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import Field, fields, is_dataclass
from typing import Any, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from lightning_trn.recipes import common
from lightning_trn.recipes.common import Recipe

#: how the schemas' types read in messages and `--help`
_EXPECTED: dict[Any, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    str | None: "a string or null",
    list[int]: "a list like [1, 2]",
    list[str]: "a list like [a, b]",
}


def _flatten(container: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(container, dict):
        return {prefix: container}
    flat: dict[str, Any] = {}
    for key, value in container.items():
        flat.update(_flatten(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}"))
    return flat


def _fields(schema: type, prefix: str = "") -> Iterator[tuple[str, Any, Field[Any]]]:
    """(dotted key, type, field) of each field of the dataclass `schema`: a section (a dataclass) and then its keys."""
    hints = get_type_hints(schema)
    for field in fields(schema):
        yield f"{prefix}{field.name}", hints[field.name], field
        if is_dataclass(hints[field.name]):
            yield from _fields(hints[field.name], f"{prefix}{field.name}.")


def _leaves(schema: type) -> dict[str, tuple[Any, Field[Any]]]:
    """Dotted key -> (type, field) of each key of the dataclass `schema`, not its sections (`trainer` is one key)."""
    return {key: (hint, field) for key, hint, field in _fields(schema) if not is_dataclass(hint)}


def _defaults(recipe: Recipe) -> DictConfig:
    """The recipe's YAML merged into its schema: every key typed and set."""
    mismatch = f"{recipe.config_path.name} does not match {recipe.schema.__module__}.{recipe.schema.__name__}"
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(recipe.schema), OmegaConf.load(recipe.config_path))
    except OmegaConfBaseException as err:
        raise TypeError(f"{mismatch}: {str(err).splitlines()[0]}") from None
    if OmegaConf.missing_keys(cfg):
        raise TypeError(f"{mismatch}: no default for {', '.join(sorted(OmegaConf.missing_keys(cfg)))}")
    return cfg  # type: ignore[return-value]  # merge() is typed as a ListConfig | DictConfig; a schema is a dict


def _preset_names(recipe: Recipe) -> str:
    return ", ".join(["none", *recipe.presets])


def _with_preset(recipe: Recipe, overrides: Sequence[str]) -> list[str]:
    """`preset=NAME` (the last one) becomes that preset's overrides, placed first so the others win; `preset=NAME`
    itself stays, recording the choice in the config. Only for recipes with `presets`; `none` adds nothing."""
    chosen = [arg.split("=", 1)[1] for arg in overrides if arg.startswith("preset=")]
    if not recipe.presets or not chosen:
        return list(overrides)
    name = chosen[-1]
    if name != "none" and name not in recipe.presets:
        raise ValueError(f"recipes.{recipe.name}: Config key preset={name!r}: expected one of {_preset_names(recipe)}.")
    rest = [arg for arg in overrides if not arg.startswith("preset=")]
    return [*recipe.presets.get(name, ()), f"preset={name}", *rest]


def load_config(recipe: Recipe, overrides: Sequence[str] = ()) -> DictConfig:
    """The recipe's typed config: the YAML defaults, then the overrides of `preset=NAME` if given, then `overrides`.

    Raises:
        KeyError: an unknown key.
        ValueError: a value of the wrong type or out of range, or an unknown preset, naming key, value and expectation.
    """
    defaults = _defaults(recipe)
    leaves = _leaves(recipe.schema)
    given = _flatten(OmegaConf.to_container(OmegaConf.from_dotlist(_with_preset(recipe, overrides))))

    def problem(key: str, value: Any, expected: str) -> ValueError:
        default = OmegaConf.select(defaults, key)
        default = OmegaConf.to_container(default) if OmegaConf.is_config(default) else default
        return ValueError(
            f"recipes.{recipe.name}: Config key {key}={value!r}: expected {expected} (default {default!r})."
        )

    cfg = defaults.copy()
    for key, value in given.items():
        try:
            OmegaConf.update(cfg, key, value, merge=True)
        except (ConfigAttributeError, ConfigKeyError):
            known = ", ".join(_flatten(OmegaConf.to_container(defaults)))
            raise KeyError(f"Unknown config key {key!r} for recipe {recipe.name!r}; known keys: {known}") from None
        except (OmegaConfBaseException, ValueError) as err:  # omegaconf's ValidationError: several lines
            hint = leaves.get(key, (None,))[0]
            if hint in _EXPECTED:
                raise problem(key, value, _EXPECTED[hint]) from None
            raise ValueError(f"recipes.{recipe.name}: Config key {key}={value!r}: {str(err).splitlines()[0]}") from None
    for key, (hint, field) in leaves.items():  # what omegaconf does not check: finite numbers, ranges
        value, check = OmegaConf.select(cfg, key), field.metadata.get("check")
        if hint is float and not math.isfinite(value):
            raise problem(key, given.get(key, value), _EXPECTED[float])
        if check is not None and not check[0](value):
            raise problem(key, given.get(key, value), f"a value {check[1]}")
    if recipe.resolve is not None:
        recipe.resolve(cfg, set(given))
    return cfg


def _help_lines(field: Field[Any]) -> list[str]:
    """The field's help text (`common.doc`), wrapped and indented under its key's line."""
    return textwrap.wrap(field.metadata.get("help", ""), width=118, initial_indent=" " * 6, subsequent_indent=" " * 6)


def usage(recipe: Recipe) -> str:
    """The `--help` text: commands and every config key with its default, what it takes and its help text; each
    section (`data.*`, and the open `trainer.*`) is introduced by its own help text."""
    schema = {key: (hint, field) for key, hint, field in _fields(recipe.schema)}
    lines = [
        f"usage: python -m lightning_trn.recipes.{recipe.name} [fit] [key=value ...]",
        f"       python -m lightning_trn.recipes.{recipe.name} export ckpt=PATH out=DIR",
        f"       (in a checkout also python -m recipes.{recipe.name} ...)",
        "",
        f"Config keys (defaults from {recipe.config_path.name}; types, checks and help from"
        f" {recipe.schema.__name__}; any other trainer.* key goes to Trainer):",
    ]
    introduced: set[str] = set()
    for key, value in _flatten(OmegaConf.to_container(_defaults(recipe))).items():
        parts = key.split(".")
        for section in (".".join(parts[:end]) for end in range(1, len(parts))):
            if section in schema and section not in introduced:
                introduced.add(section)
                lines += [f"  {section}.*", *_help_lines(schema[section][1])]
        hint, field = schema.get(key, (None, None))
        check = field.metadata.get("check") if field is not None else None
        takes = _EXPECTED.get(hint, "") + (f", {check[1]}" if check is not None else "")
        if key == "preset" and recipe.presets:
            takes = f"one of {_preset_names(recipe)} (its overrides come before the others)"
        shown = json.dumps(value) if value is None or isinstance(value, bool) else str(value)  # null, true
        lines.append(f"  {key}={shown:<{38 - len(key)}} {takes}".rstrip())
        lines += _help_lines(field) if field is not None else []
    return "\n".join(lines)


def _export_args(args: Sequence[str]) -> dict[str, str]:
    parsed = dict(arg.split("=", 1) for arg in args if "=" in arg)
    if set(parsed) != {"ckpt", "out"} or len(args) != 2:
        raise SystemExit("export needs exactly: ckpt=PATH out=DIR")
    return parsed


def main(recipe: Recipe, argv: Sequence[str] | None = None) -> Any:
    """Entry point of `python -m lightning_trn.recipes.<name>` (and the checkout's `python -m recipes.<name>`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help", "help") for arg in args):
        print(usage(recipe))
        return None
    command = args.pop(0) if args and args[0] in ("fit", "export") else "fit"
    if command == "export":
        parsed = _export_args(args)
        return common.export(recipe, parsed["ckpt"], parsed["out"])
    try:
        cfg = load_config(recipe, args)
    except (KeyError, ValueError) as err:
        raise SystemExit(err.args[0]) from None
    print(OmegaConf.to_yaml(cfg, resolve=True))
    return common.fit(recipe, cfg)
