"""`NeuronPrecision` for Lightning Fabric: the Trainer's precision ("32-true", "bf16-mixed", "bf16-true") with
Fabric's optimizer step; dtypes, autocast, stochastic rounding and the Neuron environment are shared
(`lightning_trn.core.precision.NeuronPrecisionCore`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trn.core.precision import NeuronPrecisionCore
from lightning_trn.hooks import registry


class NeuronPrecision(NeuronPrecisionCore, Precision):
    """Fabric's precision plugin for NeuronCores and XLA:CPU; what `Fabric(accelerator="neuron", precision=...)`
    uses. Arguments as the Trainer's plugin, except `master_weights`: Fabric saves only the state you pass to
    `fabric.save`, so fp32 master copies kept inside the plugin would be lost from checkpoints."""

    def __init__(self, precision: str = "32-true", *, stochastic_rounding: bool = True, seed: int | None = None):
        super().__init__(precision, stochastic_rounding=stochastic_rounding, seed=seed)

    @override
    def forward_context(self) -> AbstractContextManager:
        """The precision's forward context, with torch's activation checkpointing made to work on the device (Fabric
        has no teardown, so the hooks are in place for each forward and backward pass only: docs/memory.md)."""
        stack = ExitStack()
        stack.enter_context(registry.installed(registry.CHECKPOINT_HOOKS))
        stack.enter_context(super().forward_context())
        return stack

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        """`tensor.backward(...)`, with the activation-checkpointing hooks in place for the recompute."""
        with registry.installed(registry.CHECKPOINT_HOOKS):
            super().backward(tensor, model, *args, **kwargs)

    @override
    def convert_output(self, data: Any) -> Any:
        """Module outputs return to your loop in the default dtype (float32), as with Fabric's own bf16 plugins: a loss
        computed outside the module, outside autocast, is then computed in float32 as the Trainer computes it."""
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    @override
    # a torch `Optimizer`, not any of Lightning's `Optimizable`: the fp32 update reads its param groups
    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:  # type: ignore[override]  # see above
        """bf16-true without hardware rounding: the update runs in fp32 and is rounded stochastically to bf16."""
        if self._bf16_step is None:
            return super().optimizer_step(optimizer, **kwargs)
        self._check_bf16_step_supports(optimizer)
        return self._bf16_step.step(optimizer, **kwargs)
