"""Gradients set to None before the forward, not after it, in Lightning's automatic optimization.

Lightning's `Closure` runs `training_step` (the forward), then its zero-grad function, then backward: the previous
step's gradients are held through the whole forward, where the step's memory peaks (about 1 GiB per rank of the
LLM recipe's trn2-70b preset, one tenth of its estimated peak; docs/sharding.md). TorchTitan zeroes them at the start
of its step. During Neuron runs (`lightning_trn.hooks.registry`) the closure calls the same zero-grad function first,
then Lightning's own closure without it: everything else is Lightning's, unchanged. The zero-grad function is built by
Lightning as before, so it still runs only on the first batch of each gradient-accumulation window (None otherwise),
still calls the `on_before_zero_grad` hooks and the module's `optimizer_zero_grad` (an override is respected), and
manual optimization, which has no closure of Lightning's, is untouched. Only the order moves: `on_before_zero_grad`
and `optimizer_zero_grad` now run before `training_step` instead of after it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult


def zero_grad_first(original: Callable[..., ClosureResult] | None) -> Callable[..., ClosureResult] | None:
    """`Closure.closure` that runs the closure's zero-grad function before the step function; None where Lightning's
    `Closure` does not define `closure` itself."""
    if original is None:
        return None

    @functools.wraps(original)
    def closure(self: Closure, *args: Any, **kwargs: Any) -> ClosureResult:
        zero_grad = self._zero_grad_fn
        if zero_grad is None:  # a batch inside an accumulation window, or backward skipped
            return original(self, *args, **kwargs)
        zero_grad()
        self._zero_grad_fn = None
        try:
            return original(self, *args, **kwargs)
        finally:  # an optimizer that calls the closure again (LBFGS) zeroes again, as Lightning's would
            self._zero_grad_fn = zero_grad

    return closure
