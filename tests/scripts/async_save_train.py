"""Worker script for tests/checkpoint/test_async_save.py: the 2-rank FSDP job of sharded_save_train.py
(`strategy="fsdp"`
on the stand-in, a DCP checkpoint after every step, `ModelCheckpoint(save_last=True, every_n_train_steps=1)`), its
saves synchronous, or asynchronous with `--async-save` (`NeuronCheckpointIO(async_save=True)`).

`--write-delay S`: every rank's DCP file write takes S seconds longer, so that training goes on during the writes.
Each rank appends to `<out>/events-rank<r>.txt` one line per event, `<monotonic time> <event>`: `write-start`,
`write-end` (this rank's DCP file write), `commit-end` (rank 0's commit of a save), `step-end` (a training batch).
After `fit` returns, rank 0 writes `<out>/after_fit`: the global step of `last.ckpt` and the hidden entries of the
checkpoint directory at that moment (what teardown left in flight, if anything).

`--kill-write N`: rank 0 kills the whole job (`killpg`, SIGKILL) during its N-th DCP file write, in the background,
once the training thread has had time to go on (and to ask ModelCheckpoint's deletion of the older checkpoint).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.utils.data import DataLoader

from lightning_trn.core.checkpoint import sharded_save
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.checkpoint.distributed_checkpoint import DistributedCheckpointReader
from tests.scripts.sharded_save_train import BATCH, SEED, STEPS, Net, _kill_job, _rank, dataset

#: how long rank 0 waits inside the killed write before the kill: the training thread goes on meanwhile
KILL_AFTER_S = 1.0


class Events:
    """This rank's event log (module docstring)."""

    def __init__(self, out: Path) -> None:
        self.file = out / f"events-rank{_rank()}.txt"

    def __call__(self, event: str) -> None:
        with self.file.open("a") as f:
            f.write(f"{time.monotonic():.6f} {event}\n")


def instrument(events: Events, delay_s: float, kill_write: int | None) -> None:
    """Log (and slow down, or kill inside) every DCP file write and rank 0's commits."""
    write_data = FileSystemWriter.write_data
    writes = {"count": 0}

    @functools.wraps(write_data)
    def logged_write(*args: Any, **kwargs: Any) -> Any:
        writes["count"] += 1
        events("write-start")
        if kill_write == writes["count"] and _rank() == 0:
            time.sleep(KILL_AFTER_S)
            _kill_job()
        time.sleep(delay_s)
        result = write_data(*args, **kwargs)
        events("write-end")
        return result

    FileSystemWriter.write_data = logged_write  # type: ignore[method-assign]
    commit = sharded_save._commit

    def logged_commit(*args: Any) -> None:
        commit(*args)
        events("commit-end")

    sharded_save._commit = logged_commit


class StepEvents(pl.Callback):
    def __init__(self, events: Events) -> None:
        self.events = events

    def on_train_batch_end(self, *args: Any) -> None:
        self.events("step-end")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kind", choices=("dcp",), default="dcp", help="as sharded_save_train.py's (DCP only)")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--keep-all", action="store_true", help="keep every step's checkpoint")
    parser.add_argument("--write-delay", type=float, default=0.0)
    parser.add_argument("--kill-write", type=int, default=None)
    args = parser.parse_args()
    events = Events(args.out)
    instrument(events, args.write_delay, args.kill_write)

    pl.seed_everything(SEED)
    ckpts = args.out / "ckpts"
    checkpoints = ModelCheckpoint(
        dirpath=ckpts,
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=-1 if args.keep_all else 1,
        save_last=True,
    )
    trainer = pl.Trainer(
        accelerator="neuron",
        devices=2,
        strategy="fsdp",
        plugins=[NeuronCheckpointIO(async_save=args.async_save)],
        max_steps=STEPS,
        logger=False,
        callbacks=[checkpoints, StepEvents(events)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), DataLoader(dataset(), batch_size=BATCH))
    if trainer.is_global_zero:
        step = DistributedCheckpointReader(ckpts / "last.ckpt").lightning_meta()["global_step"]
        hidden = sorted(name for name in os.listdir(ckpts) if name.startswith("."))
        (args.out / "after_fit").write_text(f"{step} {' '.join(hidden)}".strip())


if __name__ == "__main__":
    main()
