"""`NeuronDDPStrategy`: data-parallel training, one process per NeuronCore, on one or several nodes.

Processes come from torchrun (also under SageMaker's `torch_distributed`), SLURM, or this strategy itself when the
script is started with plain `python train.py` (Lightning's `_SubprocessScriptLauncher`, as its DDP does). What it
shares with Fabric's strategy (process groups, collectives, gradient reduction) is in `data_parallel.py`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_trn.core.data_parallel import DataParallelCore
from lightning_trn.core.strategy import CheckpointingPolicy
from lightning_trn.pytorch.strategies.mixin import NeuronStrategyMixin
from lightning_trn.pytorch.strategies.process_group import ProcessGroupStrategyMixin


class NeuronDDPStrategy(DataParallelCore, ProcessGroupStrategyMixin, NeuronStrategyMixin, ParallelStrategy):
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

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = default_pg_timeout,
        zero1: bool = False,
        state_dict_type: str = "full",
        activation_checkpointing_policy: Optional[CheckpointingPolicy] = None,
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

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        assert self.model is not None
        self._broadcast_module_states(self.model)
        for optimizer in self.optimizers:
            self._shard_optimizer(optimizer)
        self._after_setup(trainer)
