"""Neuron training strategies."""

from lightning_trn.strategies.ddp import NeuronDDPStrategy
from lightning_trn.strategies.mixin import NeuronStrategyMixin
from lightning_trn.strategies.single_device import SingleDeviceNeuronStrategy

__all__ = ["NeuronDDPStrategy", "NeuronStrategyMixin", "SingleDeviceNeuronStrategy"]
