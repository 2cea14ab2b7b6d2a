"""Command line shared by the recipes:
`python -m lightning_trn.recipes.<name> [fit|export] [key=value ...] [--help]`.

`fit` (the default) loads `configs/<name>.yaml` beside this file, applies `key=value` overrides (omegaconf dot-list syntax,
e.g. `trainer.max_epochs=2 data.batch_size=64`), prints the resolved config and trains. `export ckpt=PATH out=DIR`
converts a checkpoint for GPU/CPU users. Unknown keys are rejected, except under `trainer.` which are passed to
`lightning.pytorch.Trainer` as they are.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_trn.recipes import common, schema
from lightning_trn.recipes.common import Recipe

def _flatten(container: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(container, dict):
        return {prefix: container}
    flat: dict[str, Any] = {}
    for key, value in container.items():
        flat.update(_flatten(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}"))
    return flat


def load_config(recipe: Recipe, overrides: Sequence[str] = ()) -> DictConfig:
    """The recipe's YAML defaults merged with `key=value` overrides.

    Raises:
        KeyError: an unknown key.
        ValueError: a value of the wrong type or out of range (`recipes.schema`), naming key, value and expectation.
    """
    base = OmegaConf.load(recipe.config_path)
    known = _flatten(OmegaConf.to_container(base))
    update = OmegaConf.from_dotlist(list(overrides))
    for key in _flatten(OmegaConf.to_container(update)):
        if key not in known and not key.startswith(schema.OPEN_SECTIONS):
            raise KeyError(f"Unknown config key {key!r} for recipe {recipe.name!r}; known keys: {', '.join(known)}")
    merged = OmegaConf.merge(base, update)
    problem = schema.check(_flatten(OmegaConf.to_container(merged)), known)
    if problem is not None:
        raise ValueError(f"recipes.{recipe.name}: {problem}")
    return merged  # type: ignore[return-value]


def usage(recipe: Recipe) -> str:
    """The `--help` text: commands and every config key with its default."""
    keys = _flatten(OmegaConf.to_container(OmegaConf.load(recipe.config_path)))
    lines = [
        f"usage: python -m lightning_trn.recipes.{recipe.name} [fit] [key=value ...]",
        f"       python -m lightning_trn.recipes.{recipe.name} export ckpt=PATH out=DIR",
        f"       (in a checkout also python -m recipes.{recipe.name} ...)",
        "",
        f"Config keys (defaults from {recipe.config_path.name}; any other trainer.* key goes to Trainer):",
    ]
    lines += [f"  {key}={'null' if value is None else value}" for key, value in keys.items()]
    return "\n".join(lines)


def _export_args(args: Sequence[str]) -> dict[str, str]:
    parsed = dict(arg.split("=", 1) for arg in args if "=" in arg)
    if set(parsed) != {"ckpt", "out"} or len(args) != 2:
        raise SystemExit("export needs exactly: ckpt=PATH out=DIR")
    return parsed


def main(recipe: Recipe, argv: Optional[Sequence[str]] = None) -> Any:
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
