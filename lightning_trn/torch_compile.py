"""`lightning_trn.compile(module)`: `torch.compile` with the backend's compiler, the same call on both stacks.

On the native backend (TorchNeuron) it is `torch.compile(module, backend="neuron", fullgraph=..., dynamic=False)`:
graphs compiled by the Neuron compiler instead of op-by-op eager execution. On the XLA backend (torch-neuronx 2.9)
every training step is already traced and compiled as one graph, so the module is returned unchanged and a script
that calls it runs on Trn1 and Trn2 alike. Call it on the network inside the LightningModule (`self.net =
lightning_trn.compile(self.net)` in `__init__` or `configure_model`): `self.log` and the rest of `training_step`
stay outside the graph.

`lightning_trn.compile_blocks(blocks)` is the form for sharded models: each block (a transformer layer) compiled in
place, TorchTitan's `apply_compile`, between activation checkpointing and FSDP2 (docs/sharding.md, "Compiled blocks
under sharding").
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
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


def compile_blocks(blocks: Iterable[nn.Module], *, fullgraph: bool = True) -> None:
    """Compile each of `blocks` in place for the Neuron backend in use, TorchTitan's per-block `torch.compile`.

    Call it per model after tensor parallel and activation checkpointing and before FSDP2 (`fully_shard`), as
    TorchTitan's `parallelize_llama` does: each block is compiled with its checkpointing inside, and FSDP2's
    all-gather and reduce-scatter stay outside the graphs. Identical blocks share one graph (a model of 80 layers
    compiles about as often as one of 2). Compiled in place (`nn.Module.compile`), the blocks keep their class and
    their parameters' names, so checkpoints of compiled and uncompiled runs load into each other. On the native backend
    it is `block.compile(backend="neuron", fullgraph=..., dynamic=False)`; on the XLA backend, which compiles each
    step as one graph already, the blocks are left unchanged.

    Args:
        fullgraph: refuse graph breaks inside a block (AWS's recommendation, as in `compile`).
    """
    runtime = get_runtime()
    compiled = [runtime.compile_in_place(block, fullgraph=fullgraph) for block in blocks]  # all, not up to a False
    if not all(compiled):
        rank_zero_info(
            "lightning_trn.compile_blocks: the XLA backend already compiles each training step as one graph; the "
            "blocks are left unchanged."
        )
