"""`lightning_trn.compile(module)`: `torch.compile` with the backend's compiler, the same call on both stacks.

On the native backend (TorchNeuron) it is `torch.compile(module, backend="neuron", fullgraph=..., dynamic=False)`:
graphs compiled by the Neuron compiler instead of op-by-op eager execution. On the XLA backend (torch-neuronx 2.9)
every training step is already traced and compiled as one graph, so the module is returned unchanged and a script
that calls it runs on Trn1 and Trn2 alike. Call it on the network inside the LightningModule (`self.net =
lightning_trn.compile(self.net)` in `__init__` or `configure_model`): `self.log` and the rest of `training_step`
stay outside the graph.
"""

from __future__ import annotations

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_trn.runtime import get_runtime


def compile(module: nn.Module, *, fullgraph: bool = True, dynamic: bool = False, mode: str | None = None) -> nn.Module:
    """Compile `module` for the Neuron backend in use (named, like `torch.compile`, over the builtin `compile`).

    Args:
        fullgraph: refuse graph breaks (AWS's recommendation: each break is a separate graph and a device round trip).
        dynamic: must stay False: TorchNeuron rejects dynamic shapes; each new input shape compiles its own graph
            (pad or bucket inputs to a few fixed shapes).
        mode: ignored by TorchNeuron's backend (a warning says so).

    Raises:
        ValueError: `dynamic=True`.
    """
    if dynamic:
        raise ValueError(
            "lightning_trn.compile(dynamic=True): TorchNeuron's `neuron` backend rejects dynamic shapes. Leave "
            "`dynamic=False`: each new input shape then compiles its own graph once, so pad inputs to fixed shapes "
            "(or a few buckets) and drop the last partial batch (`drop_last=True`)."
        )
    if mode is not None:
        rank_zero_warn(f"lightning_trn.compile(mode={mode!r}): Neuron's compilers ignore `mode`; it is not passed.")
    return get_runtime().compile(module, fullgraph=fullgraph)
