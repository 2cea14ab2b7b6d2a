"""Worker script for tests/strategies/test_ddp_training.py: the `ddp_train.py` job written as a Fabric loop, the
natural way.

`python fabric_train.py --devices 2` (`fabric.launch()` starts rank 1) or under torchrun. Every rank initialises the
model from a different seed, so only the strategy's broadcast makes the weights equal. Writes to --out:
`fabric.ckpt` (rank 0, `lightning_trn.fabric.trainer_checkpoint`), `run.json` from rank 0 (the last loss averaged
over the ranks, device reads and compiles between the second step and the last, the collectives' results).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from ddp_train import SEED, Regression, dataset
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import lightning_trn  # noqa: F401  (registers accelerator="neuron" with Fabric)
from lightning_trn.fabric import trainer_checkpoint
from lightning_trn.runtime import get_runtime


class Model(Regression):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    fabric = Fabric(accelerator="neuron", devices=args.devices)
    fabric.launch()
    fabric.seed_everything(SEED)  # the same on every rank: the DistributedSampler's shuffle seed
    torch.manual_seed(SEED + fabric.global_rank)
    model = Model(die_rank=-1, die_step=-1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = dataset(args.batch_size * fabric.world_size * args.steps)
    # shuffle=True: Fabric puts in DistributedSampler(shuffle=True, seed=SEED), as the Trainer does
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch_size, shuffle=True))
    metrics = {}
    for step, (x, y) in enumerate(loader):
        metrics[step] = get_runtime().metrics()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    between = metrics[max(metrics)] - metrics[1]
    fabric.save(args.out / "fabric.ckpt", trainer_checkpoint(model, [optimizer]))
    value = torch.tensor([float(fabric.global_rank + 1)], device=fabric.device)
    run = {
        "last_loss": fabric.all_reduce(loss.detach(), reduce_op="mean").item(),
        "scalar_reads": between.scalar_reads,
        "device_to_host": between.device_to_host,
        "compiles": between.compiles,
        "backend": get_runtime().name,
        "world_size": fabric.world_size,
        "sum": fabric.all_reduce(value, reduce_op="sum").cpu().tolist(),
        "gathered": fabric.all_gather(value).cpu().tolist(),
        "broadcast": fabric.broadcast({"from_rank": fabric.global_rank}),
        "device": str(next(model.parameters()).device),
        "tied": model.tied.weight is model.net[0].weight,
    }
    fabric.barrier()
    if fabric.global_rank == 0:
        (args.out / "run.json").write_text(json.dumps(run))


if __name__ == "__main__":
    main()
