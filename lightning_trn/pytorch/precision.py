"""`NeuronPrecision` for the Trainer: the shared precision (`lightning_trn.core.precision.NeuronPrecisionCore`) with
the Trainer's `connect` and optimizer step (closure, hooks, clipping)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trn.core.parallel.gradients import clip_grad_norm_
from lightning_trn.core.parallel.zero1 import sharding_of
from lightning_trn.core.precision import NeuronPrecisionCore


class NeuronPrecision(NeuronPrecisionCore, Precision):
    """The Trainer's precision plugin for NeuronCores and XLA:CPU; see `NeuronPrecisionCore` for the arguments."""

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        """Remember the parameters by name (master weights are saved by name); re-apply the environment after an
        earlier run's teardown restored it."""
        self._named_parameters = list(model.named_parameters())
        if not self._environment_applied:
            self._configure_environment()
        return model, optimizers, lr_schedulers

    @override
    def optimizer_step(  # type: ignore[override]  # a torch `Optimizer`, not any `Steppable`: its param groups
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """bf16-true without hardware rounding (or with master weights): backward and the gradient hooks/clipping
        run as usual in bf16, then the update runs in fp32 through `Bf16OptimizerStep`."""
        if self._bf16_step is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._check_bf16_step_supports(optimizer)
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return closure_result  # `training_step` returned None: backward and the update are skipped
        self._bf16_step.step(optimizer, **kwargs)
        return closure_result

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm of all gradients together: ZeRO-1 over all ranks' chunks, DTensor gradients (FSDP2, tensor
        parallel) whatever their meshes (`lightning_trn.core.parallel.gradients`)."""
        sharding = sharding_of(optimizer)
        if sharding is None:
            clip_grad_norm_(self.main_params(optimizer), clip_val, scope=self.gradient_norm_scope)
        else:
            sharding.clip_grad_norm_(clip_val)
