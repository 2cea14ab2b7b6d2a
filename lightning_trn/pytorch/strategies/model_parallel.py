"""`NeuronModelParallelStrategy`: Lightning's `ModelParallelStrategy` (FSDP2 + tensor parallel) on NeuronCores.

A LightningModule written for it on GPUs (`configure_model` with `fully_shard` / `parallelize_module` on
`self.device_mesh`, `trainer.init_module(empty_init=True)`, `loss_parallel`) runs with `accelerator="neuron"`:
`Trainer(accelerator="neuron", strategy=ModelParallelStrategy(...))` builds this strategy with the same arguments.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_trn.core.async_save import AsyncCheckpointer
from lightning_trn.core.distributed_checkpoint import LIGHTNING_META_FILE
from lightning_trn.core.dtensor_random import refuse_local_dropout
from lightning_trn.core.model_parallel import broadcast_replicated, check_mesh_sizes, check_shards_models, materialize
from lightning_trn.core.process_group import ProcessGroup
from lightning_trn.pytorch.strategies.base import NeuronStrategyBase

_BASE_STEPS = tuple(step for step in NeuronStrategyBase.setup_steps if step != "checkpoint_activations")


class NeuronModelParallelStrategy(NeuronStrategyBase, ModelParallelStrategy):
    """FSDP2 and tensor parallelism over NeuronCores (native backend), one process per NeuronCore: the process groups
    are lightning_trn's, the device mesh and everything sharded are Lightning's, on `neuron` devices.

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

    Raises:
        ValueError: on a backend that cannot shard models (XLA), at construction.
    """

    strategy_name = "neuron_model_parallel"
    strategy_description = "FSDP2 and tensor parallel over NeuronCores, native backend (lightning_trn)"
    #: the model is materialized first, once the checkpoint directories are known to be shared; activation
    #: checkpointing belongs in the user's `configure_model`
    setup_steps = (
        "probe_checkpoint_dirs",
        "materialize",
        *_BASE_STEPS,
        "broadcast_replicated",
        "refuse_local_dropout",
        "sync_torchmetrics",
        "agree_on_sigterm",
    )

    @override
    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        seed_checkpoint: str | Path | None = None,
    ) -> None:
        check_shards_models(self.runtime, type(self).__name__)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            process_group=ProcessGroup(process_group_backend, timeout),
        )
        self._seed_checkpoint = seed_checkpoint

    @override
    def _configure_launcher(self) -> None:
        """Called once the devices and nodes are known (at `Trainer(...)`): check the mesh fits."""
        check_mesh_sizes(self, self._data_parallel_size, self._tensor_parallel_size)
        super()._configure_launcher()

    @override
    def _saves_sharded(self) -> bool:
        return self._save_distributed_checkpoint

    @override
    def _writes_dcp_directories(self) -> bool:
        return self._save_distributed_checkpoint

    @override
    def _save_in_background(self, saver: AsyncCheckpointer, state: dict[str, Any], directory: str) -> None:
        """What Lightning's sharded save writes: the model's and the optimizers' sharded state dicts as DCP entries
        (`state_dict`, `optimizer_<i>`; here in the background), the rest of the checkpoint as `meta.pt` (rank 0)."""
        state = dict(state)
        optimizers = state.pop("optimizer_states", [])
        shards = {"state_dict": state.pop("state_dict"), **{f"optimizer_{i}": s for i, s in enumerate(optimizers)}}
        if self.global_rank == 0:
            torch.save(state, os.path.join(directory, LIGHTNING_META_FILE))
        saver.save(shards, directory)

    def _materialize(self, trainer: pl.Trainer) -> None:
        """A model built on the meta device gets the unsharded module's initial weights, or the seed checkpoint's
        (`materialize`), each rank only its shards."""
        assert self.model is not None
        materialize(self.model, self.root_device, self._seed_checkpoint)

    def _broadcast_replicated(self, trainer: pl.Trainer) -> None:
        """Replicated tensors are made equal to the first rank's (`broadcast_replicated`): what FSDP1's
        `sync_module_states=True` asked for, always."""
        assert self.model is not None
        if self.world_size > 1:
            broadcast_replicated(self.model, self.root_device)

    def _refuse_local_dropout(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        refuse_local_dropout(self.model, self)
