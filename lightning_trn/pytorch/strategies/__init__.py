"""Neuron training strategies."""

from lightning_trn.pytorch.strategies.ddp import NeuronDDPStrategy
from lightning_trn.pytorch.strategies.mixin import NeuronStrategyMixin
from lightning_trn.pytorch.strategies.single_device import SingleDeviceNeuronStrategy

__all__ = ["NeuronDDPStrategy", "NeuronStrategyMixin", "SingleDeviceNeuronStrategy"]
