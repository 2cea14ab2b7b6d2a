"""Gradient clipping by the norm of all gradients together when some are DTensors (FSDP2, tensor parallel).

torch's `clip_grad_norm_` stacks every gradient's norm, which fails when plain tensors (parameters a tensor-parallel
plan replicates) and DTensors, or DTensors of different meshes, are mixed. Here the norm is taken per group of the
same mesh and placements (one reduction per group), the groups' norms combined, and every gradient scaled by one
coefficient: the norm and the clipping of one unsharded model. Under pipeline parallelism each rank holds the
gradients of its stages only: the norm is then combined over the pipeline group too, a weight tied across stages
counted once (`NormScope`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.nn.utils import clip_grad_norm_ as torch_clip_grad_norm_
from torch.nn.utils import get_total_norm


class NormScope(Protocol):
    """Where one norm spans more than this rank's gradients (pipeline stages, `Pipelining`)."""

    @property
    def norm_group(self) -> Any:
        """The group whose ranks hold the other stages' gradients; None: this rank holds all."""

    def uncounted_in_norm(self) -> list[Tensor]:
        """Parameters whose gradient another rank counts (the copies of a weight tied across stages): clipped, not
        counted."""


def _layout(tensor: Tensor) -> Any:
    """Which group a gradient's norm is taken in: its mesh and placements (None for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    return (tensor.device_mesh, tuple(tensor.placements)) if isinstance(tensor, DTensor) else None


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float | int,
    norm_type: float | int = 2.0,
    error_if_nonfinite: bool = False,
    scope: NormScope | None = None,
) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` that also takes gradients of mixed layouts; returns the total norm (a plain
    tensor). With one layout and no `scope` it is torch's function itself.

    Args:
        scope: with pipeline stages, the group holding the other stages' gradients (the norm is that of all their
            gradients together) and the tied copies counted on another rank.
    """
    parameters = [p for p in parameters if p.grad is not None]
    group = scope.norm_group if scope is not None else None
    uncounted = {id(p) for p in scope.uncounted_in_norm()} if scope is not None else set()
    groups: dict[Any, list[Tensor]] = {}
    counted: dict[Any, list[Tensor]] = {}
    for parameter in parameters:
        grad = parameter.grad
        groups.setdefault(_layout(grad), []).append(grad)  # type: ignore[arg-type]  # not None: filtered above
        if id(parameter) not in uncounted:
            counted.setdefault(_layout(grad), []).append(grad)  # type: ignore[arg-type]  # as above
    if len(groups) <= 1 and group is None:
        total = torch_clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)
        return total.full_tensor() if hasattr(total, "full_tensor") else total
    norms = []
    for grads in counted.values():
        norm = get_total_norm(grads, norm_type, error_if_nonfinite)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if norms:
        total = get_total_norm(norms, norm_type, error_if_nonfinite)
    else:  # every gradient here is a copy another rank counts
        total = torch.zeros((), device=parameters[0].device if parameters else None)
    if group is not None:
        total = _combined(total, float(norm_type), group)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if not groups:
        return total
    local = [g.to_local() if hasattr(g, "to_local") else g for grads in groups.values() for g in grads]
    torch._foreach_mul_(local, coefficient.to(local[0].device))  # each shard, in place
    return total


def _combined(norm: Tensor, norm_type: float, group: Any) -> Tensor:
    """The norm of the gradients of all ranks of `group`, from each rank's norm of its own."""
    import torch.distributed as dist

    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.float() ** norm_type
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / norm_type)
