"""`ProcessGroup`: one process per NeuronCore joined in process groups, held by every multi-process Neuron strategy
(data-parallel and model-parallel, the Trainer's and Fabric's); `OneProcess`, the group a one-process strategy holds
(every collective its one rank's answer), so the strategies' code needs no "is there a group" branches.

The default group is the runtime's (`neuron` natively, `xla` on Neuron with torch_xla, gloo on XLA:CPU); host-side
objects, barriers, flags and host tensors go over a gloo group, so they never touch the device.
"""

from __future__ import annotations

import atexit
import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.exceptions import _augment_message
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from lightning_trn.runtime import get_runtime
from lightning_trn.runtime.collectives import Collectives, check_world_size, reduce_op_name
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


def _is_world(group: Any | None) -> bool:
    """Whether `group` means all processes: None (Lightning's Trainer) or `group.WORLD` (what Fabric passes)."""
    return group is None or group is dist.group.WORLD


class ProcessGroup:
    """The process groups of a multi-process Neuron strategy, held by it (`NeuronStrategyCore._process_group`): the
    default group on the runtime's backend, a gloo group beside it for host objects, and the collectives over both.

    Args:
        backend: `torch.distributed` backend of the default group; by default `xla` on Neuron with torch_xla, `gloo`
            on XLA:CPU, `neuron` on the native backend. `xla` is refused on XLA:CPU, whose runtime collectives do
            not span processes.
        timeout: timeout of the process groups: a rank waiting on a dead peer fails after at most this long.
    """

    def __init__(self, backend: str | None = None, timeout: timedelta = default_pg_timeout) -> None:
        self.backend = backend
        self.timeout = timeout
        #: the environment variables set for this process's NeuronCore, put back at teardown
        self.env = EnvironmentPatch()
        self._collectives: Collectives | None = None
        #: host tensors' reductions, over the host (gloo) group
        self.host_collectives: HostCollectives | None = None
        #: gloo group for host-side objects, barriers and flags (None: the default group, already gloo)
        self.host_group: Any | None = None

    @property
    def collectives(self) -> Collectives:
        """The cross-process collectives, available once the process group is joined."""
        if self._collectives is None:
            raise RuntimeError("lightning_trn: collectives are used before the strategy's `setup_environment`.")
        return self._collectives

    @property
    def joined(self) -> bool:
        return self._collectives is not None

    @property
    def is_distributed(self) -> bool:
        """Whether the strategy runs several processes: it claims a device per process and joins the groups."""
        return True

    def join(self, cluster_environment: Any, world_size: int, sizes: str) -> None:
        """Join the default process group (the runtime's backend) and make the host group beside it (once).
        `sizes` names the run's node and device counts in the error of a world-size mismatch."""
        if self._collectives is not None:
            return
        reset_seed()
        runtime = get_runtime()
        cross_process = runtime.supports_cross_process_collectives()
        backend = self.backend or runtime.process_group_backend()
        if backend == "xla" and not cross_process:
            raise RuntimeError(
                "process_group_backend='xla' on XLA:CPU: its runtime collectives do not span processes, so every "
                "process would only reduce with itself. Leave `process_group_backend` unset (gloo on host copies)."
            )
        self.backend = backend
        if not _distributed_is_initialized():  # a group the user initialised is the user's to destroy
            destroy_process_groups_at_exit()
        _init_dist_connection(cluster_environment, backend, timeout=self.timeout)
        found = dist.get_world_size()
        if found != world_size:
            raise RuntimeError(
                f"torch.distributed reports {found} processes but the strategy expects {world_size} ({sizes}): match "
                "torchrun's --nnodes / --nproc_per_node (or SLURM's --nodes / --ntasks-per-node) to the Trainer's or "
                "Fabric's num_nodes / devices."
            )
        check_world_size(found, runtime.world_size() if cross_process else 1, cross_process)
        if backend != "gloo":
            self.host_group = dist.new_group(backend="gloo", timeout=self.timeout)
        self._collectives = runtime.collectives(found, self.host_group)
        self.host_collectives = HostCollectives(found, self.host_group)

    def route_metric_syncs(self, model: Module | None) -> None:
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
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        """Reduce `tensor` over all ranks with sum, mean ("avg"), max or min (a host tensor over the host group);
        non-tensors are returned unchanged."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        if not _is_world(group):
            raise ValueError("lightning_trn's strategies reduce over all processes; `group` is not supported.")
        op = reduce_op_name(reduce_op)
        if tensor.device.type == "cpu":  # a host value (a loader length, a count): the host group, no device graph
            assert self.host_collectives is not None
            return self.host_collectives.all_reduce(tensor, op)
        return self.collectives.all_reduce(tensor, op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Every rank's `tensor`, stacked along a new first dimension (gradients do not flow back through it)."""
        if not _distributed_is_initialized():
            return tensor.unsqueeze(0)
        if not _is_world(group) or sync_grads:
            raise ValueError("lightning_trn's strategies' all_gather supports neither `group` nor `sync_grads=True`.")
        return self.collectives.all_gather(tensor)

    def reduce_boolean_decision(self, decision: bool, world_size: int, all: bool = True) -> bool:
        """Decided on the host group: no device tensor, so no device round trip (early stopping, checkpointing)."""
        if not _distributed_is_initialized():
            return decision
        votes = torch.tensor(int(decision))
        dist.all_reduce(votes, op=ReduceOp.SUM, group=self.host_group)
        return bool(votes == world_size) if all else bool(votes)

    def gather_objects(self, obj: Any, world_size: int) -> list[Any]:
        """Every rank's `obj`, in rank order, over the host group (no device memory)."""
        if not _distributed_is_initialized():
            return [obj]
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, obj, group=self.host_group)
        return gathered

    def gather_to_first(self, obj: Any, world_size: int) -> list[Any] | None:
        """Every rank's `obj` in rank order on rank 0 (None on the others), over the host group: O(1) bytes on every
        rank but the first, where `gather_objects` gives all of them to every rank."""
        if not _distributed_is_initialized():
            return [obj]
        gathered: list[Any] | None = [None] * world_size if dist.get_rank() == 0 else None
        dist.gather_object(obj, gathered, dst=0, group=self.host_group)
        return gathered

    def barrier(self) -> None:
        if _distributed_is_initialized():
            dist.barrier(group=self.host_group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=self.host_group)
        return objects[0]

    def explain_failure(self, exception: BaseException, global_rank: int, world_size: int) -> None:
        """Say what a failed collective usually means (`explain_failure`)."""
        explain_failure(exception, global_rank, world_size)


class OneProcess(ProcessGroup):
    """The process group of a one-process strategy: nothing to join, and every collective gives this one rank's
    answer, as Lightning's single-device strategies do (a reduction or broadcast returns its input, a gather the input
    alone, a barrier returns at once)."""

    def __init__(self) -> None:
        super().__init__(backend=None)

    @property
    @override
    def collectives(self) -> Collectives:
        raise RuntimeError("lightning_trn: a one-process strategy has no collectives.")

    @property
    @override
    def is_distributed(self) -> bool:
        return False

    @override
    def join(self, cluster_environment: Any, world_size: int, sizes: str) -> None:
        """Nothing to join."""

    @override
    def route_metric_syncs(self, model: Module | None) -> None:
        """torchmetrics' own (no) sync serves one process."""

    @override
    def all_reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, world_size: int, all: bool = True) -> bool:
        return decision

    @override
    def gather_objects(self, obj: Any, world_size: int) -> list[Any]:
        return [obj]

    @override
    def gather_to_first(self, obj: Any, world_size: int) -> list[Any] | None:
        return [obj]

    @override
    def barrier(self) -> None:
        """Nothing to wait for."""

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def explain_failure(self, exception: BaseException, global_rank: int, world_size: int) -> None:
        """A failure in one process is not another rank's."""


def explain_failure(exception: BaseException, global_rank: int, world_size: int) -> None:
    """Say what a failed collective usually means: another rank died or stopped answering."""
    _augment_message(
        exception,
        pattern=r".*(Connection (reset|closed) by peer|timed out|Timed out|Socket Timeout).*",
        new_message=(
            f"lightning_trn: a collective between the {world_size} processes failed on rank {global_rank}: another "
            f"rank exited or stopped answering (look for the first error in the other ranks' output). Original "
            f"error: {exception}"
        ),
    )
