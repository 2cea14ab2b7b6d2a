"""`HostCollectives`: collectives through a gloo process group on host copies (XLA:CPU has none across processes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from typing_extensions import override

from lightning_trn.runtime.collectives import BUCKET_BYTES, Collectives, buckets, reduce_op_name

#: torch 2.13 renamed `reduce_scatter_tensor` (deprecated there) to `reduce_scatter_single`
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_DIST_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class HostCollectives(Collectives):
    """Copies to the host, runs the gloo collective in `group` (None: the default group), copies back."""

    def __init__(self, world_size: int, group: Any | None = None, bucket_bytes: int = BUCKET_BYTES) -> None:
        super().__init__(world_size)
        self._group = group
        self._bucket_bytes = bucket_bytes

    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Where the collective runs on `tensor`: a host copy (gloo takes host tensors only)."""
        return tensor.cpu()

    def _in_place(self, tensors: list[torch.Tensor], collective: Any) -> None:
        for bucket in buckets(tensors, self._bucket_bytes):
            flat = self._stage(_flatten_dense_tensors([t.detach() for t in bucket]))
            collective(flat)
            flat = flat.to(bucket[0].device)
            for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                tensor.copy_(value)

    @override
    def reduce_gradients(self, gradients: list[torch.Tensor]) -> None:
        def average(flat: torch.Tensor) -> None:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group)
            flat.div_(self.world_size)

        with torch.no_grad():
            self._in_place(gradients, average)

    @override
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        name = reduce_op_name(op)
        host = self._stage(tensor.detach()).clone()
        dist.all_reduce(host, op=_DIST_OPS[name], group=self._group)
        if name == "mean":
            host = host / self.world_size if host.is_floating_point() else host.float() / self.world_size
        return host.to(tensor.device)

    @override
    def reduce_scatter(self, rows: torch.Tensor) -> torch.Tensor:
        host = self._stage(rows.detach()).contiguous()
        mine = torch.empty(host.shape[1:], dtype=host.dtype, device=host.device)
        _reduce_scatter_single(mine, host.view(-1), op=dist.ReduceOp.SUM, group=self._group)
        return mine.div_(self.world_size).to(rows.device)

    @override
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        host = self._stage(tensor.detach()).contiguous()
        gathered = [torch.empty_like(host) for _ in range(self.world_size)]
        dist.all_gather(gathered, host, group=self._group)
        return torch.stack(gathered).to(tensor.device)

    def gather(self, tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
        """Every rank's `tensor` stacked (`[world_size, ...]`, on the host) on rank `dst`, None on the others: unlike
        `all_gather`, only `dst` ever holds them all (a checkpoint's state gathered to the rank that writes it)."""
        host = self._stage(tensor.detach()).contiguous()
        if dist.get_rank(self._group) != dst:
            dist.gather(host, None, dst=dst, group=self._group)
            return None
        gathered = torch.empty((self.world_size, *host.shape), dtype=host.dtype, device=host.device)
        dist.gather(host, list(gathered.unbind(0)), dst=dst, group=self._group)
        return gathered

    @override
    def broadcast_(self, tensors: list[torch.Tensor], src: int) -> None:
        with torch.no_grad():
            self._in_place(tensors, lambda flat: dist.broadcast(flat, src=src, group=self._group))

    @override
    def metric_sync_fn(self) -> Callable[..., list[torch.Tensor]] | None:
        """torchmetrics gathers over the default group, here gloo, which takes host tensors only: gather host copies
        (torchmetrics' own gather, so states of different sizes per rank still work) and move them back."""

        def gather(tensor: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
            from torchmetrics.utilities.distributed import gather_all_tensors

            host = gather_all_tensors(tensor.detach().cpu(), group if group is not None else self._group)
            return [value.to(tensor.device) for value in host]

        return gather
