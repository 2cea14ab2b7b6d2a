"""The Trainer's half: `Trainer(accelerator="neuron")` picks these strategies and this precision plugin, on the XLA
or the native backend; the callbacks make compilation observable and the progress bar host-sync free."""

from lightning_trn.pytorch.precision import NeuronPrecision
from lightning_trn.pytorch.strategies import NeuronDDPStrategy, SingleDeviceNeuronStrategy

__all__ = ["NeuronDDPStrategy", "NeuronPrecision", "SingleDeviceNeuronStrategy"]
