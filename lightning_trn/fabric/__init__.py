"""Lightning Fabric on NeuronCores: after `import lightning_trn`, `Fabric(accelerator="neuron", devices=N,
num_nodes=M, precision=...)` picks these strategies and precision plugin, on the XLA or the native backend, as the
Trainer does (docs/fabric.md)."""

from lightning_trn.fabric.checkpoint import trainer_checkpoint
from lightning_trn.fabric.precision import NeuronPrecision
from lightning_trn.fabric.strategies import (
    NeuronDDPStrategy,
    NeuronFSDPStrategy,
    NeuronModelParallelStrategy,
    SingleDeviceNeuronStrategy,
)

__all__ = [
    "NeuronDDPStrategy",
    "NeuronFSDPStrategy",
    "NeuronModelParallelStrategy",
    "NeuronPrecision",
    "SingleDeviceNeuronStrategy",
    "trainer_checkpoint",
]
