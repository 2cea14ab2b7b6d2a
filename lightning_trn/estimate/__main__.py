"""`python -m lightning_trn.estimate <recipe> [key=value ...] [--platform=trn1|trn2|trn3] [--plan [options]]`: will
this recipe's job fit? Loads the recipe's config as `python -m lightning_trn.recipes.<recipe>` does (the same `preset=`
and overrides), simulates one training step of rank 0 at the job's world size (`lightning_trn.estimate.estimate`),
prints the memory and collectives tables, and exits 0 if the peak fits a core, 1 if not.

It runs the same with or without `LIGHTNING_TRN_STANDIN`: without Trainium on the CPU stand-in (loaded here when
no Neuron stack is installed), with as many devices as the job's node has; nothing is allocated. The first line
says which stack and platform are simulated. Exit 2 with a paragraph when the job cannot be simulated (the XLA
stack's torch, Lightning refusing the configuration, a module the simulation cannot run).

`--plan` (the `llm` recipe under `trainer.strategy=model_parallel`): every tensor-parallel size that divides the
node's devices and the model's heads, with and without activation checkpointing, at micro-batches 1, 2, 4, ...
(`data.batch_size`): a table of the largest micro-batch that fits per layout; exit 0 if any fits. Each try is a
whole simulation (minutes at a preset's size), so three options narrow the search, each a comma-separated list:
`--tensor-parallel=4,8` (of those sizes), `--checkpointing=false` and `--micro-batches=2,4` (tried smallest first,
as the default 1, 2, 4, ... 64; the table's largest is then the largest of these that fits); and
`--context-parallel=4,8,16` tries those context-parallel sizes (each sequence split over them; default: the job's
`model.context_parallel_size`), where the world and `data.seq_len` divide by them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any, cast

#: `--plan`'s options that narrow its search, each a comma-separated list
PLAN_OPTIONS = ("--tensor-parallel=", "--checkpointing=", "--micro-batches=", "--context-parallel=")
#: the largest micro-batch `--micro-batches=` accepts
MAX_MICRO_BATCH = 1024


def recipe_batch(recipe: Any, cfg: Any) -> Any:
    """One training micro-batch of the recipe, as meta tensors where its shape follows from the config (the LLM
    recipe: token ids and labels, `data.batch_size` x `data.seq_len`), else the first batch of its data module."""
    import torch

    if recipe.name == "llm":
        ids = torch.empty(cfg.data.batch_size, cfg.data.seq_len, dtype=torch.long, device="meta")
        if cfg.data.get("packing", False):  # packed documents: the mask is built per sequence from these
            return {"input_ids": ids, "labels": ids, "position_ids": ids}
        return {"input_ids": ids, "labels": ids}
    data = recipe.build_data(cfg)
    data.prepare_data()
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    platform = next((arg.split("=", 1)[1] for arg in args if arg.startswith("--platform=")), None)
    planning = "--plan" in args
    options = {arg.split("=", 1)[0]: arg.split("=", 1)[1] for arg in args[1:] if arg.startswith(PLAN_OPTIONS)}
    if options and not planning:
        raise SystemExit(f"{', '.join(options)}: options of --plan.")
    name = args[0]
    overrides = [arg for arg in args[1:] if not arg.startswith(("--platform=", *PLAN_OPTIONS)) and arg != "--plan"]

    import lightning.pytorch as pl
    from omegaconf import OmegaConf

    from lightning_trn.estimate import CAPACITY_GIB, RECIPE, EstimateError, estimate, native_device
    from lightning_trn.recipes.cli import load_config

    try:
        native_device()  # before the recipe builds anything: the stand-in where no Neuron stack is installed
    except EstimateError as err:
        print(err, file=sys.stderr)
        return 2

    recipe = importlib.import_module(f"lightning_trn.recipes.{name}").RECIPE
    try:
        cfg = load_config(recipe, overrides)
    except (KeyError, ValueError) as err:
        raise SystemExit(err.args[0]) from None
    trainer_args = cast(dict[str, Any], OmegaConf.to_container(cfg.trainer, resolve=True))  # a mapping section
    if recipe.trainer_args is not None:
        trainer_args.update(recipe.trainer_args(cfg))
    preset = str(cfg.get("preset", "none"))
    if platform is None and preset.split("-")[0] in CAPACITY_GIB:  # trn1-1b: a Trn1 job
        platform = preset.split("-")[0]
    if platform is not None and platform not in CAPACITY_GIB:
        raise SystemExit(f"--platform={platform}: expected one of {', '.join(CAPACITY_GIB)}.")

    def module_factory() -> pl.LightningModule:
        pl.seed_everything(cfg.seed, verbose=False)
        return recipe.build_model(cfg)

    if planning:
        return _plan(recipe, overrides, cfg, platform, options)
    try:
        result = estimate(module_factory, recipe_batch(recipe, cfg), platform=platform, caller=RECIPE, **trainer_args)
    except EstimateError as err:
        print(err, file=sys.stderr)
        return 2
    print(result.format())
    return 0 if result.fits else 1


def _option(options: dict[str, str], name: str, default: Sequence[Any], allowed: Sequence[Any]) -> list[Any]:
    """One of `PLAN_OPTIONS` as a list of values from `allowed` (`default` when it is not given)."""
    if name not in options:
        return list(default)
    by_text = {str(value).lower(): value for value in allowed}
    values = options[name].split(",")
    if any(value not in by_text for value in values):
        expected = ", ".join(by_text) if len(by_text) <= 8 else f"integers from 1 to {len(by_text)}"
        raise SystemExit(f"{name}={options[name]}: expected a comma-separated list of {expected}.")
    return [by_text[value] for value in values]


def _plan(recipe: Any, overrides: list[str], cfg: Any, platform: str | None, options: dict[str, str]) -> int:
    """`--plan`: the recipe's job re-laid out (`lightning_trn.estimate.plan`), printed as a table; `options` (of
    `PLAN_OPTIONS`) narrow the layouts and micro-batches tried."""
    import lightning.pytorch as pl
    from omegaconf import OmegaConf

    from lightning_trn.estimate import RECIPE, EstimateError
    from lightning_trn.estimate.plan import MICRO_BATCHES, format_plan, plan
    from lightning_trn.recipes.cli import load_config

    if recipe.name != "llm" or cfg.trainer.get("strategy") != "model_parallel":
        print("--plan lays out the llm recipe under trainer.strategy=model_parallel.", file=sys.stderr)
        return 2
    # tensor parallelism splits the node's devices and the key/value heads (num_heads is a multiple of them)
    devices, heads = int(cfg.trainer.devices), int(cfg.model.num_kv_heads)
    divisors = [size for size in (1, 2, 4, 8, 16, 32, 64) if devices % size == 0 and heads % size == 0]
    sizes = _option(options, "--tensor-parallel", divisors, divisors)
    checkpointing = _option(options, "--checkpointing", (False, True), (False, True))
    micro_batches = _option(options, "--micro-batches", MICRO_BATCHES, range(1, MAX_MICRO_BATCH + 1))
    world, given = devices * int(cfg.trainer.get("num_nodes", 1)), int(cfg.model.get("context_parallel_size", 1))
    contexts = _option(options, "--context-parallel", [given], range(1, MAX_MICRO_BATCH + 1))
    # each sequence splits into 2 x context chunks; the mesh needs tensor x context to divide the world
    contexts = [size for size in contexts if cfg.data.seq_len % (2 * size) == 0 or size == 1]
    shapes = [(tp, cp) for cp in contexts for tp in sizes if world % (tp * cp) == 0]

    def job(shape: tuple[int, int], checkpointing: bool, micro_batch: int) -> tuple[Any, Any, dict[str, Any]]:
        size, context = shape
        layout = [
            f"model.tensor_parallel_size={size}",
            f"model.context_parallel_size={context}",
            f"model.activation_checkpointing={str(checkpointing).lower()}",
            f"data.batch_size={micro_batch}",
            "data.global_batch_size=null",  # the plan varies the batch per rank; a preset fixes the global one
        ]
        each = load_config(recipe, [*overrides, *layout])
        trainer_args = cast(dict[str, Any], OmegaConf.to_container(each.trainer, resolve=True))
        trainer_args.update(recipe.trainer_args(each))

        def module_factory() -> pl.LightningModule:
            pl.seed_everything(each.seed, verbose=False)
            return recipe.build_model(each)

        return module_factory, recipe_batch(recipe, each), trainer_args

    try:
        layouts = plan(job, shapes, checkpointing, micro_batches, platform=platform, caller=RECIPE)
    except EstimateError as err:
        print(err, file=sys.stderr)
        return 2
    print(format_plan(layouts))
    return 0 if any(layout.micro_batch is not None for layout in layouts) else 1


if __name__ == "__main__":
    sys.exit(main())
