"""What every recipe does the same way: build the Trainer from the config, fit + test, export a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lightning_trn import NeuronHealthCheck
from recipes.classifier import ClassifierModule
from recipes.data import TensorDataModule


@dataclass(frozen=True)
class Recipe:
    """One recipe: its config file (`recipes/configs/<name>.yaml`), how to build its data and model, and how to
    export a trained module to the format GPU users load."""

    name: str
    module_class: type[ClassifierModule]
    build_data: Callable[[DictConfig], TensorDataModule]
    build_model: Callable[[DictConfig], ClassifierModule]
    export: Callable[[ClassifierModule, Path], None]

    @property
    def config_path(self) -> Path:
        return Path(__file__).parent / "configs" / f"{self.name}.yaml"


def build_trainer(cfg: DictConfig) -> pl.Trainer:
    """`Trainer(**cfg.trainer)` writing logs (`metrics.csv`) and checkpoints (`last.ckpt`) under `cfg.out_dir`, with
    the `ops.*` callbacks the config turns on."""
    out_dir = Path(cfg.out_dir)
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=out_dir / "checkpoints", save_last=True)]
    if cfg.ops.throughput:
        callbacks.append(ThroughputMonitor(batch_size_fn=lambda batch: len(batch["y"])))
    if cfg.ops.health_check:
        callbacks.append(NeuronHealthCheck())
    return pl.Trainer(
        **OmegaConf.to_container(cfg.trainer, resolve=True),
        default_root_dir=out_dir,
        logger=CSVLogger(out_dir, name="logs", version=""),
        callbacks=callbacks,
    )


def fit(recipe: Recipe, cfg: DictConfig) -> tuple[ClassifierModule, dict[str, Any]]:
    """Train (resuming from `cfg.ckpt_path` if set), then test the final weights on the held-out split.

    Returns the trained module and the test metrics plus `checkpoint`, the path of `last.ckpt`.
    """
    pl.seed_everything(cfg.seed, workers=True)
    data = recipe.build_data(cfg)
    model = recipe.build_model(cfg)
    trainer = build_trainer(cfg)
    trainer.fit(model, datamodule=data, ckpt_path=cfg.ckpt_path)
    results = trainer.test(model, datamodule=data, verbose=False)[0]
    checkpoint = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else ""
    if trainer.is_global_zero:
        print(f"[{recipe.name}] held-out test: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())))
        print(f"[{recipe.name}] checkpoint: {checkpoint}")
    return model, {**results, "checkpoint": checkpoint}


def load_module(recipe: Recipe, checkpoint: str) -> ClassifierModule:
    """Load a recipe checkpoint on the CPU (no torch_xla needed) with `weights_only=True`."""
    return recipe.module_class.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True)


def export(recipe: Recipe, checkpoint: str, out: str) -> Path:
    """Write the checkpoint's model to `out` in the recipe's GPU-friendly format."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe.export(load_module(recipe, checkpoint).eval(), out_dir)
    print(f"[{recipe.name}] exported {checkpoint} -> {out_dir}")
    return out_dir
