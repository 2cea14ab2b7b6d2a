"""`SingleDeviceNeuronStrategy`: train on one NeuronCore (or XLA:CPU)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_trn.core.strategy import CheckpointingPolicy, SingleDeviceCore
from lightning_trn.pytorch.strategies.base import NeuronStrategyBase


class SingleDeviceNeuronStrategy(SingleDeviceCore, NeuronStrategyBase, SingleDeviceStrategy):
    """One process, one device (`xla:0`, or `neuron:0` natively); what `Trainer(accelerator="neuron")` picks for one
    device.

    Args:
        activation_checkpointing_policy: checkpoint these submodules (e.g. `{Block}`), as Lightning's FSDPStrategy does.
    """

    @override
    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        activation_checkpointing_policy: CheckpointingPolicy | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            activation_checkpointing_policy=activation_checkpointing_policy,
        )
