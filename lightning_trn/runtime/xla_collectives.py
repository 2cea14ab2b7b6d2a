"""`XlaCollectives`: the XLA runtime's own collectives (`xm.*`), which span processes on Neuron."""

from __future__ import annotations

import os

import torch
from typing_extensions import override

from lightning_trn.runtime.collectives import Collectives, reduce_op_name
from lightning_trn.runtime.xla_import import import_xla


class XlaCollectives(Collectives):
    """`xm` collectives: they become part of the step's graph and run on the NeuronCores' collective engine."""

    @override
    def reduce_gradients(self, gradients: list[torch.Tensor]) -> None:
        """What `xm.reduce_gradients` does, bucketed by `ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB` (Neuron default 50)."""
        xm = import_xla("torch_xla.core.xla_model")
        bucket_mb = int(os.environ.get("ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB", "0") or 0)
        scale = 1.0 / self.world_size
        if bucket_mb > 0:
            # last layers first: their gradients are ready first, so their all-reduce can overlap the backward pass
            xm.all_reduce_bucketized_gradients(
                list(reversed(gradients)), scale=scale, groups=None, pin_layout=True, bucket_cap_mb=bucket_mb
            )
        elif gradients:
            xm.all_reduce(xm.REDUCE_SUM, gradients, scale=scale)

    @override
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        xm = import_xla("torch_xla.core.xla_model")
        name = reduce_op_name(op)
        kinds = {"sum": xm.REDUCE_SUM, "mean": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}
        value = tensor if name != "mean" or tensor.is_floating_point() else tensor.float()
        return xm.all_reduce(kinds[name], value, scale=1.0 / self.world_size if name == "mean" else 1.0)

    @override
    def reduce_scatter(self, rows: torch.Tensor) -> torch.Tensor:
        xm = import_xla("torch_xla.core.xla_model")
        mine = xm.reduce_scatter(
            xm.REDUCE_SUM, rows, scale=1.0 / self.world_size, scatter_dim=0, shard_count=self.world_size
        )
        return mine.squeeze(0)

    @override
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        xm = import_xla("torch_xla.core.xla_model")
        return xm.all_gather(tensor.unsqueeze(0), dim=0)

    @override
    def broadcast_(self, tensors: list[torch.Tensor], src: int) -> None:
        import_xla("torch_xla.core.xla_model").collective_broadcast(tensors, root_ordinal=src)
