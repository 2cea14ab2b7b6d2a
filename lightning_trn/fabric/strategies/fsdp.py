"""Fabric's `NeuronFSDPStrategy`: Lightning's `FSDPStrategy` arguments on NeuronCores (native backend), served by
FSDP2: `Fabric(accelerator="neuron", strategy="fsdp")` or `strategy=FSDPStrategy(auto_wrap_policy={Block}, ...)`;
`fabric.setup_module` shards the module (`lightning_trn.core.fsdp`)."""

from __future__ import annotations

from typing import Any

from torch.nn import Module

from lightning_trn.core.fsdp import FSDPCore
from lightning_trn.fabric.strategies.model_parallel import NeuronModelParallelStrategy


class NeuronFSDPStrategy(FSDPCore, NeuronModelParallelStrategy):
    """FSDP over NeuronCores with FSDP2, one process per NeuronCore; the arguments are those of Lightning's
    `FSDPStrategy` (`FSDPCore`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(self._shard_on_mesh, *args, **kwargs)

    def _shard_on_mesh(self, module: Module, device_mesh: Any) -> Module:
        """The `parallelize_fn`: the FSDP arguments applied to `module` (the strategy holds the mesh)."""
        return self._shard(module)
