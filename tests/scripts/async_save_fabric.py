"""Worker script for tests/checkpoint/test_async_save.py: Fabric's sharded save, asynchronous against synchronous.

2 ranks, `Fabric(strategy="fsdp")` on the stand-in, AdamW, a few steps; then the same state saved synchronously to
`<out>/sync.ckpt` (a second Fabric strategy's checkpoint IO, `async_save=False`) and asynchronously to
`<out>/async.ckpt`, with a training step run while the asynchronous write is held (it must not reach the file),
then `fabric.load` of the asynchronous checkpoint (which waits for the write). Rank 0 writes `<out>/done` at the end.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO


def step(fabric: Fabric, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 16, device=fabric.device)
    fabric.backward(model(x).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kind", choices=("dcp",), default="dcp", help="as sharded_save_train.py's (DCP only)")
    args = parser.parse_args()
    io = NeuronCheckpointIO(async_save=True)
    fabric = Fabric(accelerator="neuron", devices=2, strategy="fsdp", plugins=[io])
    fabric.launch()
    fabric.seed_everything(3)
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    for _ in range(3):
        step(fabric, model, optimizer)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 3}

    checkpointer = fabric.strategy.checkpointer
    with checkpointer.synchronous():
        fabric.save(args.out / "sync.ckpt", state)

    held = threading.Event()
    write_data = FileSystemWriter.write_data

    def held_write(*a: Any, **k: Any) -> Any:
        assert held.wait(timeout=120)
        return write_data(*a, **k)

    FileSystemWriter.write_data = held_write  # type: ignore[method-assign]
    fabric.save(args.out / "async.ckpt", state)
    step(fabric, model, optimizer)  # the staged copy must not see this update
    assert checkpointer.in_flight
    assert not (args.out / "async.ckpt").exists()
    held.set()
    fabric.load(args.out / "async.ckpt", {"model": model, "optimizer": optimizer})
    if fabric.global_rank == 0:
        (args.out / "done").write_text("ok")


if __name__ == "__main__":
    main()
