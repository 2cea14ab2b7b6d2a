"""`SingleDeviceNeuronStrategy` for Lightning Fabric: one process, one NeuronCore (or XLA:CPU, or the stand-in)."""

from __future__ import annotations

from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_trn.core.strategy import CheckpointingPolicy, SingleDeviceCore
from lightning_trn.fabric.strategies.base import NeuronFabricStrategyBase


class SingleDeviceNeuronStrategy(SingleDeviceCore, NeuronFabricStrategyBase, SingleDeviceStrategy):
    """What `Fabric(accelerator="neuron")` picks for one device: `xla:0`, or `neuron:0` natively.

    Args:
        activation_checkpointing_policy: checkpoint these submodules (e.g. `{Block}`), as Lightning's FSDPStrategy does.
    """

    @override
    def __init__(
        self,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        activation_checkpointing_policy: CheckpointingPolicy | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision=precision,
            activation_checkpointing_policy=activation_checkpointing_policy,
        )
