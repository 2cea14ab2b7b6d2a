"""Worker script for tests/checkpoint/test_checkpoint_ownership.py: 2 ranks, Fabric `strategy="fsdp"` on the stand-in,
asynchronous saves; rank 0's commit of the first save fails (the rename into place is refused). Each rank writes
what its next save raised to `<out>/rank<r>.txt` (`<type>: <message>`), or "no error"."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
from lightning.fabric import Fabric

import lightning_trn  # noqa: F401  # registers accelerator="neuron"
from lightning_trn.core.checkpoint import sharded_save
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from lightning_trn.fabric import NeuronFSDPStrategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # a short timeout: were rank 1 left waiting, it would fail with the group's timeout error instead
    strategy = NeuronFSDPStrategy(timeout=timedelta(seconds=60))
    fabric = Fabric(accelerator="neuron", devices=2, strategy=strategy, plugins=[NeuronCheckpointIO(async_save=True)])
    fabric.launch()
    model = fabric.setup_module(torch.nn.Linear(8, 8))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer}
    if fabric.global_rank == 0:
        commit = sharded_save._commit

        def refused(staging: str, path: str) -> None:
            raise PermissionError(13, "Permission denied", path)

        sharded_save._commit = refused  # type: ignore[assignment]
    fabric.save(args.out / "first.ckpt", state)
    said = "no error"
    try:
        fabric.save(args.out / "second.ckpt", state)
    except Exception as error:  # noqa: BLE001  # what each rank raised is the test's to judge
        said = f"{type(error).__name__}: {error}"
    (args.out / f"rank{fabric.global_rank}.txt").write_text(said)
    fabric.barrier()  # both files are written when rank 0 exits
    if fabric.global_rank == 0:
        sharded_save._commit = commit  # type: ignore[assignment]
    os._exit(0)  # the save in flight is not the point here


if __name__ == "__main__":
    main()
