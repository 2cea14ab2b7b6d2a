"""Worker script for tests/test_sharded_save.py and tests/standin/test_sharded_save_dcp.py: 2 ranks train a small
MLP with AdamW and save a sharded checkpoint after every optimizer step (`ModelCheckpoint(save_last=True,
every_n_train_steps=1)`), optionally SIGKILL-ing the whole job at a chosen point of a chosen save.

`--kind dcp`: `strategy="fsdp"` (FSDP2; torch.distributed.checkpoint directories; the native stand-in). `--kind zero1`:
`NeuronDDPStrategy(zero1=True, state_dict_type="sharded")` (one `zero1-rank<r>.pt` per rank plus `checkpoint.pt`).
Checkpoints go to `<out>/ckpts`: `step=<k>.ckpt` (`--keep-all`: every step's, the reference run; otherwise the
latest only, the older ones removed by ModelCheckpoint) and `last.ckpt`.

`--kill SAVE:RANK:POINT` kills every process of the job (`killpg`, as a node failure or a scheduler's kill -9 would)
during the SAVE-th sharded save of the run (1-based: the saves go `step=1.ckpt`, `last.ckpt`, `step=2.ckpt`, ...):
- `wrote`: rank RANK kills once its own files of that save are written; the other rank is held before writing its
  files, so the directory would hold RANK's new files beside the other rank's files of the previous save;
- `commit`: rank RANK kills right after the atomic swap that commits the save, before the previous copy is deleted.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.utils.data import DataLoader, TensorDataset

import lightning_trn
from lightning_trn.core import data_parallel

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
        from lightning_trn.core import sharded_save

        exchange = sharded_save._exchange

        def exchange_then_kill(*args: Any) -> bool:
            swapped = exchange(*args)
            if swapped and saves["count"] == save and _rank() == rank:
                _kill_job()
            return swapped

        sharded_save._exchange = exchange_then_kill  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kind", choices=("dcp", "zero1"), required=True)
    parser.add_argument("--keep-all", action="store_true", help="keep every step's checkpoint (the reference)")
    parser.add_argument("--kill", default=None, help="SAVE:RANK:POINT (module docstring)")
    parser.add_argument("--resume", default=None, help="ckpt_path of trainer.fit, e.g. 'last'")
    args = parser.parse_args()
    if args.kill:
        save, rank, point = args.kill.split(":")
        install_kill(int(save), int(rank), point)

    pl.seed_everything(SEED)
    if args.kind == "dcp":
        strategy: Any = "fsdp"
    else:
        strategy = lightning_trn.NeuronDDPStrategy(zero1=True, state_dict_type="sharded")
    checkpoints = ModelCheckpoint(dirpath=args.out / "ckpts", filename="{step}", every_n_train_steps=1,
                                  save_top_k=-1 if args.keep_all else 1, save_last=True)
    trainer = pl.Trainer(
        accelerator="neuron", devices=2, strategy=strategy, max_steps=STEPS, logger=False, callbacks=[checkpoints],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Net(), DataLoader(dataset(), batch_size=BATCH), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
