"""Neuron training strategies."""

from lightning_trn.pytorch.strategies.base import NeuronStrategyBase
from lightning_trn.pytorch.strategies.ddp import NeuronDDPStrategy
from lightning_trn.pytorch.strategies.fsdp import NeuronFSDPStrategy
from lightning_trn.pytorch.strategies.model_parallel import NeuronModelParallelStrategy
from lightning_trn.pytorch.strategies.single_device import SingleDeviceNeuronStrategy

__all__ = [
    "NeuronDDPStrategy",
    "NeuronFSDPStrategy",
    "NeuronModelParallelStrategy",
    "NeuronStrategyBase",
    "SingleDeviceNeuronStrategy",
]
