"""`SingleDeviceNeuronStrategy` for Lightning Fabric: one process, one NeuronCore (or XLA:CPU, or the stand-in)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_trn.fabric.strategies.mixin import NeuronFabricStrategyMixin
from lightning_trn.runtime import get_runtime


class SingleDeviceNeuronStrategy(NeuronFabricStrategyMixin, SingleDeviceStrategy):
    """What `Fabric(accelerator="neuron")` picks for one device: `xla:0`, or `neuron:0` natively."""

    strategy_name = "neuron_single"

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            device=torch.device(get_runtime().device_type, 0),
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )

    @property
    @override
    def root_device(self) -> torch.device:
        return self.runtime.device()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Single NeuronCore / XLA:CPU (lightning_trn)")
