"""`ProcessGroupStrategyMixin`: what the Trainer's multi-process Neuron strategies (data-parallel and model-parallel)
add to `lightning_trn.core.process_group` in the same way: `reduce` for `self.log(..., sync_dist=True)`, failure
messages, the SIGTERM agreement over the host group and torchmetrics' syncs."""

from __future__ import annotations

from typing import Any, Optional, Union

import lightning.pytorch as pl
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_trn.pytorch.strategies.host_signals import install_host_sigterm_sync


class ProcessGroupStrategyMixin:
    """Mixed into a Trainer strategy after `ProcessGroupCore` (or a core built on it), before Lightning's class."""

    def _after_setup(self, trainer: pl.Trainer) -> None:
        """Called at the end of `setup`: route torchmetrics' syncs, agree on SIGTERM over the host group."""
        self._route_metric_syncs(self.lightning_module)  # type: ignore[attr-defined]
        install_host_sigterm_sync(trainer, self._host_group)  # type: ignore[attr-defined]

    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        """Reduce `tensor` over all ranks with sum, mean ("avg"), max or min; non-tensors are returned unchanged."""
        return self.all_reduce(tensor, group, reduce_op)  # type: ignore[attr-defined]

    def on_exception(self, exception: BaseException) -> None:
        self._explain_failure(exception)  # type: ignore[attr-defined]
