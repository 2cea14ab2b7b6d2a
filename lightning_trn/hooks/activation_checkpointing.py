"""Activation checkpointing (`torch.utils.checkpoint.checkpoint`, Hugging Face's `gradient_checkpointing_enable()`,
`checkpoint_wrapper`) in Neuron runs on XLA (installed by `lightning_trn.hooks.registry` for Neuron runs only).

Three things stand in the way, and each hook removes one:

- On XLA, torch's checkpoint asks `torch.xla` for the device's RNG state (and `fork_rng` does even with
  `preserve_rng_state=False`), which torch_xla does not register: `AttributeError: module 'torch' has no attribute
  'xla'`. `torch.xla` is the runtime's device module while the run lasts (`DeviceRuntime.checkpoint_device_module`).
- torch saves the device's RNG state for the recompute only when the device module says `_initialized`, which
  TorchNeuron's `torch.neuron` (and the stand-in, which mirrors it) does not: dropout then recomputes other masks than
  the forward drew, and the gradients are silently wrong. torch's checkpoint gets the runtime's device module, which
  says so, for the run's device type (`_get_device_module`); torch's own code then saves and restores the state.
- The XLA compiler merges the recomputed forward with the original one (common-subexpression elimination), which
  keeps the activations alive and saves nothing (pytorch/xla#1571). The recompute's tensor inputs, and the
  parameters and buffers of a module being checkpointed, first pass an optimization barrier
  (`DeviceRuntime.optimization_barrier_`), as `torch_xla.utils.checkpoint` does, in both of torch's implementations
  (`use_reentrant=True` and `False`), so torch's semantics (kwargs, non-tensor arguments, `torch.autograd.grad`
  with the non-reentrant one) are kept.

The fence is installed only where the runtime needs it (`DeviceRuntime.fences_recompute`: XLA); the native
backend is eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from lightning_trn.runtime import DeviceRuntime, get_runtime


def xla_device_module(original: Any | None) -> Any | None:
    """`torch.xla` for an XLA run: the runtime's device module (torch_xla registers none)."""
    runtime = get_runtime()
    return runtime.checkpoint_device_module() if original is None and runtime.device_type == "xla" else None


def device_module_lookup(original: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """torch's checkpoint's `_get_device_module`, answering the runtime's device module for the run's device type."""
    if original is None:
        return None
    runtime = get_runtime()
    module = runtime.checkpoint_device_module()

    def get_device_module(device: str = "cuda") -> Any:
        return module if device == runtime.device_type else original(device)

    return get_device_module


class FenceOnRecompute:
    """`function` as torch's checkpoint calls it for the recompute in backward, whose inputs pass an optimization
    barrier first. `forward_calls`: how many calls before that are the forward (the reentrant implementation runs
    the forward through it too, the non-reentrant one does not)."""

    def __init__(self, function: Callable[..., Any], runtime: DeviceRuntime, forward_calls: int) -> None:
        self.function = function
        self.runtime = runtime
        self.forward_calls = forward_calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.forward_calls:
            self.forward_calls -= 1
        else:
            self.runtime.optimization_barrier_(self._inputs(args, kwargs))
        return self.function(*args, **kwargs)

    def _inputs(self, args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        function = self.function
        owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
        state = [*owner.parameters(), *owner.buffers()] if isinstance(owner, torch.nn.Module) else []
        device_type = self.runtime.device_type
        return [
            t
            for t in [*tree_leaves((args, kwargs)), *state]
            if isinstance(t, torch.Tensor) and t.device.type == device_type
        ]


def _needs_fence() -> DeviceRuntime | None:
    runtime = get_runtime()
    return runtime if runtime.fences_recompute else None


def fenced_non_reentrant(original: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """torch's `_checkpoint_without_reentrant_generator` (`use_reentrant=False`) with a fenced recompute."""
    runtime = _needs_fence()
    if original is None or runtime is None:
        return None

    def generator(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return original(FenceOnRecompute(fn, runtime, forward_calls=0), *args, **kwargs)

    return generator


def fenced_reentrant(original: Any | None) -> Any | None:
    """torch's `CheckpointFunction` (`use_reentrant=True`) with a fenced recompute."""
    runtime = _needs_fence()
    if original is None or runtime is None:
        return None
    checkpoint_function, fence_runtime = original, runtime  # a nested class's method does not see the narrowing

    class FencedCheckpointFunction:
        @staticmethod
        def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            fenced = FenceOnRecompute(function, fence_runtime, forward_calls=1)
            return checkpoint_function.apply(fenced, preserve_rng_state, *args)

    return FencedCheckpointFunction
