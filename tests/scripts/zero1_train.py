"""Worker script for tests/strategies/test_zero1.py: Adam with weight decay, gradient clipping, accumulation and a
per-step LR schedule on a small MLP whose parameter sizes are not multiples of the world size (ZeRO-1 pads them).

`--api trainer`: a Trainer run (`--strategy auto` on one process is the unsharded reference; `neuron_zero1` shards);
`--api fabric`: the same job as a Fabric loop. `--state-dict-type sharded`: ZeRO-1 with sharded checkpoints
(directories). Batch 8 per optimizer step in total (split over the ranks), two
micro-batches per step. Writes to --out: `final.ckpt`, `step=3.ckpt` (Trainer: a mid-epoch checkpoint after step 3),
`run.json` from rank 0 (device reads and compiles from the third optimizer step to the last, the backend), and from
every rank `rank<r>.json` (its optimizer-state bytes, the dtypes of the tensors its optimizer updates and holds).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_trn
from lightning_trn.core.parallel.zero1 import optimizer_state_bytes
from lightning_trn.runtime import get_runtime

SEED = 77
FEATURES = 7
STEPS = 6
ACCUMULATE = 2
CLIP = 0.05


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
        self.measured: dict[int, object] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def on_train_batch_start(self, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.measured[batch_idx] = get_runtime().metrics()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer, scheduler = optimizer_and_schedule(self)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def optimizer_and_schedule(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8 * ACCUMULATE * STEPS, FEATURES, generator=generator)
    return TensorDataset(x, torch.stack([x.sum(1).sin(), x[:, 0] * x[:, 1], x.cos().mean(1)], dim=1))


def write_rank_record(out: Path, rank: int, optimizer: torch.optim.Optimizer) -> None:
    updated = [p for group in optimizer.param_groups for p in group["params"]]
    held = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    record = {
        "state_bytes": optimizer_state_bytes(optimizer),
        "updated_dtypes": sorted({str(p.dtype) for p in updated}),
        "state_dtypes": sorted({str(v.dtype) for v in held}),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def train_with_trainer(args: argparse.Namespace) -> None:
    pl.seed_everything(SEED)
    torch.manual_seed(SEED + int(os.environ.get("LOCAL_RANK", "0")))  # only the strategy's broadcast aligns ranks
    model = Net()
    data = dataset()
    sampler = None if args.devices > 1 else DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=8 // args.devices, sampler=sampler)
    strategy = args.strategy
    if args.state_dict_type == "sharded":
        strategy = lightning_trn.NeuronDDPStrategy(zero1=True, state_dict_type="sharded")
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=args.out, filename="{step}", every_n_train_steps=3, save_top_k=-1)],
    )
    trainer.fit(model, loader, ckpt_path=args.resume)
    trainer.save_checkpoint(args.out / "final.ckpt")
    write_rank_record(args.out, trainer.global_rank, trainer.optimizers[0])
    if trainer.is_global_zero:
        first = ACCUMULATE * (2 if args.resume is None else 5)  # the batch that starts the third step (or after resume)
        between = model.measured[max(model.measured)] - model.measured[first]
        run = {"scalar_reads": between.scalar_reads, "compiles": between.compiles, "backend": get_runtime().name}
        (args.out / "run.json").write_text(json.dumps(run))


def train_with_fabric(args: argparse.Namespace) -> None:
    fabric = Fabric(accelerator="neuron", devices=args.devices, strategy=args.strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(SEED)
    torch.manual_seed(SEED + fabric.global_rank)
    model = Net()
    optimizer, scheduler = optimizer_and_schedule(model)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=8 // args.devices, shuffle=True))
    for index, (x, y) in enumerate(loader):
        fabric.backward(torch.nn.functional.mse_loss(model(x), y) / ACCUMULATE)
        if (index + 1) % ACCUMULATE == 0:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    state = {"state_dict": model, "optimizer": optimizer}
    fabric.save(args.out / "final.ckpt", state)
    write_rank_record(args.out, fabric.global_rank, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--api", choices=("trainer", "fabric"), default="trainer")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="neuron", help="Trainer: cpu with 64-true is the float64 twin")
    parser.add_argument("--resume", type=Path, default=None, help="Trainer: checkpoint to resume from")
    parser.add_argument("--state-dict-type", default="full", help="Trainer: 'sharded' for ZeRO-1 sharded checkpoints")
    args = parser.parse_args()
    (train_with_trainer if args.api == "trainer" else train_with_fabric)(args)


if __name__ == "__main__":
    main()
