"""Precision and checkpoint-IO plugins for the Neuron strategies."""

from lightning_trn.plugins.io import NeuronCheckpointIO
from lightning_trn.plugins.precision import NeuronPrecision

__all__ = ["NeuronCheckpointIO", "NeuronPrecision"]
