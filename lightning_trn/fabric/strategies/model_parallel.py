"""Fabric's `NeuronModelParallelStrategy`: Lightning's `ModelParallelStrategy` (FSDP2 + tensor parallel) on
NeuronCores: `Fabric(accelerator="neuron", strategy=ModelParallelStrategy(parallelize_fn, ...))` builds it with the
same arguments, and `fabric.setup` runs `parallelize_fn(module, device_mesh)` on the `neuron` device mesh."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer

from lightning_trn.core.model_parallel import ModelParallelCore, materialize
from lightning_trn.fabric.strategies.mixin import NeuronFabricStrategyMixin


class NeuronModelParallelStrategy(ModelParallelCore, NeuronFabricStrategyMixin, ModelParallelStrategy):
    """FSDP2 and tensor parallelism over NeuronCores (native backend), one process per NeuronCore.

    Args:
        parallelize_fn: `(module, device_mesh) -> module`, applying `fully_shard` / `parallelize_module`.
        data_parallel_size: devices in a data-parallel (FSDP) group; "auto": the number of nodes.
        tensor_parallel_size: devices in a tensor-parallel group; "auto": the devices of one node.
        save_distributed_checkpoint: True: torch.distributed.checkpoint directories, each rank writing its shards;
            False: one file of CPU tensors assembled on rank 0.
        process_group_backend: `torch.distributed` backend of the default group (`neuron`).
        timeout: timeout of the process groups.
    """

    saves_stateful_objects = True

    def __init__(
        self,
        parallelize_fn: Callable[[Any, Any], Module],
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = default_pg_timeout,
    ) -> None:
        super().__init__(
            parallelize_fn=self._parallelize_and_materialize,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._user_parallelize_fn = parallelize_fn

    def _parallelize_and_materialize(self, module: Module, device_mesh: Any) -> Module:
        """The user's `parallelize_fn`, then a module built on the meta device gets the unsharded module's initial
        weights (`lightning_trn.core.model_parallel.materialize`)."""
        module = self._user_parallelize_fn(module, device_mesh)
        if isinstance(module, Module):
            materialize(module, self.root_device)
        return module

    def _set_world_ranks(self) -> None:
        """Fabric's connector calls it by this name."""
        self.set_world_ranks()

    def module_to_device(self, module: Module) -> None:
        """Fabric moves the module before `setup_module`: a module built on the host goes to the device whole (what
        `parallelize_fn` leaves unsharded is on the device too); one on the meta device is materialized after it."""
        if not _has_meta_device_parameters_or_buffers(module):
            super().module_to_device(module)

    def setup_module(self, module: Module) -> Module:
        """Lightning's: `parallelize_fn` on the device mesh, meta tensors materialized on the device; torchmetrics'
        syncs routed through the collectives."""
        module = super().setup_module(module)
        self._route_metric_syncs(module)
        return module

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[Module, list[Optimizer], Optional[Any]]:
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
