"""Worker script for tests/strategies/test_ddp_training.py: a few SGD steps of a tiny regression model with
`NeuronDDPStrategy`.

Launched by torchrun or as plain `python ddp_train.py` (the strategy then starts the other ranks itself). Every rank
initialises the model from a different seed, so only the strategy's broadcast at setup makes the weights equal.
Writes to --out: `final.ckpt` (through a checkpoint IO that records which rank saved) and, from rank 0, `run.json`
(the last step's loss, logged with `sync_dist=True`, the torchmetrics sample count, the device scalar reads and
device-to-host copies between steps, the backend), from every rank `device_rank<r>.txt` (its parameters' device)
and `tied_rank<r>.txt` (whether the tied weight is still one Parameter after `fit`),
and `collectives.json` with the results of `strategy.reduce` / `all_gather` / `broadcast`; at exit, from every rank
`groups_destroyed_rank<r>.txt` (whether the process groups were destroyed before the interpreter's teardown).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torchmetrics
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_trn
from lightning_trn import NeuronCheckpointIO
from lightning_trn.runtime import RuntimeMetrics, get_runtime

FEATURES = 8
SEED = 1234


class RecordingCheckpointIO(NeuronCheckpointIO):
    """Also appends `<global rank>` to `<out>/saved_by.txt` for every checkpoint it writes."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:  # type: ignore[no-untyped-def]
        with open(self.out / "saved_by.txt", "a") as f:
            f.write(f"{os.environ.get('RANK', os.environ.get('LOCAL_RANK', '0'))}\n")
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


class Regression(pl.LightningModule):
    def __init__(self, die_rank: int, die_step: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        # unused, sharing the first layer's weight as an output head shares an embedding: the tie must survive fit
        self.tied = torch.nn.Linear(FEATURES, 16, bias=False)
        self.tied.weight = self.net[0].weight
        # synced over the ranks when computed: all samples of the epoch ("disable": no NaN check, i.e. host read)
        self.samples = torchmetrics.SumMetric(nan_strategy="disable")
        self.die_rank, self.die_step = die_rank, die_step

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.global_rank == self.die_rank and batch_idx == self.die_step:
            os._exit(3)  # a rank dying mid-training, without any cleanup
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)  # mean over ranks = the 1-process loss on the whole batch
        self.samples.update(torch.ones_like(y).sum())
        self.log("samples", self.samples, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TransferCounter(pl.Callback):
    """Device scalar reads (`.item()` on a device tensor: a host sync) and device-to-host copies from the second batch
    to the last one."""

    def __init__(self) -> None:
        self.metrics: dict[int, RuntimeMetrics] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.metrics[batch_idx] = get_runtime().metrics()

    def between_steps(self) -> RuntimeMetrics:
        return self.metrics[max(self.metrics)] - self.metrics[1]


class DeviceRecorder(pl.Callback):
    """Writes `<out>/device_rank<global rank>.txt`: the device this rank trains on."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        (self.out / f"device_rank{trainer.global_rank}.txt").write_text(str(next(pl_module.parameters()).device))


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    return TensorDataset(x, y)


def write_collectives(strategy: lightning_trn.NeuronDDPStrategy, out: Path) -> None:
    value = torch.tensor([float(strategy.global_rank + 1)], device=strategy.root_device)
    results = {op: strategy.reduce(value, reduce_op=op).cpu().tolist() for op in ("sum", "mean", "max", "min")}
    results["gathered"] = strategy.all_gather(value).cpu().tolist()
    results["broadcast"] = strategy.broadcast({"from_rank": strategy.global_rank})
    results["world_size"] = strategy.world_size
    if strategy.is_global_zero:
        (out / "collectives.json").write_text(json.dumps(results))


def record_groups_destroyed(out: Path, rank: str) -> None:
    """Registered before the strategy's exit handler, so it runs after it (atexit runs last-in first-out)."""
    (out / f"groups_destroyed_rank{rank}.txt").write_text(str(not dist.is_initialized()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-step", type=int, default=-1)
    parser.add_argument("--timeout-s", type=float, default=None, help="process-group timeout (default: Lightning's)")
    args = parser.parse_args()

    pl.seed_everything(SEED)  # the same on every rank: Lightning seeds the injected DistributedSampler with it
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    torch.manual_seed(SEED + int(rank))
    atexit.register(record_groups_destroyed, args.out, rank)
    model = Regression(args.die_rank, args.die_step)
    world = args.devices * args.num_nodes
    data = dataset(args.batch_size * world * args.steps)
    distributed = world > 1
    # "auto" is what users write: devices * num_nodes > 1 picks NeuronDDPStrategy ("neuron_ddp")
    strategy = lightning_trn.NeuronDDPStrategy(timeout=timedelta(seconds=args.timeout_s)) if args.timeout_s else "auto"
    # Distributed: Lightning injects DistributedSampler(shuffle=True, seed=SEED), rank r taking permutation[r::world].
    # One process: the same permutation, so its batch k of size world*B holds exactly the world's batches k.
    sampler = None if distributed else DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    transfers = TransferCounter()
    trainer = pl.Trainer(
        accelerator="neuron",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        plugins=[RecordingCheckpointIO(args.out)],
        callbacks=[transfers, DeviceRecorder(args.out)],
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    trainer.save_checkpoint(args.out / "final.ckpt")
    (args.out / f"tied_rank{trainer.global_rank}.txt").write_text(str(model.tied.weight is model.net[0].weight))
    if trainer.is_global_zero:
        run = {
            "last_loss": trainer.callback_metrics["train_loss"].item(),
            "samples": trainer.callback_metrics["samples"].item(),
            "scalar_reads": transfers.between_steps().scalar_reads,
            "device_to_host": transfers.between_steps().device_to_host,
            "backend": get_runtime().name,
        }
        (args.out / "run.json").write_text(json.dumps(run))
    if distributed:
        write_collectives(trainer.strategy, args.out)


if __name__ == "__main__":
    main()
