"""`MaskedAccuracy`: accuracy that skips padded rows, updated on the device without reading back to the host."""

from __future__ import annotations

import torch
from torchmetrics import Metric
from typing_extensions import override


class MaskedAccuracy(Metric):
    """Weighted accuracy: rows with weight 0 (the padding of a last, partial batch) do not count.

    torchmetrics' `MulticlassAccuracy(ignore_index=...)` drops ignored rows by boolean indexing, a dynamic shape that
    makes XLA recompile or fall back to the host; this keeps two device scalars and never leaves the device.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    correct: torch.Tensor  # the states `add_state` registers
    total: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("correct", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

    @override
    def update(self, preds: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> None:
        """Add a batch of predicted class ids, targets and per-row weights (1 = real row, 0 = padding)."""
        weight = weight.to(self.correct.dtype)
        self.correct += ((preds == target).to(weight.dtype) * weight).sum()
        self.total += weight.sum()

    @override
    def compute(self) -> torch.Tensor:
        return self.correct / self.total.clamp_min(1.0)
