"""`python -m lightning_trn.estimate <recipe> [key=value ...] [--platform=trn1|trn2|trn3]`: will this recipe's job
fit? Loads the recipe's config as `python -m lightning_trn.recipes.<recipe>` does (the same `preset=` and
overrides), simulates one training step of rank 0 at the job's world size (`lightning_trn.estimate.estimate`),
prints the memory and collectives tables, and exits 0 if the peak fits a core, 1 if not.

Without Trainium it runs on the `neuron` stand-in (set before `lightning_trn` loads: 64 devices, the most one node
of the presets has), native stack; nothing is allocated.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any, cast

#: the device count the stand-in offers for the simulation: the largest node (trn2.48xlarge: 64 logical cores)
STANDIN_DEVICES = 64


def _use_standin() -> None:
    """Load the stand-in `neuron` device where no Neuron stack is installed (the usual laptop case); `lightning_trn`
    itself is imported already (`-m` imports the parent package first), the stand-in not unless asked for."""
    if importlib.util.find_spec("torch_neuronx") is None:
        os.environ.setdefault("LIGHTNING_TRN_STANDIN_DEVICES", str(STANDIN_DEVICES))
        os.environ.setdefault("LIGHTNING_TRN_BACKEND", "native")
        import lightning_trn.standin  # noqa: F401


def recipe_batch(recipe: Any, cfg: Any) -> Any:
    """One training micro-batch of the recipe, as meta tensors where its shape follows from the config (the LLM
    recipe: token ids and labels, `data.batch_size` x `data.seq_len`), else the first batch of its data module."""
    import torch

    if recipe.name == "llm":
        ids = torch.empty(cfg.data.batch_size, cfg.data.seq_len, dtype=torch.long, device="meta")
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
    name, overrides = args[0], [arg for arg in args[1:] if not arg.startswith("--platform=")]
    _use_standin()

    import lightning.pytorch as pl
    from omegaconf import OmegaConf

    from lightning_trn.estimate import CAPACITY_GIB, estimate
    from lightning_trn.recipes.cli import load_config

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

    result = estimate(module_factory, recipe_batch(recipe, cfg), platform=platform, **trainer_args)
    print(result.format())
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
