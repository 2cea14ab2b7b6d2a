"""`Collectives`: the cross-process tensor operations data-parallel training needs, whatever carries them.

On Neuron they are the runtime's own (`xm` collectives over the NeuronCores); on XLA:CPU the runtime has none across
processes, so they run in a gloo process group on host copies. Every rank must call them in the same order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch
from torch.distributed import ReduceOp

#: Tensors are flattened into buckets of about this many bytes: one collective (and on XLA:CPU one host copy) each.
BUCKET_BYTES = 25 * 1024 * 1024

_Item = TypeVar("_Item")

#: reduction names `Collectives.all_reduce` accepts ("avg" and torch's ReduceOp members are normalised to these)
REDUCE_OPS = ("sum", "mean", "max", "min")


def reduce_op_name(op: str | Any | None) -> str:
    """Normalise `"sum"`/`"mean"`/`"avg"`/`"max"`/`"min"` or a `torch.distributed.ReduceOp` to a name in REDUCE_OPS."""
    if op is None:
        return "mean"
    if isinstance(op, str):
        name = op.lower()
    else:
        by_op = {ReduceOp.SUM: "sum", ReduceOp.AVG: "mean", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}
        name = by_op.get(op, str(op))
    name = "mean" if name == "avg" else name
    if name not in REDUCE_OPS:
        raise ValueError(f"Unsupported reduce op {op!r}: use one of {', '.join(REDUCE_OPS)}.")
    return name


@overload
def buckets(items: list[torch.Tensor], cap: int = BUCKET_BYTES) -> list[list[torch.Tensor]]: ...
@overload
def buckets(
    items: list[_Item], cap: int = BUCKET_BYTES, *, tensor: Callable[[_Item], torch.Tensor]
) -> list[list[_Item]]: ...
def buckets(
    items: list[Any], cap: int = BUCKET_BYTES, *, tensor: Callable[[Any], torch.Tensor] | None = None
) -> list[list[Any]]:
    """Split `items` into runs whose tensors (`tensor(item)`, or the items themselves) share a dtype and hold at most
    ~`cap` bytes, in order."""
    measure = tensor or (lambda item: item)
    runs: list[list[Any]] = []
    size = 0
    for item in items:
        value = measure(item)
        nbytes = value.numel() * value.element_size()
        if not runs or measure(runs[-1][0]).dtype != value.dtype or size + nbytes > cap:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += nbytes
    return runs


def check_world_size(process_group_size: int, runtime_size: int, cross_process: bool) -> None:
    """Fail rather than let runtime collectives silently reduce over fewer processes than the job has."""
    if cross_process and runtime_size != process_group_size:
        raise RuntimeError(
            f"The process group has {process_group_size} processes but the XLA runtime's collectives span "
            f"{runtime_size}: gradients would be averaged over the wrong set of processes. Launch one process per "
            "NeuronCore with consistent ranks (torchrun, SLURM, or `Trainer(devices=N)` from `python train.py`) and "
            "do not override NEURON_PJRT_WORLD_SIZE / NEURON_PJRT_PROCESS_INDEX by hand."
        )


class Collectives(ABC):
    """Tensor collectives over all processes of the job; tensors stay on the caller's device."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    @abstractmethod
    def reduce_gradients(self, gradients: list[torch.Tensor]) -> None:
        """Average `gradients` over all processes, in place, in as few (bucketed) operations as the backend allows."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """`tensor` reduced over all processes with `op` (one of REDUCE_OPS), as a new tensor."""

    @abstractmethod
    def reduce_scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """Rank r's row of `rows` (shape `[world_size, n]`) averaged over all processes: a new tensor of shape `[n]`."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's `tensor`, stacked along a new first dimension in rank order."""

    @abstractmethod
    def broadcast_(self, tensors: list[torch.Tensor], src: int) -> None:
        """Overwrite `tensors` in place with rank `src`'s values."""

    def metric_sync_fn(self) -> Callable[..., list[torch.Tensor]] | None:
        """The gather torchmetrics should use for metric states, or None where its default (the default process
        group) already handles device tensors."""
        return None
