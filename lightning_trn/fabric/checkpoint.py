"""Checkpoints that the Trainer and Fabric both resume: the Trainer's keys, CPU tensors (`NeuronCheckpointIO`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning
from torch.nn import Module
from torch.optim import Optimizer

from lightning_trn.core.parallel.zero1 import optimizer_state


def trainer_checkpoint(
    module: Module, optimizers: Iterable[Optimizer], lr_schedulers: Iterable[Any] = (), **extra: Any
) -> dict[str, Any]:
    """The state to pass to `fabric.save(path, ...)` so that `Trainer.fit(..., ckpt_path=path)` resumes from it:
    weights, optimizer and scheduler states under the Trainer's keys (the Trainer counts its steps from 0 again:
    Fabric has no loop state). `extra` entries are saved beside them (a step count of your own)."""
    return {
        "state_dict": module,
        "optimizer_states": [optimizer_state(optimizer) for optimizer in optimizers],  # ZeRO-1's gathered
        "lr_schedulers": [scheduler.state_dict() for scheduler in lr_schedulers],
        "pytorch-lightning_version": lightning.__version__,
        **extra,
    }
