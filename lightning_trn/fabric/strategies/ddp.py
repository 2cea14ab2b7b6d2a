"""`NeuronDDPStrategy` for Lightning Fabric: data-parallel, one process per NeuronCore, on one or several nodes.

`fabric.launch()` starts the other local processes itself when the script runs as `python train.py`; under torchrun
or SLURM the launcher's processes are used. Process groups, collectives and gradient reduction are the Trainer's
(`lightning_trn.core.parallel.data_parallel`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trn.core.parallel.data_parallel import DataParallelCore
from lightning_trn.core.parallel.zero1 import optimizer_state, sharding_of
from lightning_trn.fabric.strategies.base import NeuronFabricStrategyBase


class _ReducedAtStep(_BackwardSyncControl):
    """Gradients are reduced once per optimizer step, never during backward: accumulation needs no skipping."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class NeuronDDPStrategy(DataParallelCore, NeuronFabricStrategyBase, ParallelStrategy):
    """What `Fabric(accelerator="neuron", devices=N, num_nodes=M)` picks for N*M > 1 processes.

    Args:
        process_group_backend: `torch.distributed` backend of the default group; by default `xla` on Neuron with
            torch_xla, `gloo` on XLA:CPU, `neuron` on the native backend.
        timeout: timeout of the process groups: a rank waiting on a dead peer fails after at most this long.
        zero1: shard the optimizer state over the ranks (ZeRO-1); `strategy="neuron_zero1"` sets it.
        state_dict_type: with `zero1`: "full" checkpoints (one file, the whole state) or "sharded" (a directory, one
            file per rank); docs/memory.md.
        activation_checkpointing_policy: checkpoint these submodules (e.g. `{Block}`), as Lightning's FSDPStrategy does.
        **kwargs: the arguments of Fabric's `ParallelStrategy`.
    """

    @override
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _ReducedAtStep()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _broadcast_module_states(self, module: Module) -> Module:
        """Start every rank from rank 0's weights."""
        self._broadcast_weights(module)
        return module

    def _shard_optimizer_state(self, optimizer: Optimizer) -> Optimizer:
        """With `zero1=True`, shard the optimizer's state over the ranks (`setup_module` broadcast the weights)."""
        self._shard_optimizer(optimizer)
        return optimizer

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip the gradients averaged over the ranks (reduced now rather than at the step), as a 1-process run would;
        ZeRO-1 clips by the norm over all ranks' chunks."""
        self._reduce_for_step(optimizer)
        sharding = sharding_of(optimizer)
        if sharding is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        return sharding.clip_grad_norm_(float(max_norm), float(norm_type), error_if_nonfinite)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """What `fabric.save` writes of `optimizer`: with ZeRO-1 its chunks gathered to rank 0 here (a collective on
        every rank, `lightning_trn.core.parallel.zero1.optimizer_state`)."""
        return optimizer_state(optimizer)

    @override
    def load_checkpoint(self, path: _PATH, state: Any | None = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """After the load, ZeRO-1 optimizers take their chunks from the restored weights (and saved fp32 masters)."""
        remainder = super().load_checkpoint(path, state, *args, **kwargs)
        for obj in state.values() if isinstance(state, dict) else [state]:
            sharding = sharding_of(obj) if isinstance(obj, Optimizer) else None
            if sharding is not None:
                sharding.refresh()
        return remainder

    setup_module_steps = (
        *NeuronFabricStrategyBase.setup_module_steps,
        _broadcast_module_states,
        NeuronFabricStrategyBase._sync_torchmetrics,
    )
    setup_optimizer_steps = (*NeuronFabricStrategyBase.setup_optimizer_steps, _shard_optimizer_state)
