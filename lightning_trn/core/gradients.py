"""Gradient clipping by the norm of all gradients together when some are DTensors (FSDP2, tensor parallel).

torch's `clip_grad_norm_` stacks every gradient's norm, which fails when plain tensors (parameters a tensor-parallel
plan replicates) and DTensors, or DTensors of different meshes, are mixed. Here the norm is taken per group of the
same mesh and placements (one reduction per group), the groups' norms combined, and every gradient scaled by one
coefficient: the norm and the clipping of one unsharded model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils import clip_grad_norm_ as torch_clip_grad_norm_
from torch.nn.utils import get_total_norm


def _layout(tensor: Tensor) -> Any:
    """Which group a gradient's norm is taken in: its mesh and placements (None for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    return (tensor.device_mesh, tuple(tensor.placements)) if isinstance(tensor, DTensor) else None


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float | int,
    norm_type: float | int = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` that also takes gradients of mixed layouts; returns the total norm (a plain
    tensor). With one layout it is torch's function itself."""
    parameters = [p for p in parameters if p.grad is not None]
    groups: dict[Any, list[Tensor]] = {}
    for parameter in parameters:
        grad = parameter.grad
        groups.setdefault(_layout(grad), []).append(grad)  # type: ignore[arg-type]  # not None: filtered above
    if len(groups) <= 1:
        total = torch_clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)
        return total.full_tensor() if hasattr(total, "full_tensor") else total
    norms = []
    for grads in groups.values():
        norm = get_total_norm(grads, norm_type, error_if_nonfinite)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = get_total_norm(norms, norm_type, error_if_nonfinite)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    local = [g.to_local() if hasattr(g, "to_local") else g for grads in groups.values() for g in grads]
    torch._foreach_mul_(local, coefficient.to(local[0].device))  # each shard, in place
    return total
