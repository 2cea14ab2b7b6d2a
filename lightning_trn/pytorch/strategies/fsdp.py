"""`NeuronFSDPStrategy`: Lightning's `FSDPStrategy` arguments on NeuronCores (native backend), served by FSDP2.

`Trainer(accelerator="neuron", strategy="fsdp")` or `strategy=FSDPStrategy(auto_wrap_policy={Block}, ...)` builds it
with the same arguments, so a Lightning FSDP script runs with only the accelerator changed. It is
`NeuronModelParallelStrategy` with the sharding written for you: the submodules `auto_wrap_policy` selects, then the
LightningModule, are `fully_shard`-ed when the model is configured (`lightning_trn.core.parallel.fsdp`). A module built
on the host is sharded on its meta twin, and each rank copies only its shards of the host values to the device at setup.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_trn.core.parallel.fsdp import FSDPSharding
from lightning_trn.core.parallel.model_parallel import HostValues, host_values_to_meta, materialize
from lightning_trn.core.strategy import CheckpointingPolicy
from lightning_trn.pytorch.strategies.base import Step
from lightning_trn.pytorch.strategies.model_parallel import NeuronModelParallelStrategy


class NeuronFSDPStrategy(NeuronModelParallelStrategy):
    """FSDP over NeuronCores with FSDP2, one process per NeuronCore; the arguments are those of Lightning's
    `FSDPStrategy`.

    Args:
        activation_checkpointing_policy: the submodules whose activations are recomputed (as Lightning's).
        state_dict_type: "sharded" (default): torch.distributed.checkpoint directories, each rank writing its
            shards; "full": one file of CPU tensors assembled on rank 0.
        process_group_backend: `torch.distributed` backend of the default group (`neuron`).
        timeout: timeout of the process groups.
        **kwargs: the sharding arguments (`auto_wrap_policy`, `sharding_strategy`, `cpu_offload`, `mixed_precision`,
            `device_mesh`, FSDP1's other options): `lightning_trn.core.parallel.fsdp.FSDPSharding`.
    """

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
            save_distributed_checkpoint=FSDPSharding.saves_distributed_checkpoint(state_dict_type),
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._activation_checkpointing_policy = activation_checkpointing_policy
        #: the host-built module's values, from its sharding (in `configure_model`) to `_materialize` (in `setup`)
        self._host_values: HostValues = {}

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

    @override
    def connect(self, model: pl.LightningModule) -> None:
        """The LightningModule's `configure_model` becomes `configure_model_steps` (its own first): set on this model
        object until teardown."""
        super().connect(model)
        self._users_configure_model = model.configure_model

        def configure_model() -> None:
            self._run_steps(self.configure_model_steps, model.trainer)

        # replaced on this model object only (the docstring): the class's method stays as it is
        model.configure_model = configure_model  # type: ignore[method-assign]  # see above

    def _user_configure_model(self, trainer: pl.Trainer) -> None:
        self._users_configure_model()

    def _apply_sharding(self, trainer: pl.Trainer) -> None:
        """`fully_shard` the LightningModule's meta twin: its host tensors go to the meta device first, their values
        kept for `_materialize` (`host_values_to_meta`). Sharding the host-built module itself would move all of it
        to the device (FSDP2 moves a unit's tensors whole, then shards them)."""
        assert self.model is not None
        self._host_values = host_values_to_meta(self.model)
        self._shard(self.model)

    @override
    def _materialize(self, trainer: pl.Trainer) -> None:
        """As the model-parallel strategy's, and a host-built module's values reach the device too, each rank
        copying only its shards of them (`materialize`)."""
        assert self.model is not None
        host_values, self._host_values = self._host_values, {}
        materialize(self.model, self.root_device, self._seed_checkpoint, host_values)

    def _shard(self, module: Any) -> Any:
        """`fully_shard` `module` by the FSDP arguments, on the strategy's mesh."""
        return self._fsdp.shard(module, self.device_mesh, getattr(self.precision_plugin, "precision", None))

    @override
    def teardown(self) -> None:
        module = self._lightning_module
        if module is not None:
            module.__dict__.pop("configure_model", None)
        super().teardown()

    #: what runs as the LightningModule's `configure_model`, where Lightning calls it, once the mesh exists
    configure_model_steps: tuple[Step, ...] = (
        _user_configure_model,
        NeuronModelParallelStrategy._checkpoint_activations,
        _apply_sharding,
    )
