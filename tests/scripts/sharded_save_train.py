"""Worker script for tests/checkpoint/test_sharded_save.py and tests/checkpoint/test_sharded_save_dcp.py: 2 ranks train
a small MLP with AdamW and save a sharded checkpoint after every optimizer step (`ModelCheckpoint(save_last=True,
every_n_train_steps=1)`), optionally SIGKILL-ing the whole job at a chosen point of a chosen save.

`--kind dcp`: `strategy="fsdp"` (FSDP2; torch.distributed.checkpoint directories; the native stand-in). `--kind zero1`:
`NeuronDDPStrategy(zero1=True, state_dict_type="sharded")` (one `zero1-rank<r>.pt` per rank plus `checkpoint.pt`).
`--num-nodes 2`: one rank per node, under two torchrun "nodes" (`--nnodes 2`). Checkpoints go to `<out>/ckpts`:
`step=<k>.ckpt` (`--keep-all`: every step's, the reference run; otherwise the latest only, the older ones removed by
ModelCheckpoint) and `last.ckpt`.

`--kill SAVE:RANK:POINT` kills every process of the job (`killpg`, as a node failure or a scheduler's kill -9 would)
during the SAVE-th sharded save of the run (1-based: the saves go `step=1.ckpt`, `last.ckpt`, `step=2.ckpt`, ...; a DCP
`last.ckpt` is a second name of its step's `step=<k>.ckpt`, linked, not written, unless `--last-only` saves `last.ckpt`
alone):
- `wrote`: rank RANK kills once its own files of that save are written; the other rank is held before writing its
  files, so the directory would hold RANK's new files beside the other rank's files of the previous save;
- `commit`: rank RANK kills right after the atomic swap that commits the save, before the previous copy is deleted;
- `renamed`: rank RANK kills between the two renames of a commit without the swap (`--no-exchange`), once the
  previous checkpoint is `.<name>.old` and before the new one has its name.

`--no-exchange`: `renameat2` fails with EINVAL, as on NFS and Lustre (the commit takes two renames). Rank 0 writes the
step the fit starts at (a resume's checkpoint's) to `<out>/start_step`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.utils.data import DataLoader, TensorDataset

import lightning_trn
from lightning_trn.core.parallel import data_parallel

SEED = 31
FEATURES, HIDDEN, OUTPUTS = 16, 48, 4
STEPS = 5
BATCH = 8  # per rank


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUTPUTS)
        )

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * BATCH * STEPS, FEATURES, generator=generator)
    return TensorDataset(x, torch.stack([x[:, :4].sum(1).sin(), x[:, 1] * x[:, 2], x.cos().mean(1), x[:, 5]], dim=1))


def _rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _kill_job() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def install_kill(save: int, rank: int, point: str) -> None:
    """Count this process's checkpoint saves and kill the job at `point` of save `save`."""
    saves = {"count": 0}
    save_checkpoint = pl.Trainer.save_checkpoint

    @functools.wraps(save_checkpoint)
    def counting(*args: Any, **kwargs: Any) -> Any:
        saves["count"] += 1
        return save_checkpoint(*args, **kwargs)

    pl.Trainer.save_checkpoint = counting  # type: ignore[method-assign]

    def wrap_write(write: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(write)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if saves["count"] == save and _rank() != rank:
                time.sleep(600)  # held: the killing rank writes first
            result = write(*args, **kwargs)
            if saves["count"] == save and _rank() == rank:
                _kill_job()
            return result

        return wrapped

    if point == "wrote":
        FileSystemWriter.write_data = wrap_write(FileSystemWriter.write_data)  # type: ignore[method-assign]
        data_parallel.atomic_local_save = wrap_write(data_parallel.atomic_local_save)  # type: ignore[assignment]
    elif point == "commit":
        from lightning_trn.core.checkpoint import sharded_save

        exchange = sharded_save._exchange

        def exchange_then_kill(*args: Any) -> bool:
            swapped = exchange(*args)
            if swapped and saves["count"] == save and _rank() == rank:
                _kill_job()
            return swapped

        sharded_save._exchange = exchange_then_kill  # type: ignore[assignment]
    elif point == "renamed":
        from lightning_trn.core.checkpoint import sharded_save

        rename = os.rename

        def rename_then_kill(source: Any, target: Any, *args: Any, **kwargs: Any) -> None:
            rename(source, target, *args, **kwargs)
            if os.fspath(target).endswith(sharded_save.ASIDE_SUFFIX) and saves["count"] == save and _rank() == rank:
                _kill_job()

        os.rename = rename_then_kill


class RecordStart(pl.Callback):
    """Rank 0 writes the step the fit starts at to `<out>/start_step`."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            (self.out / "start_step").write_text(str(trainer.global_step))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kind", choices=("dcp", "zero1"), required=True)
    parser.add_argument("--keep-all", action="store_true", help="keep every step's checkpoint (the reference)")
    parser.add_argument("--last-only", action="store_true", help="`last.ckpt` only: every save replaces a checkpoint")
    parser.add_argument("--kill", default=None, help="SAVE:RANK:POINT (module docstring)")
    parser.add_argument("--resume", default=None, help="ckpt_path of trainer.fit, e.g. 'last'")
    parser.add_argument("--no-exchange", action="store_true", help="renameat2 fails with EINVAL (NFS, Lustre)")
    parser.add_argument("--num-nodes", type=int, default=1, help="2: one rank per node, under torchrun --nnodes 2")
    args = parser.parse_args()
    no_exchange: Any = contextlib.nullcontext()
    if args.no_exchange:
        from benchmarks.checkpoint_syscalls import without_exchange

        no_exchange = without_exchange()
    if args.kill:
        save, rank, point = args.kill.split(":")
        install_kill(int(save), int(rank), point)

    pl.seed_everything(SEED)
    if args.kind == "dcp":
        strategy: Any = "fsdp"
    else:
        strategy = lightning_trn.NeuronDDPStrategy(zero1=True, state_dict_type="sharded")
    checkpoints = ModelCheckpoint(
        dirpath=args.out / "ckpts",
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=0 if args.last_only else -1 if args.keep_all else 1,
        save_last=True,
    )
    trainer = pl.Trainer(
        accelerator="neuron",
        devices=2 // args.num_nodes,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        callbacks=[checkpoints, RecordStart(args.out)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with no_exchange:
        trainer.fit(Net(), DataLoader(dataset(), batch_size=BATCH), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
