"""`SingleDeviceNeuronStrategy` for Lightning Fabric: one process, one NeuronCore (or XLA:CPU, or the stand-in)."""

from __future__ import annotations

from typing import Optional

from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import SingleDeviceStrategy

from lightning_trn.core.strategy import CheckpointingPolicy, SingleDeviceCore
from lightning_trn.fabric.strategies.mixin import NeuronFabricStrategyMixin


class SingleDeviceNeuronStrategy(SingleDeviceCore, NeuronFabricStrategyMixin, SingleDeviceStrategy):
    """What `Fabric(accelerator="neuron")` picks for one device: `xla:0`, or `neuron:0` natively.

    Args:
        activation_checkpointing_policy: checkpoint these submodules (e.g. `{Block}`), as Lightning's FSDPStrategy does.
    """

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        activation_checkpointing_policy: Optional[CheckpointingPolicy] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision,
            activation_checkpointing_policy=activation_checkpointing_policy,
        )
