"""`DataParallelCore`: the data-parallel logic shared by the Trainer's and Fabric's `NeuronDDPStrategy`.

One process per NeuronCore, from torchrun, SLURM or the strategy's own launcher (process groups:
`lightning_trn.core.parallel.process_group`); the model is not wrapped in torch's DistributedDataParallel: gradients are
averaged explicitly, bucketed, once per optimizer step, by the runtime's collectives (`xm` on Neuron with torch_xla,
gloo on host copies on XLA:CPU, the `neuron` process group on the device tensors natively). With `zero1=True`
(`"neuron_zero1"`) the optimizer state is sharded over the ranks (`lightning_trn.core.parallel.zero1`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO, atomic_local_save, to_portable
from lightning_trn.core.checkpoint.checkpointer import CheckpointLayout
from lightning_trn.core.parallel.process_group import ProcessGroup
from lightning_trn.core.parallel.zero1 import (
    SHARDED_MAIN_FILE,
    STATE_DICT_TYPES,
    Zero1Sharding,
    chunk_file,
    sharding_of,
    split_chunks,
)
from lightning_trn.core.precision import NeuronPrecisionCore
from lightning_trn.core.strategy import CoreMixinBase


class DataParallelCore(CoreMixinBase):
    """Mixed into the Trainer's and Fabric's `NeuronDDPStrategy`, before the API's Neuron strategy base; the process
    groups are a `ProcessGroup` the strategy holds.

    Args:
        process_group_backend: `torch.distributed` backend of the default group (`ProcessGroup`).
        timeout: timeout of the process groups: a rank waiting on a dead peer fails after at most this long.
        zero1: shard the optimizer state over the ranks (ZeRO-1, docs/memory.md): each rank keeps 1/N of it, gradients
            are reduce-scattered and the parameters all-gathered after each step. `strategy="neuron_zero1"`.
        state_dict_type: with `zero1`: "full" (default) checkpoints hold the whole optimizer state, gathered, in one
            file; "sharded" checkpoints are directories where each rank writes its own part (no gather).
    """

    strategy_name = "neuron_ddp"
    strategy_description = "Data-parallel over NeuronCores / XLA:CPU processes (lightning_trn)"
    zero1_strategy_name = "neuron_zero1"

    def __init__(
        self,
        *args: Any,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        zero1: bool = False,
        state_dict_type: str = "full",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, process_group=ProcessGroup(process_group_backend, timeout), **kwargs)
        if state_dict_type not in STATE_DICT_TYPES or (state_dict_type == "sharded" and not zero1):
            raise ValueError(
                f"state_dict_type={state_dict_type!r}: use 'full', or 'sharded' together with `zero1=True` (without "
                "ZeRO-1 every rank holds the same state, so there is nothing to shard)."
            )
        self.zero1 = zero1
        self.state_dict_type = state_dict_type

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        super().register_strategies(strategy_registry)
        strategy_registry.register(
            cls.zero1_strategy_name,
            cls,
            zero1=True,
            description="Data-parallel with ZeRO-1 sharded optimizer state (lightning_trn)",
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """The API's load (the Trainer's and Fabric's differ in their arguments); with ZeRO-1 the checkpoint IO reads
        a sharded directory as this rank's optimizer chunks only (`NeuronCheckpointIO.reading_shard`)."""
        io = self.checkpoint_io
        if not (self.zero1 and isinstance(io, NeuronCheckpointIO)):
            return super().load_checkpoint(*args, **kwargs)
        with io.reading_shard(self.global_rank, self.world_size):
            return super().load_checkpoint(*args, **kwargs)

    def _broadcast_weights(self, model: Module) -> None:
        """Start every rank from rank 0's parameters and buffers, whatever each process's seed."""
        tensors = [t for t in (*model.parameters(), *model.buffers()) if t.numel()]
        if tensors:
            self.collectives.broadcast_(tensors, src=0)

    def _shard_optimizer(self, optimizer: Optimizer) -> None:
        """With `zero1=True`: shard `optimizer`'s state over the ranks (once; after the weights were broadcast)."""
        if self.zero1 and sharding_of(optimizer) is None:
            host_collectives = self._process_group.host_collectives
            assert host_collectives is not None
            precision = self._neuron_precision()
            rounding = precision.round_parameter if isinstance(precision, NeuronPrecisionCore) else Tensor.to
            Zero1Sharding(
                optimizer,
                self.collectives,
                host_collectives,
                self.global_rank,
                rounding=rounding,
                state_dict_type=self.state_dict_type,
            )

    @override
    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Average the gradients over all ranks, once per optimizer step (after accumulation), bucketed; ZeRO-1:
        reduce-scatter them into this rank's chunks."""
        sharding = sharding_of(optimizer)
        if sharding is not None:
            sharding.reduce_gradients()
            return
        gradients = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if gradients:
            self.collectives.reduce_gradients(gradients)

    @override
    def _checkpoint_layout(self) -> CheckpointLayout:
        return CheckpointLayout.ZERO1 if self.state_dict_type == "sharded" else CheckpointLayout.FILE

    @override
    def _split_checkpoint(self, checkpoint: dict[str, Any], path: Any) -> tuple[dict[str, Any], Any]:
        """Sharded ZeRO-1 checkpoints are directories: this rank writes its chunks to `<path>/zero1-rank<r>.pt` now;
        rank 0 writes the rest to `<path>/checkpoint.pt` (`path`: the save's staging directory,
        `lightning_trn.core.checkpoint.sharded_save`)."""
        if not self._checkpoint_layout().sharded:
            return checkpoint, path
        checkpoint, chunks = split_chunks(checkpoint)
        atomic_local_save(to_portable({"chunks": chunks}), os.path.join(path, chunk_file(self.global_rank)))
        return checkpoint, os.path.join(path, SHARDED_MAIN_FILE)

    @override
    def _after_update(self, optimizer: Optimizer) -> None:
        """ZeRO-1: all-gather the updated chunks into the parameters."""
        sharding = sharding_of(optimizer)
        if sharding is not None:
            sharding.gather_parameters()
