"""Shortcuts through Lightning's per-step loop machinery, each giving the same result as the code it bypasses.

On XLA the host traces every step, so a small model's step is host-bound and Lightning's fixed bookkeeping per step
shows in its speed (benchmarks/README.md). Each is installed for Neuron runs only: 1, 2 and 5 by
`lightning_trn.hooks.registry` (which restores Lightning's originals after the run), 3 and 4 on the run's own
trainer:

1. `LightningModule._current_fx_name = name` skips `nn.Module.__setattr__`. Lightning sets it twice around every hook
   call (about 40 times per training step), and `Module.__setattr__` checks each value against `Parameter`, `Module`
   and `Buffer` (Python metaclass checks) before storing a plain string: ~1.3 us a call.
2. `is_param_in_hook_signature` remembers its answer per function. The training, evaluation and prediction loops ask
   it about the step method on every batch, and each answer runs `inspect.getfullargspec` (~11 us).

5. `has_len_all_ranks` (which every loop's `setup_data` asks about each loader) sums the loader lengths over the
   ranks with a host tensor, which Neuron strategies reduce over the host group, instead of a device tensor: on XLA
   Lightning's two comparisons of that device sum are two graphs, compiled and read at the start of the job.

3 and 4 are set on the trainer by `install_run_shortcuts` (`NeuronStrategyBase.setup`):

3. With Lightning's default profiler (`PassThroughProfiler`, which records nothing), `profile()` returns one shared
   `nullcontext` instead of building a generator-based context manager around every hook call.
4. The automatic-optimization result skips Lightning's `loss / accumulate_grad_batches` when that is 1. On XLA the
   division is a traced op in the forward and in the backward (~50 us of host time per step) and adds work to the
   step's graph, for an unchanged value.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops import evaluation_loop, fit_loop, prediction_loop, training_epoch_loop
from lightning.pytorch.loops.optimization.automatic import ClosureResult, _AutomaticOptimization
from lightning.pytorch.profilers import PassThroughProfiler
from typing_extensions import override

from lightning_trn.hooks.contract import contract_of

#: modules whose per-batch code calls `is_param_in_hook_signature` through their own imported name
SIGNATURE_CALLERS = (training_epoch_loop, evaluation_loop, prediction_loop)
#: modules whose `setup_data` calls `has_len_all_ranks` through their own imported name
LENGTH_CHECK_CALLERS = (fit_loop, evaluation_loop, prediction_loop)
_FX_NAME = "_current_fx_name"
_NULL_CONTEXT = contextlib.nullcontext()


def fx_name_setattr(original: Any) -> Callable[[pl.LightningModule, str, Any], None] | None:
    """Shortcut 1: a `LightningModule.__setattr__` that stores `_current_fx_name` directly; None if Lightning
    defines its own `__setattr__` (`original` is None when it inherits `nn.Module`'s)."""
    if original is not None:
        return None
    module_cls = pl.LightningModule

    def __setattr__(self: pl.LightningModule, name: str, value: Any) -> None:
        # a str or None is never a Parameter, Module or Buffer: Module.__setattr__ would end in object.__setattr__
        if name == _FX_NAME and (value is None or type(value) is str):
            object.__setattr__(self, name, value)
        else:
            super(module_cls, self).__setattr__(name, value)

    return __setattr__


def cached_signature_check(check: Any) -> Callable[..., bool] | None:
    """Shortcut 2: `is_param_in_hook_signature` with its answers kept per function (a method's answer is kept on its
    underlying function)."""
    if not callable(check):
        return None
    answers: weakref.WeakKeyDictionary[Callable, dict[tuple, bool]] = weakref.WeakKeyDictionary()

    def is_param_in_hook_signature(
        hook_fx: Callable, param: str, explicit: bool = False, min_args: int | None = None
    ) -> bool:
        function = hook_fx.__func__ if isinstance(hook_fx, types.MethodType) else hook_fx
        bound = function is not hook_fx
        if type(function) is not types.FunctionType:  # callable objects, builtins, partials: not cached
            return check(hook_fx, param, explicit, min_args)
        per_function = answers.setdefault(function, {})
        key = (bound, param, explicit, min_args)
        if key not in per_function:
            per_function[key] = check(hook_fx, param, explicit, min_args)
        return per_function[key]

    return is_param_in_hook_signature


class _HostRootDevice:
    """A Neuron strategy as `has_len_all_ranks` sees it: the host is its root device (the strategy's `reduce` takes
    host tensors), everything else is the strategy's."""

    root_device = torch.device("cpu")

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)


def host_length_check(check: Any) -> Callable[..., bool] | None:
    """Shortcut 5: Lightning's `has_len_all_ranks`, its length sum made on the host for Neuron strategies."""
    if not callable(check):
        return None

    def has_len_all_ranks(dataloader: object, strategy: Any, *args: Any, **kwargs: Any) -> bool:
        if contract_of(strategy).reduces_host_tensors:
            strategy = _HostRootDevice(strategy)
        return check(dataloader, strategy, *args, **kwargs)

    return has_len_all_ranks


class _NullContextProfiler(PassThroughProfiler):
    """Lightning's default profiler without the cost: records nothing, and `profile()` allocates nothing."""

    # Lightning annotates `profile` as its base's `@contextmanager` function; callers only enter the context
    @override
    def profile(self, action_name: str) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]  # see above
        return _NULL_CONTEXT


class _UnscaledClosureResult(ClosureResult):
    """`ClosureResult` that leaves the loss as `training_step` returned it when there is nothing to accumulate."""

    @classmethod
    @override
    def from_training_step_output(cls, training_step_output: Any, normalize: int = 1) -> ClosureResult:
        if normalize == 1:
            if isinstance(training_step_output, torch.Tensor):
                return cls(training_step_output)
            if isinstance(training_step_output, Mapping) and isinstance(training_step_output.get("loss"), torch.Tensor):
                extra = {key: value for key, value in training_step_output.items() if key != "loss"}
                return cls(training_step_output["loss"], extra=extra)
        return super().from_training_step_output(training_step_output, normalize)


def install_run_shortcuts(trainer: pl.Trainer) -> None:
    """Shortcuts 3 and 4 (module docstring) for this trainer's run; a profiler the user chose is kept."""
    # Lightning's connectors set `profiler` on the Trainer; its class does not declare it
    current = trainer.profiler  # type: ignore[attr-defined]  # see above
    if type(current) is PassThroughProfiler:
        profiler = _NullContextProfiler()
        profiler.__dict__.update(current.__dict__)  # stage, rank and log dir it was set up with
        trainer.profiler = profiler  # type: ignore[attr-defined]  # see above
    automatic = trainer.fit_loop.epoch_loop.automatic_optimization
    if isinstance(automatic, _AutomaticOptimization) and automatic.output_result_cls is ClosureResult:
        automatic.output_result_cls = _UnscaledClosureResult
