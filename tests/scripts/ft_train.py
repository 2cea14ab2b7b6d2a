"""Worker script for tests/checkpoint/test_fault_tolerance.py: a deterministic run that resumes itself when started
again.

`python ft_train.py --out DIR` trains a small MLP with SGD on `accelerator="neuron"` for `--max-steps` steps, writing
`DIR/checkpoints/last.ckpt` every `--every` steps (mid-epoch) and resuming from it (`ckpt_path="last"`) if present.
Prints `START <global_step>` once training starts (after any restore) and `STEP <global_step>` after every step, then
`DIR/final.pt` with the final weights. Everything random that a user's job has is there: a plain
`DataLoader(shuffle=True)` (a `RandomSampler` drawing from the global generator), a dataset that augments every
sample with torch, numpy and Python random numbers, and dropout on the device; `--devices 2` runs it data-parallel.
`--sigterm-rank r --sigterm-step k` sends SIGTERM to rank r alone at the end of step k, as a preemption of one node
does; every rank that stops prints `STOPPED <rank> <global_step>`, and `ModelCheckpoint(save_on_exception=True)`
writes `last.ckpt`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

import lightning_trn  # noqa: F401  (registers accelerator="neuron")
from tests.models import AugmentedDataset

SEED = 7
SAMPLES, BATCH_SIZE = 256, 16  # 16 batches per epoch (8 per rank with --devices 2)


class Progress(pl.Callback):
    """Reports the step the run starts from and each finished step on stdout (rank 0), and where each rank stopped
    on an exception, for the parent test; sends SIGTERM to one rank at a chosen step."""

    def __init__(self, step_delay: float, sigterm_rank: int, sigterm_step: int) -> None:
        self.step_delay = step_delay
        self.sigterm_rank, self.sigterm_step = sigterm_rank, sigterm_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:  # one writer: ranks share the parent's stdout
            print(f"START {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.is_global_zero:
            print(f"STEP {trainer.global_step}", flush=True)
        time.sleep(self.step_delay)  # gives the parent time to kill the run at a chosen step
        if (trainer.global_rank, trainer.global_step) == (self.sigterm_rank, self.sigterm_step):
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # every rank writes this line into the one pipe: one write of the whole line, or two ranks' lines can
        # interleave (print may write the text and the newline separately)
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"STOPPED {trainer.global_rank} {trainer.global_step}\n".encode())


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(AugmentedDataset(SAMPLES, SEED), batch_size=BATCH_SIZE, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--sigterm-rank", type=int, default=-1)
    parser.add_argument("--sigterm-step", type=int, default=-1)
    args = parser.parse_args()

    pl.seed_everything(SEED)
    model = MLP()
    trainer = pl.Trainer(
        accelerator="neuron",
        devices=args.devices,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        callbacks=[
            Progress(args.step_delay, args.sigterm_rank, args.sigterm_step),
            ModelCheckpoint(
                dirpath=args.out / "checkpoints",
                save_last=True,
                save_top_k=0,
                every_n_train_steps=args.every,
                save_on_exception=True,
            ),
        ],
    )
    trainer.fit(model, ckpt_path="last")
    if trainer.is_global_zero:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out / "final.pt")


if __name__ == "__main__":
    main()
