"""What torch cannot do on fake tensors and a fake process group, done another way while `lightning_trn.estimate`
simulates a job (`registry.SIMULATION_HOOKS`, installed for one simulation only):

- device meshes and DTensor shard offsets are host bookkeeping (a mesh's rank lists, a shard's offsets) that torch
  reads back (`tolist`, `nonzero`, `int`), which fake tensors cannot answer: they are computed on real tensors
  (FSDP2 over a tensor-parallel mesh builds a mesh while sharding; `materialize` asks for offsets);
- `Module.to(device)` swaps every fake parameter for a copy of itself, which torch refuses once the fake parameter
  has a weak reference (any fake `Parameter` has): a move that changes nothing keeps the parameter;
- DTensor's sharding propagation runs each operator once more on fake tensors of the global shape, for the output's
  metadata only, in the fake mode it finds active: the simulation's own, whose tensors the tracker counts (the full
  vocabulary's log-softmax and its input under loss parallelism: +12 % on the checkpointed test model's peak; the
  unsharded parameters' optimizer state in the first step). It gets a fake mode of its own, as it does in a real
  run, where it allocates no device memory; the tracker skips that mode's tensors;
- groups asked for with the gloo backend (the strategies' host group) are fake as well, since a real gloo group
  needs its peers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def on_real_tensors(function: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`function` run with the active fake mode set aside."""
    if function is None:
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return wrapper


def swap_unless_unchanged(swap: Callable[[torch.Tensor, torch.Tensor], None] | None) -> Callable[..., None] | None:
    """`torch.utils.swap_tensors` that keeps a fake tensor whose replacement would change nothing."""
    if swap is None:
        return None
    from torch._subclasses.fake_tensor import FakeTensor

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        same = (t1.device, t1.dtype, t1.shape, t1.stride()) == (t2.device, t2.dtype, t2.shape, t2.stride())
        if not (same and isinstance(t1, FakeTensor)):
            swap(t1, t2)

    return swap_tensors


def own_propagation_mode(detect: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Sharding propagation's `detect_fake_mode`: a fake mode of its own (one per simulation), never the
    simulation's."""
    if detect is None:
        return None
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    return lambda *args, **kwargs: mode


def fake_host_groups(new_group: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`torch.distributed.new_group` that makes a gloo group a fake one."""
    if new_group is None:
        return None

    @functools.wraps(new_group)
    def fake_new_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = "fake"
        return new_group(*args, **kwargs)

    return fake_new_group
