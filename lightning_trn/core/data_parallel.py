"""`DataParallelCore`: the data-parallel logic shared by the Trainer's and Fabric's `NeuronDDPStrategy`.

One process per NeuronCore, from torchrun, SLURM or the strategy's own launcher; the model is not wrapped in torch's
DistributedDataParallel: gradients are averaged explicitly, bucketed, once per optimizer step, by the runtime's
collectives (`xm` on Neuron with torch_xla, gloo on host copies on XLA:CPU, the `neuron` process group on the device
tensors natively). Host-side objects, barriers and flags go over a gloo group. With `zero1=True` (`"neuron_zero1"`)
the optimizer state is sharded over the ranks (`lightning_trn.core.zero1`).
"""

from __future__ import annotations

import atexit
import functools
import os
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.exceptions import _augment_message
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer

from lightning_trn.core.checkpoint_io import atomic_local_save, to_portable
from lightning_trn.core.precision import NeuronPrecisionCore
from lightning_trn.core.zero1 import (
    SHARDED_MAIN_FILE, STATE_DICT_TYPES, Zero1Sharding, chunk_file, sharding_of, split_chunks,
)
from lightning_trn.runtime.collectives import Collectives, check_world_size
from lightning_trn.runtime.environment import EnvironmentPatch
from lightning_trn.runtime.host_collectives import HostCollectives


@functools.cache  # registered once per process
def destroy_process_groups_at_exit() -> None:
    """Destroy every process group while the interpreter is still whole, once, at exit.

    A gloo group left to the interpreter's teardown aborts the process now and then ("terminate called without an
    active exception", SIGABRT after a finished run: pytorch/pytorch#190489); Lightning destroys only NCCL groups at
    exit. Not at teardown: users run collectives after `fit` (`trainer.strategy.reduce`, `broadcast`).
    """
    atexit.register(_destroy_process_groups)


def _destroy_process_groups() -> None:
    if _distributed_is_initialized():
        dist.destroy_process_group()


def _is_world(group: Optional[Any]) -> bool:
    """Whether `group` means all processes: None (Lightning's Trainer) or `group.WORLD` (what Fabric passes)."""
    return group is None or group is dist.group.WORLD


class DataParallelCore:
    """Mixed into a Neuron strategy before Lightning's `ParallelStrategy` (the Trainer's or Fabric's).

    Args:
        process_group_backend: `torch.distributed` backend of the default group; by default `xla` on Neuron with
            torch_xla, `gloo` on XLA:CPU, `neuron` on the native backend. `xla` is refused on XLA:CPU, whose runtime
            collectives do not span processes.
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
        process_group_backend: Optional[str] = None,
        timeout: timedelta = default_pg_timeout,
        zero1: bool = False,
        state_dict_type: str = "full",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if state_dict_type not in STATE_DICT_TYPES or (state_dict_type == "sharded" and not zero1):
            raise ValueError(
                f"state_dict_type={state_dict_type!r}: use 'full', or 'sharded' together with `zero1=True` (without "
                "ZeRO-1 every rank holds the same state, so there is nothing to shard)."
            )
        self.zero1 = zero1
        self.state_dict_type = state_dict_type
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._env = EnvironmentPatch()
        self._collectives: Optional[Collectives] = None
        #: host tensors' reductions, over the host (gloo) group
        self._host_collectives: Optional[HostCollectives] = None
        #: gloo group for host-side objects, barriers and flags (None: the default group, already gloo)
        self._host_group: Optional[Any] = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        super().register_strategies(strategy_registry)  # type: ignore[misc]
        strategy_registry.register(
            cls.zero1_strategy_name, cls, zero1=True,
            description="Data-parallel with ZeRO-1 sharded optimizer state (lightning_trn)",
        )

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector for strategies it does not know: enables the DistributedSampler and
        `self.log(..., sync_dist=True)` reduction."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes (NeuronCores) per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def collectives(self) -> Collectives:
        """The cross-process collectives, available once the process group is set up."""
        if self._collectives is None:
            raise RuntimeError(f"{type(self).__name__}: collectives are used before `setup_environment`.")
        return self._collectives

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size (as Lightning's DDP does)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        """Claim this process's NeuronCore before the device is first touched, then join the process group."""
        assert self.cluster_environment is not None
        self.set_world_ranks()
        self.runtime.configure_process(
            global_rank=self.global_rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            local_world_size=self.num_processes,
            main_address=self.cluster_environment.main_address,
            env=self._env,
        )
        super().setup_environment()  # type: ignore[misc]
        self._setup_distributed()

    def _setup_distributed(self) -> None:
        reset_seed()
        runtime = self.runtime
        cross_process = runtime.supports_cross_process_collectives()
        backend = self._process_group_backend or runtime.process_group_backend()
        if backend == "xla" and not cross_process:
            raise RuntimeError(
                "process_group_backend='xla' on XLA:CPU: its runtime collectives do not span processes, so every "
                "process would only reduce with itself. Leave `process_group_backend` unset (gloo on host copies)."
            )
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        if not _distributed_is_initialized():  # a group the user initialised is the user's to destroy
            destroy_process_groups_at_exit()
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        world_size = dist.get_world_size()
        if world_size != self.world_size:
            raise RuntimeError(
                f"torch.distributed reports {world_size} processes but the strategy expects {self.world_size} "
                f"(num_nodes={self.num_nodes} x devices={self.num_processes}): match torchrun's --nnodes / "
                "--nproc_per_node (or SLURM's --nodes / --ntasks-per-node) to the Trainer's or Fabric's num_nodes / "
                "devices."
            )
        check_world_size(world_size, runtime.world_size() if cross_process else 1, cross_process)
        if backend != "gloo":
            self._host_group = dist.new_group(backend="gloo", timeout=self._timeout)
        self._collectives = runtime.collectives(world_size, self._host_group)
        self._host_collectives = HostCollectives(world_size, self._host_group)

    def _route_metric_syncs(self, model: Optional[Module]) -> None:
        """Give the module's torchmetrics metrics the collectives' gather where their default cannot work."""
        sync_fn = self.collectives.metric_sync_fn()
        if sync_fn is None or model is None:
            return
        try:
            from torchmetrics import Metric
        except ImportError:  # no torchmetrics, no metrics to sync
            return
        for module in model.modules():
            if isinstance(module, Metric) and module.dist_sync_fn is None:  # keep a gather the user chose
                module.dist_sync_fn = sync_fn

    def _broadcast_module_states(self, model: Module) -> None:
        """Start every rank from rank 0's parameters and buffers, whatever each process's seed."""
        tensors = [t for t in (*model.parameters(), *model.buffers()) if t.numel()]
        if tensors:
            self.collectives.broadcast_(tensors, src=0)

    def _shard_optimizer(self, optimizer: Optimizer) -> None:
        """With `zero1=True`: shard `optimizer`'s state over the ranks (once; after the weights were broadcast)."""
        if self.zero1 and sharding_of(optimizer) is None:
            assert self._host_collectives is not None
            precision = self._neuron_precision()  # type: ignore[attr-defined]
            rounding = precision.round_parameter if isinstance(precision, NeuronPrecisionCore) else Tensor.to
            Zero1Sharding(
                optimizer, self.collectives, self._host_collectives, self.global_rank,  # type: ignore[attr-defined]
                rounding=rounding, state_dict_type=self.state_dict_type,
            )

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

    def _split_checkpoint(self, checkpoint: dict[str, Any], path: Any) -> tuple[dict[str, Any], Any]:
        """Sharded ZeRO-1 checkpoints are directories: this rank writes its chunks to `<path>/zero1-rank<r>.pt` now;
        rank 0 writes the rest to `<path>/checkpoint.pt`."""
        if self.state_dict_type != "sharded":
            return checkpoint, path
        if "://" in str(path):
            raise ValueError(f"Sharded ZeRO-1 checkpoints are written to local directories, not {path}.")
        checkpoint, chunks = split_chunks(checkpoint)
        atomic_local_save(to_portable({"chunks": chunks}), os.path.join(path, chunk_file(self.global_rank)))
        return checkpoint, os.path.join(path, SHARDED_MAIN_FILE)

    def _after_update(self, optimizer: Optimizer) -> None:
        """ZeRO-1: all-gather the updated chunks into the parameters."""
        sharding = sharding_of(optimizer)
        if sharding is not None:
            sharding.gather_parameters()

    def all_reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        """Reduce `tensor` over all ranks with sum, mean ("avg"), max or min (a host tensor over the host group);
        non-tensors are returned unchanged."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        if not _is_world(group):
            raise ValueError(f"{type(self).__name__} reduces over all processes; `group` is not supported.")
        if tensor.device.type == "cpu":  # a host value (a loader length, a count): the host group, no device graph
            assert self._host_collectives is not None
            return self._host_collectives.all_reduce(tensor, reduce_op)
        return self.collectives.all_reduce(tensor, reduce_op)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Every rank's `tensor`, stacked along a new first dimension (gradients do not flow back through it)."""
        if not _distributed_is_initialized():
            return tensor.unsqueeze(0)
        if not _is_world(group) or sync_grads:
            raise ValueError(f"{type(self).__name__}.all_gather supports neither `group` nor `sync_grads=True`.")
        return self.collectives.all_gather(tensor)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Decided on the host group: no device tensor, so no device round trip (early stopping, checkpointing)."""
        if not _distributed_is_initialized():
            return decision
        votes = torch.tensor(int(decision))
        dist.all_reduce(votes, op=ReduceOp.SUM, group=self._host_group)
        return bool(votes == self.world_size) if all else bool(votes)

    def _gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, over the host group (no device memory)."""
        if not _distributed_is_initialized():
            return [obj]
        gathered: list[Any] = [None] * self.world_size  # type: ignore[attr-defined]
        dist.all_gather_object(gathered, obj, group=self._host_group)
        return gathered

    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier(group=self._host_group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=self._host_group)
        return objects[0]

    def _explain_failure(self, exception: BaseException) -> None:
        """Say what a failed collective usually means: another rank died or stopped answering."""
        _augment_message(
            exception,
            pattern=r".*(Connection (reset|closed) by peer|timed out|Timed out|Socket Timeout).*",
            new_message=(
                f"lightning_trn: a collective between the {self.world_size} data-parallel processes failed on rank "
                f"{self.global_rank}: another rank exited or stopped answering (look for the first error in the other "
                f"ranks' output). Original error: {exception}"
            ),
        )

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        self._env.restore()
