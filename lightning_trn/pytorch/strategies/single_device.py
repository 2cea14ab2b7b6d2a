"""`SingleDeviceNeuronStrategy`: train on one NeuronCore (or XLA:CPU)."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_trn.core.strategy import CheckpointingPolicy, SingleDeviceCore
from lightning_trn.pytorch.strategies.mixin import NeuronStrategyMixin


class SingleDeviceNeuronStrategy(SingleDeviceCore, NeuronStrategyMixin, SingleDeviceStrategy):
    """One process, one device (`xla:0`, or `neuron:0` natively); what `Trainer(accelerator="neuron")` picks for one
    device.

    Args:
        activation_checkpointing_policy: checkpoint these submodules (e.g. `{Block}`), as Lightning's FSDPStrategy does.
    """

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        activation_checkpointing_policy: Optional[CheckpointingPolicy] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            activation_checkpointing_policy=activation_checkpointing_policy,
        )
