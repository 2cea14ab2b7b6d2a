"""`SingleDeviceNeuronStrategy`: train on one NeuronCore (or XLA:CPU)."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_trn.runtime import get_runtime
from lightning_trn.strategies.mixin import NeuronStrategyMixin


class SingleDeviceNeuronStrategy(NeuronStrategyMixin, SingleDeviceStrategy):
    """One process, one device (`xla:0`, or `neuron:0` natively); what `Trainer(accelerator="neuron")` picks for one
    device."""

    strategy_name = "neuron_single"

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            device=torch.device(get_runtime().device_type, 0),
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    @property
    @override
    def root_device(self) -> torch.device:
        return self.runtime.device()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Single NeuronCore / XLA:CPU (lightning_trn)")
