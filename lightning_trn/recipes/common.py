"""What every recipe does the same way: build the Trainer from the config, fit + test, export a checkpoint."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from omegaconf import DictConfig, OmegaConf

from lightning_trn import NeuronHealthCheck


def rows_in_batch(batch: Any) -> int:
    """Samples in a classifier batch (`ThroughputMonitor`'s default `batch_size_fn`): the rows of `y`."""
    return len(batch["y"])


#: `logger=` values: Lightning's logger classes, each writing under `<out_dir>/logs`
LOGGERS = ("csv", "tensorboard")
#: Lightning's warning for any multi-rank `validate` / `test`: the recipes' evaluation splits are whole batches on every
#: rank (`tensor_datamodule.evaluation_multiple`), so its sampler repeats no sample
_EVALUATION_SAMPLER_WARNING = r"Using `DistributedSampler` with the dataloaders\. During `trainer\.(validate|test)\(\)`"
#: value checks beyond the type (omegaconf checks types only): (test, what "expected a value ..." goes on to say)
Check = tuple[Callable[[Any], bool], str]
POSITIVE: Check = (lambda v: v > 0, "greater than 0")
NON_NEGATIVE: Check = (lambda v: v >= 0, "0 or more")
FRACTION: Check = (lambda v: 0 <= v < 1, "in [0, 1)")
UNIT_INTERVAL: Check = (lambda v: 0 <= v <= 1, "in [0, 1]")


def doc(text: str, check: Check | None = None) -> Any:
    """A schema field with its `--help` text and, if given, a value check beyond the type; no default (the YAML has
    it), e.g. `batch_size: int = doc("samples per batch", POSITIVE)`. Every field of a schema, sections included,
    has one: the schema is where a key is explained."""
    return field(metadata={"help": text} if check is None else {"help": text, "check": check})


@dataclass
class Ops:
    """`ops.*`: the operations callbacks (docs/operations.md)."""

    throughput: bool = doc(
        "Lightning's ThroughputMonitor: samples/s (and items/s where the recipe counts items, e.g."
        " tokens), TFLOPS and MFU in metrics.csv"
    )
    health_check: bool = doc("NeuronHealthCheck: a device op and the collectives checked on every rank before training")


@dataclass
class RecipeConfig:
    """The keys every recipe's schema has. Schemas give types, value checks and help texts: the defaults are in the
    YAML. `trainer` is open: any key, passed to `lightning.pytorch.Trainer` as it is (Lightning checks the values)."""

    seed: int = doc("seed of every random generator (seed_everything with workers): weights, data splits, shuffling")
    out_dir: str = doc("directory of the run: logs/ (metrics.csv or TensorBoard's files) and checkpoints/last.ckpt")
    ckpt_path: str | None = doc(
        "resume from this checkpoint (e.g. runs/<recipe>/checkpoints/last.ckpt); null: start afresh"
    )
    ckpt_every_n_steps: int = doc(
        "also write last.ckpt every this many optimizer steps, mid-epoch (0: at epoch ends only)", NON_NEGATIVE
    )
    trainer: dict[str, Any] = doc("keyword arguments of lightning.pytorch.Trainer, any key, passed as they are")
    logger: str = doc(
        "csv: logs/metrics.csv (Lightning's CSVLogger) | tensorboard: TensorBoard event files in logs/ (Lightning's"
        " TensorBoardLogger; `tensorboard --logdir <out_dir>/logs`)",
        (lambda v: v in LOGGERS, f"one of {', '.join(LOGGERS)}"),
    )
    ops: Ops = doc("operations callbacks (docs/operations.md)")


@dataclass(frozen=True)
class Recipe:
    """One recipe: its config file (`configs/<name>.yaml` in this package) and `schema` (a `RecipeConfig` subclass),
    how to build its data and model, and how to export a trained module to the format GPU users load.

    The optional fields default to what the classifier recipes need: `batch_size_fn` / `length_fn` count samples
    and items (e.g. tokens) for `ThroughputMonitor`; `trainer_args` returns Trainer arguments derived from the
    config (e.g. a strategy object) that replace `cfg.trainer`'s; `summary` returns numbers measured after `fit`,
    printed and returned with the test metrics; `presets` are named override lists for `preset=NAME` (the schema
    then has a `preset: str` key, default `none`); `resolve(cfg, given)` fills the keys derived from others once the
    config is loaded (`given`: the keys the preset and the command line set), raising ValueError on a conflict.
    """

    name: str
    module_class: type[pl.LightningModule]
    build_data: Callable[[DictConfig], pl.LightningDataModule]
    build_model: Callable[[DictConfig], pl.LightningModule]
    export: Callable[[Any, Path], None]
    schema: type[RecipeConfig]
    batch_size_fn: Callable[[Any], int] = rows_in_batch
    length_fn: Callable[[Any], int] | None = None
    trainer_args: Callable[[DictConfig], dict[str, Any]] | None = None
    summary: Callable[[pl.Trainer, pl.LightningModule, pl.LightningDataModule], dict[str, float]] | None = None
    presets: Mapping[str, Sequence[str]] = field(default_factory=dict, hash=False)
    resolve: Callable[[DictConfig, set[str]], None] | None = None

    @property
    def config_path(self) -> Path:
        return Path(__file__).parent / "configs" / f"{self.name}.yaml"


def checkpoint_callbacks(dirpath: Path, every_n_steps: int = 0) -> list[Callback]:
    """`last.ckpt` in `dirpath` at every epoch end and, with `every_n_steps` > 0 (`ckpt_every_n_steps`), also every
    that many optimizer steps, mid-epoch included, so a stopped job resumes (exactly: docs/fault-tolerance.md) from
    at most that many steps back.

    Two callbacks: one `ModelCheckpoint` cannot save both every n steps and at epoch ends, and a step-only one would
    leave `last.ckpt` behind the final weights when the job's length is not a multiple of n. Both write the same
    `last.ckpt` (no `last-v1.ckpt` versions), the step one no top-k files.
    """
    if every_n_steps <= 0:
        return [ModelCheckpoint(dirpath=dirpath, save_last=True)]
    return [
        ModelCheckpoint(dirpath=dirpath, save_last=True, enable_version_counter=False),
        ModelCheckpoint(
            dirpath=dirpath,
            save_last=True,
            save_top_k=0,
            every_n_train_steps=every_n_steps,
            enable_version_counter=False,
        ),
    ]


def build_trainer(cfg: DictConfig, recipe: Recipe | None = None) -> pl.Trainer:
    """`Trainer(**cfg.trainer)` writing logs (`logs/`, `cfg.logger`'s) and checkpoints (`last.ckpt`) under
    `cfg.out_dir`, with the `ops.*` callbacks the config turns on; `recipe` (if given) adds its Trainer arguments and
    throughput counts."""
    out_dir = Path(cfg.out_dir)
    callbacks: list[Callback] = checkpoint_callbacks(out_dir / "checkpoints", cfg.ckpt_every_n_steps)
    if cfg.ops.throughput:
        batch_size_fn = recipe.batch_size_fn if recipe is not None else rows_in_batch
        length_fn = recipe.length_fn if recipe is not None else None
        callbacks.append(ThroughputMonitor(batch_size_fn=batch_size_fn, length_fn=length_fn))
    if cfg.ops.health_check:
        callbacks.append(NeuronHealthCheck())
    trainer_args = cast(dict[str, Any], OmegaConf.to_container(cfg.trainer, resolve=True))  # a mapping section
    if recipe is not None and recipe.trainer_args is not None:
        trainer_args.update(recipe.trainer_args(cfg))
    logger_class = TensorBoardLogger if cfg.logger == "tensorboard" else CSVLogger
    return pl.Trainer(
        **trainer_args,
        default_root_dir=out_dir,
        logger=logger_class(out_dir, name="logs", version=""),
        callbacks=callbacks,
    )


@contextmanager
def _evaluation_without_repeats() -> Iterator[None]:
    """Lightning's warning that a multi-rank evaluation may count samples twice left out: the recipes' data modules
    pad evaluation splits to whole batches on every rank, so none is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EVALUATION_SAMPLER_WARNING, category=PossibleUserWarning)
        yield


def fit(recipe: Recipe, cfg: DictConfig) -> tuple[pl.LightningModule, dict[str, Any]]:
    """Train (resuming from `cfg.ckpt_path` if set), then test the final weights on the held-out split.

    Returns the trained module and the test metrics, the recipe's `summary` numbers and `checkpoint`, the path of
    `last.ckpt`.
    """
    pl.seed_everything(cfg.seed, workers=True)
    data = recipe.build_data(cfg)
    model = recipe.build_model(cfg)
    trainer = build_trainer(cfg, recipe)
    trainer.fit(model, datamodule=data, ckpt_path=cfg.ckpt_path)
    with _evaluation_without_repeats():
        summary = recipe.summary(trainer, model, data) if recipe.summary is not None else {}
        results = trainer.test(model, datamodule=data, verbose=False)[0]
    callback = trainer.checkpoint_callback
    checkpoint = callback.last_model_path if isinstance(callback, ModelCheckpoint) else ""
    if trainer.is_global_zero:
        print(f"[{recipe.name}] held-out test: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())))
        print(f"[{recipe.name}] checkpoint: {checkpoint}")
        if summary:
            print(f"[{recipe.name}] " + " ".join(f"{k}={v:.2f}" for k, v in summary.items()))
    return model, {**results, **summary, "checkpoint": checkpoint}


def load_module(recipe: Recipe, checkpoint: str) -> pl.LightningModule:
    """Load a recipe checkpoint on the CPU (no torch_xla needed) with `weights_only=True`: a checkpoint file, or a
    sharded strategy's directory (`model_parallel`, `fsdp`, ZeRO-1 `sharded`), whose model weights are consolidated
    first into a scratch file beside it (`lightning_trn.consolidate.model_checkpoint`: no optimizer state)."""
    if not Path(checkpoint).is_dir():
        return recipe.module_class.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True)
    from lightning_trn.consolidate import model_checkpoint

    print(f"[{recipe.name}] {checkpoint} is a sharded checkpoint directory: consolidating its model weights")
    with tempfile.TemporaryDirectory(prefix=".consolidated-", dir=Path(checkpoint).resolve().parent) as scratch:
        file = Path(scratch) / "model.ckpt"
        torch.save(model_checkpoint(checkpoint), file)
        return recipe.module_class.load_from_checkpoint(file, map_location="cpu", weights_only=True)


def export(recipe: Recipe, checkpoint: str, out: str) -> Path:
    """Write the checkpoint's model (a file or a sharded directory, `load_module`) to `out` in the recipe's
    GPU-friendly format."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe.export(load_module(recipe, checkpoint).eval(), out_dir)
    print(f"[{recipe.name}] exported {checkpoint} -> {out_dir}")
    return out_dir
