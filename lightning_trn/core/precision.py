"""`NeuronPrecisionCore`: the Neuron precision ("32-true", "bf16-mixed", "bf16-true") both of Lightning's APIs use.

It holds everything but the optimizer step, whose signature differs between the APIs: the Trainer's plugin
(`lightning_trn.pytorch.precision.NeuronPrecision`) and Fabric's (`lightning_trn.fabric.NeuronPrecision`) add it.

The Neuron compiler and runtime take their precision settings from environment variables read when they start, so
the plugin sets them when it is constructed (inside `Trainer(...)`, before the runtime starts), never overriding a
value the user set, and restores them on teardown. It only touches them on a Neuron platform: on XLA:CPU they mean
nothing, and stochastic rounding is done in software instead (see `stochastic_rounding.py`). See docs/precision.md.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast

import torch
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

from lightning_trn.core.stochastic_rounding import Bf16OptimizerStep, stochastic_round_to_bf16
from lightning_trn.runtime import get_runtime
from lightning_trn.runtime.environment import (
    NEURON_CC_FLAGS,
    EnvironmentPatch,
    cc_flag_value,
    format_cc_flags,
    parse_cc_flags,
)

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")

#: Neuron runtime switches for stochastic rounding of bf16 results (read once, when the runtime starts)
STOCHASTIC_ROUNDING_EN = "NEURON_RT_STOCHASTIC_ROUNDING_EN"
STOCHASTIC_ROUNDING_SEED = "NEURON_RT_STOCHASTIC_ROUNDING_SEED"
#: deprecated torch_xla switches that silently store fp32 tensors as bf16 and override per-op precision
DEPRECATED_BF16_VARIABLES = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")
_AUTO_CAST = "--auto-cast"


def check_precision(precision: object) -> None:
    """Refuse a precision outside `SUPPORTED_PRECISION`, listing those (not Lightning's whole list: the plugin refuses
    fp16 and 64-bit).

    Raises:
        ValueError: `precision` is not one of `SUPPORTED_PRECISION`.
    """
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"`accelerator='neuron'` with `precision={precision!r}` is not supported. "
            f"Choose one of: {', '.join(SUPPORTED_PRECISION)}."
        )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """Tensors created inside get `dtype` by default (modules built under `Trainer.init_module()`, `torch.zeros`)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _to_bf16(tensor: Tensor) -> Tensor:
    return tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor


class NeuronPrecisionCore:
    """Precision for NeuronCores and XLA:CPU, mixed into the Trainer's and Fabric's precision plugins.

    Args:
        precision: "32-true" (fp32 everywhere), "bf16-mixed" (fp32 parameters and optimizer state, forward and
            loss under `torch.autocast("xla", torch.bfloat16)`) or "bf16-true" (module, inputs, gradients and
            optimizer state in bf16, updates rounded stochastically).
        master_weights: bf16-true only: keep fp32 copies of the parameters that the optimizer updates (its state is
            then fp32 too); the bf16 parameters are refreshed from them after every step.
        stochastic_rounding: bf16-true only: round bf16 updates stochastically (on the XLA stack's NeuronCores
            through `NEURON_RT_STOCHASTIC_ROUNDING_EN=1`, elsewhere, TorchNeuron included, in software). Turn off
            for round-to-nearest.
        seed: seed of the Neuron runtime's rounding (`NEURON_RT_STOCHASTIC_ROUNDING_SEED`); defaults to the seed of
            `seed_everything` if one was set, else 0.
    """

    def __init__(
        self,
        precision: str = "32-true",
        *,
        master_weights: bool = False,
        stochastic_rounding: bool = True,
        seed: int | None = None,
    ) -> None:
        check_precision(precision)
        super().__init__()
        if master_weights and precision != "bf16-true":
            raise ValueError(f"`master_weights=True` applies to precision='bf16-true' only, got {precision!r}.")
        # typed as Lightning's precision plugins, which this class is mixed into, declare it; one of
        # SUPPORTED_PRECISION (checked above)
        self.precision = cast(_PRECISION_INPUT_STR, precision)
        self.master_weights = master_weights
        self.stochastic_rounding = stochastic_rounding and precision == "bf16-true"
        self.seed = seed
        runtime = get_runtime()
        self._on_neuron = runtime.on_neuron()
        # where the Neuron runtime rounds it does (or not, if the user set NEURON_RT_STOCHASTIC_ROUNDING_EN=0: the
        # user wins); elsewhere, TorchNeuron included, the optimizer step rounds in software
        self._software_rounding = self.stochastic_rounding and not (runtime.runtime_rounds_bf16 and self._on_neuron)
        self._environment = EnvironmentPatch()
        self._environment_applied = False
        self._configure_environment()
        self._bf16_step = Bf16OptimizerStep(master_weights) if master_weights or self._software_rounding else None
        #: the parameters as the optimizers hold them (Lightning's teardown moves the model to the CPU as new objects)
        self._named_parameters: list[tuple[str, Tensor]] = []
        #: set by a pipeline-parallel strategy: the ranks holding the other stages' gradients, over which clipping
        #: takes the norm, and the tied copies it counts once (`lightning_trn.core.parallel.gradients.NormScope`)
        self.gradient_norm_scope: Any = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in (what throughput and MFU are measured against)."""
        return torch.float32 if self.precision == "32-true" else torch.bfloat16

    @property
    def software_optimizer_step(self) -> Bf16OptimizerStep | None:
        """The fp32 optimizer step used for bf16 parameters (software rounding or master weights), if any."""
        return self._bf16_step

    def _configure_environment(self) -> None:
        """Set the Neuron variables this precision needs (on a Neuron platform only) and warn about conflicts."""
        self._environment_applied = True
        for name in DEPRECATED_BF16_VARIABLES:
            if os.environ.get(name, "0") not in ("", "0"):
                rank_zero_warn(
                    f"{name}={os.environ[name]!r} is set: it is deprecated and stores fp32 tensors as bf16, overriding "
                    f"precision={self.precision!r}. Unset it; `precision='bf16-true'` or 'bf16-mixed' replace it."
                )
        if not self._on_neuron:
            return
        self._disable_compiler_auto_cast()
        if self.stochastic_rounding and not self._software_rounding:
            self._set_default(STOCHASTIC_ROUNDING_EN, "1")
            seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
            self._environment.set_default(STOCHASTIC_ROUNDING_SEED, str(seed))

    def round_parameter(self, value: Tensor, dtype: torch.dtype) -> Tensor:
        """An fp32 master value (a ZeRO-1 chunk) cast to its parameter's `dtype`: bf16 is rounded stochastically where
        bf16-true rounds in software (where the runtime rounds, it rounds the cast), to nearest with master weights."""
        if dtype == torch.bfloat16 and self._software_rounding and not self.master_weights:
            return stochastic_round_to_bf16(value)
        return value.to(dtype)

    def _disable_compiler_auto_cast(self) -> None:
        """The plugin decides the dtypes: ask the compiler not to cast fp32 ops to bf16 on its own (`--auto-cast=none`;
        with autocast on top this would cast twice, in 32-true it would not be fp32)."""
        flags = os.environ.get(NEURON_CC_FLAGS, "")
        user_value = cc_flag_value(flags, _AUTO_CAST)
        if user_value is None:
            self._environment.set(NEURON_CC_FLAGS, format_cc_flags([*parse_cc_flags(flags), (_AUTO_CAST, "none")]))
        elif user_value != "none" and self.precision != "bf16-true":
            rank_zero_warn(
                f"{NEURON_CC_FLAGS} contains `{_AUTO_CAST}={user_value}`, kept as set: with "
                f"precision={self.precision!r} the compiler will additionally cast fp32 operations. Use "
                f"`{_AUTO_CAST}=none` to let the precision plugin alone decide the dtypes."
            )

    def _set_default(self, name: str, value: str) -> None:
        if not self._environment.set_default(name, value):
            rank_zero_warn(
                f"{name}={os.environ[name]!r} is set in the environment and kept, but precision={self.precision!r} "
                f"would set {name}={value}. Unset it to get the precision's default behaviour."
            )

    def convert_module(self, module: Module) -> Module:
        return module.to(dtype=torch.bfloat16) if self.precision == "bf16-true" else module

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, dtype=Tensor, function=_to_bf16)

    def tensor_init_context(self) -> AbstractContextManager:
        return _default_dtype(torch.bfloat16) if self.precision == "bf16-true" else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        if self.precision == "bf16-mixed":
            return get_runtime().autocast(torch.bfloat16)
        return self.tensor_init_context()

    def _check_bf16_step_supports(self, optimizer: Optimizer) -> None:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException(
                "LBFGS re-evaluates its closure inside `step()`, which the fp32 update of precision='bf16-true' "
                "(software stochastic rounding / master weights) does not support. Use another optimizer."
            )

    def state_dict(self) -> dict[str, Any]:
        if not self.master_weights or self._bf16_step is None:
            return {}
        return {"master_weights": self._bf16_step.master_state_dict(self._named_parameters)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._bf16_step is not None and "master_weights" in state_dict:
            self._bf16_step.load_master_state_dict(self._named_parameters, state_dict["master_weights"])

    def teardown(self) -> None:
        """Put back every environment variable the plugin changed."""
        self._environment.restore()
        self._environment_applied = False
