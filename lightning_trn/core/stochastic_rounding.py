"""Software stochastic rounding to bf16, and an optimizer step that uses it for bf16 parameters.

A NeuronCore rounds bf16 results stochastically when `NEURON_RT_STOCHASTIC_ROUNDING_EN=1`. Elsewhere (XLA:CPU,
CPU, GPU) a bf16 parameter is updated with round-to-nearest, which drops every update smaller than half the bf16
spacing of the weight, so small learning rates stall. `Bf16OptimizerStep` runs any torch optimizer in fp32 for the
bf16 parameters and writes the result back stochastically rounded (or keeps fp32 master weights), so training on
those machines behaves like training on Neuron.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

#: explicit mantissa bits of bfloat16: a binade [2^e, 2^(e+1)) holds 2^7 evenly spaced values
_BF16_MANTISSA_BITS = 7
#: below 2^_MIN_EXPONENT values round (still unbiased) on the grid of 2^(_MIN_EXPONENT - 7), so the spacing stays a
#: normal fp32 number on backends that flush subnormals
_MIN_EXPONENT = -100
_MAX_EXPONENT = 127


def stochastic_round_to_bf16(x: Tensor) -> Tensor:
    """Round `x` to bf16, up or down with probability proportional to the distance, so that E[result] == x.

    Uses only float ops and `torch.rand_like`: on XLA they lower into the step's graph (no host round trip; a bit
    view of the fp32 representation would fall back to the CPU) and the random bits come from the device RNG, so
    the compiled graph is the same every step. Non-finite values pass through unchanged.
    """
    x = x.float()
    magnitude = x.abs()
    # exponent e with 2^e <= |x| < 2^(e+1); log2 may be off by one near powers of two, so correct it exactly
    exponent = torch.floor(torch.log2(magnitude)).clamp(_MIN_EXPONENT, _MAX_EXPONENT)
    power = torch.pow(2.0, exponent)
    exponent = exponent - (power > magnitude).float() + (2 * power <= magnitude).float()
    exponent = exponent.clamp(_MIN_EXPONENT, _MAX_EXPONENT)
    spacing = torch.pow(2.0, exponent - _BF16_MANTISSA_BITS)
    scaled = magnitude / spacing  # exact: spacing is a power of two
    lower = torch.floor(scaled)
    round_up = (torch.rand_like(scaled) < scaled - lower).float()
    rounded = (lower + round_up) * spacing
    rounded = torch.where(x < 0, -rounded, rounded)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def _cast_state(state: dict[str, Any] | None, dtype: torch.dtype, stochastic: bool) -> None:
    """Cast an optimizer's per-parameter state to `dtype` with torch's own rule: floating tensors follow the
    parameter's dtype, except the `step` counter."""
    if not state:
        return
    for key, value in state.items():
        if key == "step" or not isinstance(value, Tensor) or not value.is_floating_point() or value.dtype == dtype:
            continue
        state[key] = stochastic_round_to_bf16(value) if stochastic else value.to(dtype)


class Bf16OptimizerStep:
    """Runs `optimizer.step()` in fp32 for the bf16 parameters, then stores them back in bf16.

    Works with any torch optimizer: during the step each bf16 parameter that has a gradient holds fp32 data and an
    fp32 gradient, so the optimizer computes (and creates its state) in fp32. Afterwards each parameter is bf16 again:

    - default: stochastically rounded, and the optimizer state too, which stays bf16 as it would on a NeuronCore
      with hardware stochastic rounding;
    - `master_weights=True`: the fp32 values are kept as master weights (and the optimizer state stays fp32); the
      bf16 parameter is their round-to-nearest copy.

    The parameters' bf16 gradient tensors are put back after the step.
    """

    def __init__(self, master_weights: bool = False) -> None:
        self.master_weights = master_weights
        self._masters: dict[Tensor, Tensor] = {}

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """`optimizer.step(**kwargs)` with the bf16 parameters promoted to fp32 for its duration."""
        params = [
            p
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and p.dtype == torch.bfloat16
        ]
        grads = [p.grad for p in params]
        for p, grad in zip(params, grads, strict=True):
            p.data = self._masters[p] if p in self._masters else p.data.float()
            p.grad = grad.float()
            _cast_state(optimizer.state.get(p), torch.float32, stochastic=False)
        try:
            return optimizer.step(**kwargs)
        finally:
            for p, grad in zip(params, grads, strict=True):
                full = p.data
                if self.master_weights:
                    self._masters[p] = full
                    p.data = full.to(torch.bfloat16)
                else:
                    p.data = stochastic_round_to_bf16(full)
                    _cast_state(optimizer.state.get(p), torch.bfloat16, stochastic=True)
                p.grad = grad

    def master_state_dict(self, named_parameters: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
        """The fp32 master weights by parameter name, as CPU tensors (for a portable checkpoint)."""
        return {name: self._masters[p].detach().cpu() for name, p in named_parameters if p in self._masters}

    def load_master_state_dict(self, named_parameters: Iterable[tuple[str, Tensor]], state: dict[str, Tensor]) -> None:
        """Restore master weights saved by `master_state_dict` onto the parameters' devices."""
        for name, p in named_parameters:
            if name in state:
                self._masters[p] = state[name].to(device=p.device, dtype=torch.float32)
