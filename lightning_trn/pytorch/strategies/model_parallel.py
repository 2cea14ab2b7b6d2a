"""`NeuronModelParallelStrategy`: Lightning's `ModelParallelStrategy` (FSDP2 + tensor parallel) on NeuronCores.

A LightningModule written for it on GPUs (`configure_model` with `fully_shard` / `parallelize_module` on
`self.device_mesh`, `trainer.init_module(empty_init=True)`, `loss_parallel`) runs with `accelerator="neuron"`:
`Trainer(accelerator="neuron", strategy=ModelParallelStrategy(...))` builds this strategy with the same arguments.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_trn.core.dtensor_random import refuse_local_dropout
from lightning_trn.core.model_parallel import ModelParallelCore, materialize
from lightning_trn.pytorch.strategies.mixin import NeuronStrategyMixin
from lightning_trn.pytorch.strategies.process_group import ProcessGroupStrategyMixin


class NeuronModelParallelStrategy(
    ModelParallelCore, ProcessGroupStrategyMixin, NeuronStrategyMixin, ModelParallelStrategy
):
    """FSDP2 and tensor parallelism over NeuronCores (native backend), one process per NeuronCore.

    Args:
        data_parallel_size: devices in a data-parallel (FSDP) group; "auto": the number of nodes.
        tensor_parallel_size: devices in a tensor-parallel group; "auto": the devices of one node.
        save_distributed_checkpoint: True: checkpoints are torch.distributed.checkpoint directories, each rank
            writing its shards (they resume on another world size and mesh; `python -m lightning_trn.consolidate`
            makes one file of them); False: one file of CPU tensors assembled on rank 0.
        process_group_backend: `torch.distributed` backend of the default group (`neuron`).
        timeout: timeout of the process groups.
        seed_checkpoint: a directory written by `lightning_trn.core.model_parallel.write_seed_checkpoint` from the
            LightningModule: a model built on the meta device reads each rank's shards from it instead of drawing its
            initial weights on every rank's host.
    """

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = default_pg_timeout,
        seed_checkpoint: Optional[Union[str, Path]] = None,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._seed_checkpoint = seed_checkpoint

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """A model built on the meta device gets the unsharded module's initial weights, or the seed checkpoint's
        (`materialize`), then Lightning's setup; replicated tensors are then made equal to the first rank's
        (`broadcast_replicated`)."""
        assert self.model is not None
        materialize(self.model, self.root_device, self._seed_checkpoint)
        super().setup(trainer)
        self._broadcast_replicated(self.model)
        refuse_local_dropout(self.model, self)
        self._after_setup(trainer)
