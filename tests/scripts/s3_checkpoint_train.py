"""Worker script for tests/checkpoint/test_s3_checkpoint.py: 2 ranks, `strategy="fsdp"` on the stand-in, sharded
checkpoints in S3 (`--url s3://bucket/prefix`; the endpoint and credentials come from the environment), one launch:

1. `fit` for 3 steps, `ModelCheckpoint(dirpath=<url>, filename="{step}", every_n_train_steps=1, save_top_k=1,
   save_last=True)`; then `trainer.save_checkpoint(<url>/manual.ckpt)`.
2. Fabric (`strategy="fsdp"`) on the same ranks: one step, `fabric.save(<url>/fabric.ckpt)`, one more step,
   `fabric.load` of that checkpoint.
3. A new Trainer, `fit(ckpt_path="last")` up to step 5, killed (`killpg`, SIGKILL) during its last save (`step=5.ckpt`,
   the event's first name: `last.ckpt` would be linked to it after its commit) once rank 1 uploaded its DCP shard and
   before rank 0 wrote its own.

Each rank writes `<out>/rank<r>.json`: the step and the sum of its local parameter shards at the end of the first fit
and at the start of the resumed one, Fabric's sums at its save and after its load.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from s3torchconnector.dcp import S3StorageWriter
from torch.utils.data import DataLoader

import lightning_trn  # noqa: F401  # registers accelerator="neuron"
from tests.scripts.sharded_save_train import BATCH, SEED, Net, _kill_job, _rank, dataset

FIRST_STEPS, LAST_STEP = 3, 5


def shard_sum(module: torch.nn.Module) -> float:
    """The sum of this rank's local parameter shards (DTensors' local parts)."""
    total = 0.0
    for parameter in module.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += float(local.detach().double().sum().cpu())
    return total


class Record(pl.Callback):
    """Puts the step and the shard sum at the start and the end of a fit into this rank's record file."""

    def __init__(self, record: dict[str, Any], prefix: str, output: Path) -> None:
        self.record, self.prefix, self.output = record, prefix, output

    def _put(self, when: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record[f"{self.prefix}_{when}"] = [trainer.global_step, shard_sum(pl_module)]
        self.output.write_text(json.dumps(self.record))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._put("start", trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._put("end", trainer, pl_module)


def trainer(url: str, steps: int, record: Record) -> pl.Trainer:
    checkpoints = ModelCheckpoint(dirpath=url, filename="{step}", every_n_train_steps=1, save_top_k=1, save_last=True)
    return pl.Trainer(
        accelerator="neuron",
        devices=2,
        strategy="fsdp",
        max_steps=steps,
        logger=False,
        callbacks=[checkpoints, record],
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fabric_round_trip(url: str, record: dict[str, Any]) -> None:
    fabric = Fabric(accelerator="neuron", devices=2, strategy="fsdp")
    fabric.launch()
    model = fabric.setup_module(Net().net)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.02))
    x, y = dataset().tensors

    def step() -> None:
        optimizer.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x[:BATCH].to(fabric.device)), y[:BATCH].to(fabric.device)))
        optimizer.step()

    step()
    state = {"model": model, "optimizer": optimizer, "step": 1}
    fabric.save(f"{url}/fabric.ckpt", state)
    record["fabric_saved"] = shard_sum(model)
    step()
    record["fabric_stepped"] = shard_sum(model)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{url}/fabric.ckpt", state)
    record["fabric_loaded"] = [state["step"], shard_sum(model)]


def kill_in_last_save() -> None:
    """In the Trainer's save of `step=5.ckpt` at the last step, rank 0 waits while rank 1 uploads its DCP shard, then
    rank 1 kills the job."""
    save_checkpoint = pl.Trainer.save_checkpoint
    state = {"target": False}

    @functools.wraps(save_checkpoint)
    def watching(self: pl.Trainer, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        state["target"] = self.global_step == LAST_STEP and os.fspath(filepath).endswith(f"/step={LAST_STEP}.ckpt")
        return save_checkpoint(self, filepath, *args, **kwargs)

    pl.Trainer.save_checkpoint = watching  # type: ignore[method-assign]
    write_data = S3StorageWriter.write_data

    @functools.wraps(write_data)
    def write_then_kill(*args: Any, **kwargs: Any) -> Any:
        if state["target"] and _rank() == 0:
            time.sleep(600)  # held: rank 1 uploads first, then kills
        result = write_data(*args, **kwargs)  # the upload is done when it returns
        if state["target"] and _rank() == 1:
            _kill_job()
        return result

    S3StorageWriter.write_data = write_then_kill  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--kind", choices=("dcp",), default="dcp", help="what tests.sharded_runs.run_job passes")
    args = parser.parse_args()
    record: dict[str, Any] = {}
    output = args.out / f"rank{_rank()}.json"

    pl.seed_everything(SEED)
    first = trainer(args.url, FIRST_STEPS, Record(record, "first", output))
    first.fit(Net(), DataLoader(dataset(), batch_size=BATCH))
    first.save_checkpoint(f"{args.url}/manual.ckpt")

    fabric_round_trip(args.url, record)
    output.write_text(json.dumps(record))

    kill_in_last_save()
    resumed = trainer(args.url, LAST_STEP, Record(record, "resumed", output))
    resumed.fit(Net(), DataLoader(dataset(), batch_size=BATCH), ckpt_path="last")


if __name__ == "__main__":
    main()
