"""Checkpoints that the Trainer and Fabric both resume: the Trainer's keys, CPU tensors (`NeuronCheckpointIO`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning
from torch.nn import Module
from torch.optim import Optimizer

#: the keys of a Trainer checkpoint that carry the training state both APIs have
STATE_DICT, OPTIMIZER_STATES, LR_SCHEDULERS, VERSION = (
    "state_dict", "optimizer_states", "lr_schedulers", "pytorch-lightning_version"
)


def trainer_checkpoint(
    module: Module, optimizers: Iterable[Optimizer], lr_schedulers: Iterable[Any] = (), **extra: Any
) -> dict[str, Any]:
    """The state to pass to `fabric.save(path, ...)` so that `Trainer.fit(..., ckpt_path=path)` resumes from it:
    weights, optimizer and scheduler states under the Trainer's keys (the Trainer counts its steps from 0 again:
    Fabric has no loop state). `extra` entries are saved beside them (a step count of your own)."""
    return {
        STATE_DICT: module,
        OPTIMIZER_STATES: [optimizer.state_dict() for optimizer in optimizers],
        LR_SCHEDULERS: [scheduler.state_dict() for scheduler in lr_schedulers],
        VERSION: lightning.__version__,
        **extra,
    }
