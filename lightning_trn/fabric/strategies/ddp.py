"""`NeuronDDPStrategy` for Lightning Fabric: data-parallel, one process per NeuronCore, on one or several nodes.

`fabric.launch()` starts the other local processes itself when the script runs as `python train.py`; under torchrun
or SLURM the launcher's processes are used. Process groups, collectives and gradient reduction are the Trainer's
(`lightning_trn.core.data_parallel`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.nn import Module
from typing_extensions import override

from lightning_trn.core.data_parallel import DataParallelCore
from lightning_trn.fabric.strategies.mixin import NeuronFabricStrategyMixin


class _ReducedAtStep(_BackwardSyncControl):
    """Gradients are reduced once per optimizer step, never during backward: accumulation needs no skipping."""

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class NeuronDDPStrategy(DataParallelCore, NeuronFabricStrategyMixin, ParallelStrategy):
    """What `Fabric(accelerator="neuron", devices=N, num_nodes=M)` picks for N*M > 1 processes.

    Args:
        process_group_backend: `torch.distributed` backend of the default group; by default `xla` on Neuron with
            torch_xla, `gloo` on XLA:CPU, `neuron` on the native backend.
        timeout: timeout of the process groups: a rank waiting on a dead peer fails after at most this long.
        **kwargs: the arguments of Fabric's `ParallelStrategy`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _ReducedAtStep()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _set_world_ranks(self) -> None:
        """Fabric's connector calls it by this name."""
        self.set_world_ranks()

    @override
    def setup_module(self, module: Module) -> Module:
        """Start every rank from rank 0's weights; route torchmetrics' syncs through the collectives."""
        module = super().setup_module(module)
        self._broadcast_module_states(module)
        self._route_metric_syncs(module)
        return module
