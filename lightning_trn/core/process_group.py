"""`ProcessGroupCore`: one process per NeuronCore joined in process groups, shared by every multi-process Neuron
strategy (data-parallel and model-parallel, the Trainer's and Fabric's).

The default group is the runtime's (`neuron` natively, `xla` on Neuron with torch_xla, gloo on XLA:CPU); host-side
objects, barriers, flags and host tensors go over a gloo group, so they never touch the device.
"""

from __future__ import annotations

import atexit
import functools
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


class ProcessGroupCore:
    """Mixed into a multi-process Neuron strategy before Lightning's strategy class (the Trainer's or Fabric's).

    Args:
        process_group_backend: `torch.distributed` backend of the default group; by default `xla` on Neuron with
            torch_xla, `gloo` on XLA:CPU, `neuron` on the native backend. `xla` is refused on XLA:CPU, whose runtime
            collectives do not span processes.
        timeout: timeout of the process groups: a rank waiting on a dead peer fails after at most this long.
    """

    def __init__(
        self,
        *args: Any,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._env = EnvironmentPatch()
        self._collectives: Optional[Collectives] = None
        #: host tensors' reductions, over the host (gloo) group
        self._host_collectives: Optional[HostCollectives] = None
        #: gloo group for host-side objects, barriers and flags (None: the default group, already gloo)
        self._host_group: Optional[Any] = None

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

    def _claim_device(self) -> None:
        """Claim this process's NeuronCore (the runtime's environment variables) before the device is first touched."""
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

    def _setup_distributed(self) -> None:
        """Join the default process group (the runtime's backend) and make the host group beside it (once)."""
        if self._collectives is not None:
            return
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
                f"lightning_trn: a collective between the {self.world_size} processes failed on rank "
                f"{self.global_rank}: another rank exited or stopped answering (look for the first error in the other "
                f"ranks' output). Original error: {exception}"
            ),
        )

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        self._env.restore()
