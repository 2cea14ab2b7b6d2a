"""Fabric's `NeuronModelParallelStrategy`: Lightning's `ModelParallelStrategy` (FSDP2 + tensor parallel) on
NeuronCores: `Fabric(accelerator="neuron", strategy=ModelParallelStrategy(parallelize_fn, ...))` builds it with the
same arguments, and `fabric.setup` runs `parallelize_fn(module, device_mesh)` on the `neuron` device mesh. Beyond
Lightning's two dimensions the mesh may have HSDP replicas (`replicate_size`) and pipeline stages
(`pipeline_parallel_size`): `parallelize_fn` splits the model with `lightning_trn.pipeline_split(module, loss_fn,
fabric.strategy)` and the loop calls the returned `Pipeline`'s `step` (`lightning_trn.core.parallel.pipeline`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.model_parallel import _has_dtensor_modules
from lightning.fabric.utilities.types import _Stateful
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
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
    host_values_to_meta,
    materialize,
    setup_outer_mesh,
)
from lightning_trn.core.parallel.parallel_dims import ParallelDims
from lightning_trn.core.parallel.pipeline import LossFn, Pipeline, Pipelining
from lightning_trn.core.parallel.process_group import ProcessGroup
from lightning_trn.fabric.strategies.base import NeuronFabricStrategyBase
from lightning_trn.hooks import registry as lightning_hooks


class NeuronModelParallelStrategy(NeuronFabricStrategyBase, ModelParallelStrategy):
    """FSDP2 and tensor parallelism over NeuronCores (native backend), one process per NeuronCore.

    Args:
        parallelize_fn: `(module, device_mesh) -> module`, applying `fully_shard` / `parallelize_module`.
        data_parallel_size: devices in a data-parallel (FSDP) group; "auto": the number of nodes.
        tensor_parallel_size: devices in a tensor-parallel group; "auto": the devices of one node.
        save_distributed_checkpoint: True: torch.distributed.checkpoint directories, each rank writing its shards;
            False: one file of CPU tensors assembled on rank 0.
        process_group_backend: `torch.distributed` backend of the default group (`neuron`).
        timeout: timeout of the process groups.
        seed_checkpoint: a directory written by `lightning_trn.core.parallel.model_parallel.write_seed_checkpoint`: a
        model
            built on the meta device reads each rank's shards from it instead of drawing its initial weights on
            every rank's host.
        pipeline_parallel_size, replicate_size, pipeline_schedule, pipeline_microbatches, pipeline_stages_per_rank,
            stage_transport, context_parallel_size: as the Trainer's `NeuronModelParallelStrategy`; under
            context parallelism the loop splits each batch itself, around its forward:
            `with fabric.strategy.context_parallel.step(batch) as batch: loss = model(batch)`.

    Raises:
        ValueError: on a backend that cannot shard models (XLA), at construction.
    """

    strategy_name = "neuron_model_parallel"
    strategy_description = "FSDP2 and tensor parallel over NeuronCores, native backend (lightning_trn)"
    saves_stateful_objects = True

    @override
    def __init__(
        self,
        parallelize_fn: Callable[[Any, Any], Module],
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
            parallelize_fn=self._parallelize_and_materialize,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            process_group=ProcessGroup(process_group_backend, timeout),
        )
        self._user_parallelize_fn = parallelize_fn
        self._seed_checkpoint = seed_checkpoint
        #: the mesh's sizes, the one owner of them (Lightning's `_data_parallel_size` and `_tensor_parallel_size`
        #: are what its own setup reads)
        self._parallel_dims = ParallelDims(
            pipeline_parallel_size, replicate_size, data_parallel_size, tensor_parallel_size, context_parallel_size
        )
        #: the split of each step's sequences (set up with the mesh)
        self._context_parallel = ContextParallel()
        self._checked_tensor_parallel = False
        #: the module `setup_module` sharded (Fabric's strategies hold none)
        self._module: Module | None = None
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
    def setup_environment(self) -> None:
        """Lightning's, with the N-D mesh where there are pipeline stages or replicas (`setup_outer_mesh`)."""
        setup_outer_mesh(self, super().setup_environment, self._parallel_dims, self._pipelining, self.precision)
        self._context_parallel = ContextParallel.of(self.device_mesh)

    @property
    def context_parallel(self) -> ContextParallel:
        """The split of a batch's sequences over the context-parallel ranks (size 1: none): the loop enters its
        `step(batch)` around the forward."""
        return self._context_parallel

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel ranks are the replicas and the shards together; a pipeline's stages read the same
        batch."""
        return ParallelDims.sampler_kwargs(self.device_mesh)

    def _pipeline_for(self, model: Module, loss_fn: LossFn, layers: str | None) -> Pipeline:
        """`lightning_trn.pipeline_split` with this strategy (a Fabric loop divides its loss for accumulation
        itself, in `loss_fn`)."""
        return self._pipelining.split(model, loss_fn, layers)

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """`fabric.backward`, except for a loss whose pipeline step ran its backward already: then only the
        precision's hooks around it run, so one loop serves with and without stages."""
        if not self._pipelining.take_backward():
            super().backward(tensor, module, *args, **kwargs)
            return
        self.precision.pre_backward(tensor, module)
        self.precision.post_backward(tensor, module)

    @override
    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Before clipping or the update, once per step: the copies of a weight tied across pipeline stages take
        their summed gradient (`Pipelining.reduce_tied_gradients`); at the first step, whole
        parameters of tensor-parallel blocks are checked (`check_tensor_parallel_gradients`)."""
        self._pipelining.reduce_tied_gradients()
        if not self._checked_tensor_parallel and self._module is not None:
            check_tensor_parallel_gradients(self._module, self.device_mesh)
            self._checked_tensor_parallel = True

    def _parallelize_and_materialize(self, module: Module, device_mesh: Any) -> Module:
        """The user's `parallelize_fn` on the module's meta twin, then each rank's shards (and what `parallelize_fn`
        left unsharded) go to the device: the values the module was built with on the host, or for a module built on
        the meta device the unsharded module's initial weights
        (`lightning_trn.core.parallel.model_parallel.materialize`). Replicated tensors are then made equal to the first
        rank's (`broadcast_replicated`)."""
        host_values = host_values_to_meta(module)
        module = self._user_parallelize_fn(module, device_mesh)
        if isinstance(module, Module):
            materialize(module, self.root_device, self._seed_checkpoint, host_values)
            if self.world_size > 1:  # what FSDP1's `sync_module_states=True` asked for, always
                broadcast_replicated(module, self.root_device, *self._pipelining.stage_peers)
            check_replicated_sharding(module, device_mesh)
            self._module = module
            refuse_local_dropout(module, self)
        # random ops on the sharded module's DTensors (`init_weights()` after `setup`): the `neuron` rule from here
        # on; Fabric has no teardown to put torch's back at, and the rule leaves other devices' meshes to torch
        lightning_hooks.acquire(lightning_hooks.DTENSOR_RANDOM_HOOKS)
        return module

    @override
    def _configure_launcher(self) -> None:
        """Called once the devices and nodes are known (at `Fabric(...)`): check the mesh fits."""
        self._parallel_dims.check(type(self).__name__, self.num_nodes, self.num_processes)
        super()._configure_launcher()

    @override
    def _checkpoint_layout(self) -> CheckpointLayout:
        return CheckpointLayout.DCP if self._save_distributed_checkpoint else CheckpointLayout.FILE

    @override
    def _save_in_background(self, state: dict[str, Any], directory: str) -> None:
        """What Lightning's sharded save writes: the sharded model's and the optimizers' state dicts (host tensors,
        optimizer states keyed by parameter name) as DCP entries under their keys (here in the background), every
        other entry of `state` in `meta.pt` (rank 0)."""
        modules = [obj for obj in state.values() if isinstance(obj, Module) and _has_dtensor_modules(obj)]
        if len(modules) != 1:
            raise ValueError(
                f"A sharded checkpoint holds exactly one sharded model; `state` holds {len(modules)}: save each "
                "model with its own `fabric.save` call and path."
            )
        options = StateDictOptions(cpu_offload=True)
        shards: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                shards[key] = get_model_state_dict(obj, options=options)
            elif isinstance(obj, Optimizer):
                optimizer_state = get_optimizer_state_dict(modules[0], obj, options=options)
                shards[key] = self._pipelining.complete_param_groups(optimizer_state, modules[0])
            else:
                meta[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        if self.global_rank == 0:
            torch.save(meta, os.path.join(directory, LIGHTNING_META_FILE))
        self._checkpointer.write_in_background(shards, directory)

    @override
    def module_to_device(self, module: Module) -> None:
        """Nothing before `setup_module` (as Lightning's): a module built on the host is sharded first, so only
        shards reach the device."""

    def _move_remaining_to_device(self, module: Module) -> Module:
        """What `parallelize_fn` left on the host (torchmetrics' states) moves, keeping ties."""
        super().module_to_device(module)
        return module

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        """`fabric.setup(model, optimizer)`: refused when the optimizer holds parameters that sharding replaced
        (it would update tensors the model no longer uses, silently)."""
        module = self.setup_module(module)
        current = {id(parameter) for parameter in module.parameters()}
        held = [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
        if any(id(parameter) not in current for parameter in held):
            raise RuntimeError(
                "The optimizer was created before the model was sharded: `parallelize_fn` replaces the parameters "
                "with DTensors, so it would update tensors the model no longer uses. Set up the model first, then "
                "create the optimizer from its parameters: `model = fabric.setup_module(model)`, "
                "`optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`."
            )
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    #: Lightning's `setup_module` runs `parallelize_fn` and materializes each rank's shards; what is left on the host
    #: (torchmetrics' states) moves after it
    setup_module_steps = (
        NeuronFabricStrategyBase._seed_device_rng,
        NeuronFabricStrategyBase._checkpoint_activations,
        NeuronFabricStrategyBase._lightning_setup_module,
        _move_remaining_to_device,
        NeuronFabricStrategyBase._sync_torchmetrics,
    )
