"""`NeuronModelParallelStrategy`: Lightning's `ModelParallelStrategy` (FSDP2 + tensor parallel) on NeuronCores.

A LightningModule written for it on GPUs (`configure_model` with `fully_shard` / `parallelize_module` on
`self.device_mesh`, `trainer.init_module(empty_init=True)`, `loss_parallel`) runs with `accelerator="neuron"`:
`Trainer(accelerator="neuron", strategy=ModelParallelStrategy(...))` builds this strategy with the same arguments.
Beyond Lightning's two dimensions the mesh may have HSDP replicas (`replicate_size`) and pipeline stages
(`pipeline_parallel_size`, `lightning_trn.core.parallel.pipeline`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trn.core.checkpoint.checkpointer import CheckpointLayout
from lightning_trn.core.checkpoint.distributed_checkpoint import LIGHTNING_META_FILE
from lightning_trn.core.parallel.context_parallel import ContextParallel
from lightning_trn.core.parallel.dtensor_random import refuse_local_dropout
from lightning_trn.core.parallel.model_parallel import (
    broadcast_replicated,
    check_replicated_sharding,
    check_shards_models,
    check_tensor_parallel_gradients,
    materialize,
    setup_outer_mesh,
)
from lightning_trn.core.parallel.parallel_dims import ParallelDims
from lightning_trn.core.parallel.pipeline import LossFn, Pipeline, Pipelining, refuse_evaluation
from lightning_trn.core.parallel.process_group import ProcessGroup
from lightning_trn.pytorch.strategies.base import NeuronStrategyBase

_BASE_STEPS = tuple(
    step for step in NeuronStrategyBase.setup_steps if step is not NeuronStrategyBase._checkpoint_activations
)


def _validates(trainer: pl.Trainer) -> bool:
    """Whether this fit will validate: the fit loop has loaded its validation loaders at `on_train_start` when an
    epoch checks validation, and the loop skips none but limits of 0 or no batches."""
    return trainer.val_dataloaders is not None and not trainer.fit_loop.epoch_loop.val_loop.skip


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
        seed_checkpoint: a directory written by `lightning_trn.core.parallel.model_parallel.write_seed_checkpoint` from
        the
            LightningModule: a model built on the meta device reads each rank's shards from it instead of drawing its
            initial weights on every rank's host.
        pipeline_parallel_size: ranks of a pipeline (stages of the model, split in `configure_model` with
            `lightning_trn.pipeline_split`); the mesh's outermost dimension, "pipeline_parallel".
        replicate_size: HSDP replicas: `fully_shard(..., mesh=self.device_mesh["replicate", "data_parallel"])`
            shards within a replica and reduces gradients over all of them.
        pipeline_schedule: "GPipe", "1F1B", "Interleaved1F1B" or "ZBVZeroBubble" (`torch.distributed.pipelining`).
        pipeline_microbatches: microbatches a batch is split into; None: the number of stages.
        pipeline_stages_per_rank: stages on each rank for the interleaved schedules.
        stage_transport: how stages exchange tensors: "broadcast" (2-rank broadcasts) or "send_recv"; None: the
            backend's point-to-point where it has it, else broadcasts.
        context_parallel_size: ranks each sequence is split over (`lightning_trn.core.parallel.context_parallel`):
            the batch Lightning hands `training_step`, `validation_step` and `test_step` is split along its sequence
            here (`predict_step` gets it whole); FSDP2 shards over data x context (`ParallelDims.fsdp_mesh`).

    Raises:
        ValueError: on a backend that cannot shard models (XLA), at construction.
    """

    strategy_name = "neuron_model_parallel"
    strategy_description = "FSDP2 and tensor parallel over NeuronCores, native backend (lightning_trn)"

    @override
    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        seed_checkpoint: str | Path | None = None,
        pipeline_parallel_size: int = 1,
        replicate_size: int = 1,
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_stages_per_rank: int = 2,
        stage_transport: str | None = None,
        context_parallel_size: int = 1,
    ) -> None:
        check_shards_models(self.runtime, type(self).__name__, pipeline_parallel_size)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            process_group=ProcessGroup(process_group_backend, timeout),
        )
        self._seed_checkpoint = seed_checkpoint
        #: the mesh's sizes, the one owner of them (Lightning's `_data_parallel_size` and `_tensor_parallel_size`
        #: are what its own setup reads)
        self._parallel_dims = ParallelDims(
            pipeline_parallel_size, replicate_size, data_parallel_size, tensor_parallel_size, context_parallel_size
        )
        #: the split of each step's sequences (set up with the mesh)
        self._context_parallel = ContextParallel()
        self._checked_tensor_parallel = False
        self._pipelining = Pipelining(
            self._parallel_dims.pipeline_parallel,
            pipeline_schedule,
            pipeline_microbatches,
            pipeline_stages_per_rank,
            stage_transport,
            self.runtime.point_to_point,
        )

    @property
    def parallel_dims(self) -> ParallelDims:
        """The mesh's sizes as given ("auto" resolved at setup)."""
        return self._parallel_dims

    @property
    def pipeline_parallel_size(self) -> int:
        return self._parallel_dims.pipeline_parallel

    @override
    def _configure_launcher(self) -> None:
        """Called once the devices and nodes are known (at `Trainer(...)`): check the mesh fits."""
        self._parallel_dims.check(type(self).__name__, self.num_nodes, self.num_processes)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        """Lightning's, with the N-D mesh where there are pipeline stages or replicas (`setup_outer_mesh`)."""
        setup_outer_mesh(self, super().setup_environment, self._parallel_dims, self._pipelining, self.precision_plugin)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        self._context_parallel = ContextParallel.of(self._device_mesh)

    @property
    def context_parallel(self) -> ContextParallel:
        """The split of each step's sequences over the context-parallel ranks (size 1: none)."""
        return self._context_parallel

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, on this rank's part of the batch's sequences under context parallelism (`ContextParallel.step`:
        the one place the batch is split)."""
        batch, *rest = args
        with self._context_parallel.step(batch) as local:
            return super().training_step(local, *rest, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """As `training_step`."""
        batch, *rest = args
        with self._context_parallel.step(batch) as local:
            return super().validation_step(local, *rest, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """As `training_step`."""
        batch, *rest = args
        with self._context_parallel.step(batch) as local:
            return super().test_step(local, *rest, **kwargs)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel ranks are the replicas and the shards together; a pipeline's stages read the same
        batch."""
        return ParallelDims.sampler_kwargs(self.device_mesh)

    def _pipeline_for(self, model: Module, loss_fn: LossFn, layers: str | None) -> Pipeline:
        """`lightning_trn.pipeline_split` with this strategy: the loss of each microbatch divided by the gradient
        accumulation, as Lightning divides the loss it backpropagates."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        accumulation = trainer.accumulate_grad_batches if trainer is not None else 1
        return self._pipelining.split(model, loss_fn, layers, loss_scale=lambda: 1.0 / accumulation)

    @override
    def on_train_start(self) -> None:
        """Before the first batch: the training loader's batches are checked to divide into the pipeline's
        microbatches (`Pipelining.check_loader`), and a fit that will validate is refused under a V schedule
        (`refuse_evaluation`), rather than at its first validation."""
        super().on_train_start()
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        self._pipelining.check_loader(trainer.train_dataloader)
        if self.pipeline_parallel_size > 1 and _validates(trainer):
            refuse_evaluation(self._pipelining.schedule)

    @override
    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Once the step's gradients are complete, before clipping: the copies of a weight tied across pipeline
        stages take their summed gradient (`Pipelining.reduce_tied_gradients`); at the first step, whole
        parameters of tensor-parallel blocks are checked (`check_tensor_parallel_gradients`)."""
        self._pipelining.reduce_tied_gradients()
        if not self._checked_tensor_parallel:
            assert self.model is not None
            check_tensor_parallel_gradients(self.model, self.device_mesh)
            self._checked_tensor_parallel = True

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Lightning's, with the param groups of every pipeline stage in a sharded checkpoint
        (`Pipelining.complete_param_groups`)."""
        state = super().optimizer_state(optimizer)
        if not self._save_distributed_checkpoint:
            return state
        assert self.model is not None
        return self._pipelining.complete_param_groups(state, self.model)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward (under context parallelism with the step's split attention, which recomputed
        layers need), except for a batch whose pipeline step ran its backward already: then only the hooks around
        it run."""
        if not self._pipelining.take_backward():
            with self._context_parallel.backward():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def _checkpoint_layout(self) -> CheckpointLayout:
        return CheckpointLayout.DCP if self._save_distributed_checkpoint else CheckpointLayout.FILE

    @override
    def _checkpoint_meta(self, state: dict[str, Any]) -> dict[str, Any]:
        """Lightning's `meta.pt`: every entry but the model's and the optimizers' sharded state dicts."""
        return {key: value for key, value in state.items() if key not in ("state_dict", "optimizer_states")}

    @override
    def _save_in_background(self, state: dict[str, Any], directory: str) -> None:
        """What Lightning's sharded save writes: the model's and the optimizers' sharded state dicts as DCP entries
        (`state_dict`, `optimizer_<i>`; here in the background), the rest of the checkpoint as `meta.pt` (rank 0)."""
        optimizers = state.get("optimizer_states", [])
        shards = {"state_dict": state["state_dict"], **{f"optimizer_{i}": s for i, s in enumerate(optimizers)}}
        if self.global_rank == 0:
            torch.save(self._checkpoint_meta(state), os.path.join(directory, LIGHTNING_META_FILE))
        self._checkpointer.write_in_background(shards, directory)

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
            broadcast_replicated(self.model, self.root_device, *self._pipelining.stage_peers)

    def _check_replicated_sharding(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        check_replicated_sharding(self.model, self.device_mesh)

    def _refuse_local_dropout(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        refuse_local_dropout(self.model, self)

    #: the model is materialized first, once the checkpoint directories are known to be shared; activation
    #: checkpointing belongs in the user's `configure_model`
    setup_steps = (
        NeuronStrategyBase._probe_checkpoint_dirs,
        _materialize,
        *_BASE_STEPS,
        _broadcast_replicated,
        _check_replicated_sharding,
        _refuse_local_dropout,
        NeuronStrategyBase._sync_torchmetrics,
        NeuronStrategyBase._agree_on_sigterm,
    )
