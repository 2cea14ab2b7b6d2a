"""Neuron training strategies."""

from lightning_trn.strategies.mixin import NeuronStrategyMixin
from lightning_trn.strategies.single_device import SingleDeviceNeuronStrategy

__all__ = ["NeuronStrategyMixin", "SingleDeviceNeuronStrategy"]
