"""Worker script for tests/checkpoint/test_checkpoint_ownership.py: one process, `strategy="fsdp"` on one stand-in
device (sharded DCP checkpoints through the whole save, commit and recovery path), run in `--out`:

1. `ckpts`: a folder the test filled with a user's own files; `fit` 3 steps with `ModelCheckpoint(dirpath=ckpts,
   every_n_train_steps=1, save_top_k=1, save_last=True)` and a best-loss `ModelCheckpoint` in `<out>/best`, counting
   the DCP shard writes, then `fit(ckpt_path="last")` to step 4 with asynchronous saves
   (`NeuronCheckpointIO(async_save=True)`), counting again.
2. Under SLURM's variables, in the working directory the test filled with a user's files: `fit` with
   `default_root_dir` the working directory and `ckpt_path=None` (SLURM's auto-resume looks there), twice.

Writes `<out>/record.json`: the shard writes of each fit, the steps each fit started at.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.utils.data import DataLoader

import lightning_trn  # noqa: F401  # registers accelerator="neuron"
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from tests.scripts.sharded_save_train import BATCH, SEED, Net, dataset

#: what SLURMEnvironment.detect() and a one-task job need
SLURM = {
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "localhost",
}


class Logged(Net):
    """Logs its loss, which the checkpoints monitor: ModelCheckpoint's scores are then device tensors."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


class Start(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def fit(
    steps: int, callbacks: list[Any], ckpt_path: str | None = None, root: Path | None = None, io: Any = None
) -> tuple[int, int]:
    """A fit; the shard writes it made and the step it started at."""
    writes = {"count": 0}
    write_data = FileSystemWriter.write_data

    def counted(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        writes["count"] += 1
        return write_data(self, *args, **kwargs)

    FileSystemWriter.write_data = counted  # type: ignore[method-assign]
    start = Start()
    try:
        pl.seed_everything(SEED)
        trainer = pl.Trainer(
            accelerator="neuron",
            devices=1,
            strategy="fsdp",
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*callbacks, start],
            plugins=[io] if io is not None else None,
            default_root_dir=root,
        )
        trainer.fit(Logged(), DataLoader(dataset(), batch_size=BATCH), ckpt_path=ckpt_path)
    finally:
        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    return writes["count"], start.step


def every_step(ckpts: Path) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=ckpts,
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=1,
        save_last=True,
        monitor="step",
        mode="max",
    )


def best(out: Path) -> ModelCheckpoint:
    """The best loss so far: its score, in every checkpoint's callback state, is a tensor the step made."""
    return ModelCheckpoint(dirpath=out / "best", filename="best-{step}", monitor="loss", every_n_train_steps=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    record: dict[str, Any] = {}
    ckpts = args.out / "ckpts"
    record["sync"] = fit(3, [every_step(ckpts), best(args.out)])
    record["async"] = fit(
        4, [every_step(ckpts), best(args.out)], ckpt_path="last", io=NeuronCheckpointIO(async_save=True)
    )

    os.environ.update(SLURM)
    work = Path.cwd()
    record["slurm_first"] = fit(2, [ModelCheckpoint(every_n_train_steps=1, save_last=True)], root=work)
    record["slurm_again"] = fit(3, [ModelCheckpoint(every_n_train_steps=1, save_last=True)], root=work)
    (args.out / "record.json").write_text(json.dumps(record))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
