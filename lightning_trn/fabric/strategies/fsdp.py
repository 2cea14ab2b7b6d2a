"""Fabric's `NeuronFSDPStrategy`: Lightning's `FSDPStrategy` arguments on NeuronCores (native backend), served by
FSDP2: `Fabric(accelerator="neuron", strategy="fsdp")` or `strategy=FSDPStrategy(auto_wrap_policy={Block}, ...)`;
`fabric.setup_module` shards the module (`lightning_trn.core.parallel.fsdp`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from lightning_trn.core.parallel.fsdp import FSDPSharding
from lightning_trn.core.strategy import CheckpointingPolicy
from lightning_trn.fabric.strategies.model_parallel import NeuronModelParallelStrategy


class NeuronFSDPStrategy(NeuronModelParallelStrategy):
    """FSDP over NeuronCores with FSDP2, one process per NeuronCore; the arguments are those of Lightning's
    `FSDPStrategy`: as the Trainer's `NeuronFSDPStrategy`, whose `parallelize_fn` is the sharding."""

    strategy_name = "neuron_fsdp"
    strategy_description = "FSDP (served by FSDP2) over NeuronCores, native backend (lightning_trn)"

    @override
    def __init__(
        self,
        activation_checkpointing_policy: CheckpointingPolicy | None = None,
        state_dict_type: str = "sharded",
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        self._fsdp = FSDPSharding(**kwargs)
        super().__init__(
            self._shard_on_mesh,
            save_distributed_checkpoint=FSDPSharding.saves_distributed_checkpoint(state_dict_type),
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._activation_checkpointing_policy = activation_checkpointing_policy

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank is data-parallel (with a hybrid mesh too)."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        """The mesh of the sharding strategy, checked as the model-parallel one."""
        self._data_parallel_size, self._tensor_parallel_size = self._fsdp.mesh_sizes(self.num_nodes, self.num_processes)
        super()._configure_launcher()

    def _shard_on_mesh(self, module: Module, device_mesh: Any) -> Module:
        """The `parallelize_fn`: `fully_shard` by the FSDP arguments (`setup_module_steps` checkpointed the
        activations before)."""
        return self._fsdp.shard(module, device_mesh, getattr(self.precision, "precision", None))
