"""`NeuronDDPStrategy`: data-parallel training, one process per NeuronCore, on one or several nodes.

Processes come from torchrun (also under SageMaker's `torch_distributed`), SLURM, or this strategy itself when the
script is started with plain `python train.py` (Lightning's `_SubprocessScriptLauncher`, as its DDP does). What it
shares with Fabric's strategy (process groups, collectives, gradient reduction) is in `data_parallel.py`.
"""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trn.core.parallel.data_parallel import DataParallelCore
from lightning_trn.core.parallel.zero1 import optimizer_state
from lightning_trn.core.strategy import CheckpointingPolicy
from lightning_trn.pytorch.strategies.base import NeuronStrategyBase


class NeuronDDPStrategy(DataParallelCore, NeuronStrategyBase, ParallelStrategy):
    """What `Trainer(accelerator="neuron", devices=N, num_nodes=M)` picks for N*M > 1 processes.

    Args:
        process_group_backend: `torch.distributed` backend of the default group; by default `xla` on Neuron with
            torch_xla, `gloo` on XLA:CPU, `neuron` on the native backend. `xla` is refused on XLA:CPU, whose runtime
            collectives do not span processes.
        timeout: timeout of the process groups: a rank waiting on a dead peer fails after at most this long.
        zero1: shard the optimizer state over the ranks (ZeRO-1); `strategy="neuron_zero1"` sets it.
        state_dict_type: with `zero1`: "full" checkpoints (one file, the whole state) or "sharded" (a directory, one
            file per rank); docs/memory.md.
        activation_checkpointing_policy: checkpoint these submodules (e.g. `{Block}`), as Lightning's FSDPStrategy does.
    """

    @override
    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        zero1: bool = False,
        state_dict_type: str = "full",
        activation_checkpointing_policy: CheckpointingPolicy | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            zero1=zero1,
            state_dict_type=state_dict_type,
            activation_checkpointing_policy=activation_checkpointing_policy,
        )

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _broadcast_module_states(self, trainer: pl.Trainer) -> None:
        """Start every rank from rank 0's parameters and buffers."""
        assert self.model is not None
        self._broadcast_weights(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """What the checkpoint holds of `optimizer`: with ZeRO-1 its chunks gathered to rank 0 here (a collective on
        every rank, `lightning_trn.core.parallel.zero1.optimizer_state`), as Lightning consolidates torch's
        `ZeroRedundancyOptimizer`."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer_state(optimizer)

    def _shard_optimizer_state(self, trainer: pl.Trainer) -> None:
        """With `zero1=True`, shard each optimizer's state over the ranks (after the weights were broadcast)."""
        for optimizer in self.optimizers:
            self._shard_optimizer(optimizer)

    #: what `setup` does, in order (`_run_steps`)
    setup_steps = (
        NeuronStrategyBase._probe_checkpoint_dirs,
        *NeuronStrategyBase.setup_steps,
        _broadcast_module_states,
        _shard_optimizer_state,
        NeuronStrategyBase._sync_torchmetrics,
        NeuronStrategyBase._agree_on_sigterm,
    )
