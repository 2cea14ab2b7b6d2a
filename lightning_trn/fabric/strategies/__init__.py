"""Fabric's Neuron strategies."""

from lightning_trn.fabric.strategies.base import NeuronFabricStrategyBase
from lightning_trn.fabric.strategies.ddp import NeuronDDPStrategy
from lightning_trn.fabric.strategies.fsdp import NeuronFSDPStrategy
from lightning_trn.fabric.strategies.model_parallel import NeuronModelParallelStrategy
from lightning_trn.fabric.strategies.single import SingleDeviceNeuronStrategy

__all__ = [
    "NeuronDDPStrategy",
    "NeuronFSDPStrategy",
    "NeuronFabricStrategyBase",
    "NeuronModelParallelStrategy",
    "SingleDeviceNeuronStrategy",
]
