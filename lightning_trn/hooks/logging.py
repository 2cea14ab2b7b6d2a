"""Five hooks into Lightning's logging internals that cost XLA runs a sync, a graph or time every step.

Each function here takes Lightning's original and returns its replacement (None where this Lightning version lacks
what it relies on); `lightning_trn.hooks.registry` installs them for Neuron runs only and restores the originals.

1. Stop Lightning from reading `prog_bar=True` metrics on the host after every batch in Neuron runs.
`_LoggerConnector.on_batch_end` rebuilds the metric dictionaries each batch, and `_ResultCollection.metrics` turns
every progress-bar value into a Python number (`.item()`): a device-to-host sync per step even with the progress bar
off. While a Neuron strategy's contract (`lightning_trn.hooks.contract`) says `defer_progress_bar_metrics`, that
conversion is skipped and the values stay tensors; a host-sync-free progress bar (or the user) converts them when it
wants to.

2. Skip `_ResultMetric.to(device)` when its tensors are already there. `_ResultCollection.log` calls it on every
`self.log`, and it walks the whole result object (states, defaults, caches) through `apply_to_collection`: about
0.4 ms of host time per call, a sizeable share of a small model's step (benchmarks/README.md). Only XLA devices take
the shortcut, and only when the previous move went to the same device, so any move elsewhere is still done in full.

3. A fast path for repeated `self.log` calls in Neuron runs. `LightningModule.log` re-validates every call (value
types, hook name, `inspect.signature` of `training_step`, a new `_Metadata` compared field by field with the stored
one): about 0.3 ms of host time per call on XLA:CPU, paid by every step of a host-bound pipeline. While a Neuron
strategy says `fast_log`, a call whose hook, name, options and kind of value match an earlier call that Lightning
validated and stored updates that stored result directly, exactly as `_ResultCollection.update_metrics` does. Anything
else (first call, new epoch, a move off the device, other arguments) goes through Lightning unchanged.

4. Epoch-level values (`on_epoch=True` means and sums, `Metric.compute`) computed on the host. Lightning computes each
on the device when the epoch ends, and the bar, the logger and the callbacks then read them one `.item()` at a time:
on XLA a small graph per kind of value (compiled once each, and again at every place a different set of them is
pending) and a transfer per read, at every epoch end. While a one-process Neuron strategy says
`epoch_values_on_host`, the states they come from are copied to the host in one transfer and Lightning's own
computation runs on those copies (`lightning_trn.hooks.metric_states.epoch_values_on_host`); the values it stores are
host tensors, as Lightning's teardown would leave them. Across processes the values' `sync_dist` reductions stay on
the device.

5. The values of a logging step read in one transfer. The progress bar and `_LoggerConnector.log_metrics` each turn
every device value they show or log into a Python number (`.item()`): a transfer per value and per reader, twice per
logging step for a value both show (`train_loss`), where a hand-written loop reads it once. In Neuron runs both read
through `values_to_host`: the first reader of a step copies every value it needs, and the step's other logged values
with them, to the host in one batched transfer (`DeviceRuntime.to_host`), and leaves the copies where Lightning
keeps those values, so the next reader finds them on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result
from torchmetrics import Metric

from lightning_trn.core.scalars import NEURON_DEVICE_TYPES, place_scalars
from lightning_trn.hooks.contract import contract_of
from lightning_trn.hooks.metric_states import epoch_values_on_host

_DEFER_CONVERSION: ContextVar[bool] = ContextVar("lightning_trn_defer_pbar_conversion", default=False)
#: `_ResultMetric` attribute: the XLA device its last move went to (None after a move anywhere else)
_MOVED_TO = "_lightning_trn_device"


def settle_progress_bar_metrics(trainer: Any) -> None:
    """End of a run that deferred the progress-bar conversion (hook 1): turn the stored values into Python numbers
    once, as Lightning leaves them (`trainer.progress_bar_metrics` must stay JSON-serialisable after `fit`)."""
    connector = trainer._logger_connector
    if hasattr(connector, "_progress_bar_metrics"):
        connector._progress_bar_metrics = result.convert_tensors_to_scalars(connector.progress_bar_metrics)


def _on_device(value: Any) -> bool:
    """A plain tensor on a Neuron device (subclasses such as DTensor are left to Lightning's own conversion)."""
    return type(value) is torch.Tensor and value.device.type in NEURON_DEVICE_TYPES


def _step_results(trainer: Any) -> list[Any]:
    """The current step's logged results (`_ResultMetric`s) whose step value (`_forward_cache`) is still on a Neuron
    device: what the bar, the logger and the callbacks read at this step (empty between steps: epoch ends)."""
    results = trainer._results
    if results is None or getattr(trainer._logger_connector, "_first_loop_iter", None) is None:
        return []
    return [
        result_metric
        for _, result_metric in results.valid_items()
        if result_metric.meta.on_step
        and not result_metric.meta.enable_graph
        and _on_device(result_metric._forward_cache)
    ]


def values_to_host(trainer: Any, values: dict[str, Any]) -> None:
    """Hook 5: replace, in place, the device tensors in `values` (metrics about to be shown or logged) by host copies,
    fetched in one transfer together with the current step's logged values, which become host copies where Lightning
    keeps them (their `_forward_cache`): every later reader of this step's values finds them on the host. A reader
    with nothing on the device reads nothing (so never more than Lightning would), and outside a Neuron run (a
    strategy without a runtime) nothing changes."""
    runtime = getattr(trainer.strategy, "runtime", None)
    names = [name for name, value in values.items() if _on_device(value)]
    if runtime is None or not names:
        return
    step_results = _step_results(trainer)
    copies = runtime.to_host(
        [values[name] for name in names] + [result_metric._forward_cache for result_metric in step_results]
    )
    for name, copy in zip(names, copies[: len(names)], strict=True):
        values[name] = copy
    for result_metric, copy in zip(step_results, copies[len(names) :], strict=True):
        result_metric._forward_cache = copy


def logging_from_host(log_metrics: Any) -> Callable[..., None] | None:
    """Hook 5, replacing `_LoggerConnector.log_metrics`: the loggers get the values from host copies fetched in one
    transfer (`values_to_host`), instead of Lightning's one `.item()` per value."""
    if not callable(log_metrics):
        return None

    @functools.wraps(log_metrics)
    def log_metrics_from_host(self: Any, metrics: Any, step: int | None = None) -> None:
        if self.trainer.loggers and isinstance(metrics, dict) and metrics:
            metrics = dict(metrics)  # the caller's dictionary stays as it was
            values_to_host(self.trainer, metrics)
        return log_metrics(self, metrics, step)

    return log_metrics_from_host


def conversion_unless_deferred(convert: Any) -> Callable[[Any], Any] | None:
    """Hook 1, replacing `result.convert_tensors_to_scalars`: no conversion while `deferring_metrics` says so."""
    if not callable(convert):
        return None

    def convert_unless_deferred(value: Any) -> Any:
        return value if _DEFER_CONVERSION.get() else convert(value)

    return convert_unless_deferred


def deferring_metrics(metrics_property: Any) -> property | None:
    """Hook 1, replacing the `_LoggerConnector.metrics` property: defer the conversion while the strategy says
    `defer_progress_bar_metrics`."""
    if not isinstance(metrics_property, property) or metrics_property.fget is None:
        return None
    getter = metrics_property.fget

    def metrics(self: Any) -> Any:
        strategy = self.trainer.strategy
        contract = contract_of(strategy)
        compute = getter
        # across processes, `sync_dist` runs on the device; so do torchmetrics' syncs under a one-process group
        # (`neuron_ddp`/`fsdp` with one device), which the native `neuron` backend refuses on host tensors
        if (
            getattr(self, "_first_loop_iter", 0) is None
            and contract.epoch_values_on_host
            and getattr(strategy, "world_size", 1) == 1
            and not torch.distributed.is_initialized()
        ):
            compute = _computing_on_host(compute)  # hook 4: epoch-level values
        if not contract.defer_progress_bar_metrics:
            return compute(self)
        token = _DEFER_CONVERSION.set(True)
        try:
            return compute(self)
        finally:
            _DEFER_CONVERSION.reset(token)

    return property(metrics, doc=metrics_property.__doc__)


def _computing_on_host(compute: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Hook 4: `compute` (the `metrics` property's getter) with the results' states on the host meanwhile."""

    def on_host(connector: Any) -> Any:
        with epoch_values_on_host(connector.trainer._results, connector.trainer.strategy.runtime):
            return compute(connector)

    return on_host


def result_move_shortcut(move: Any) -> Callable[..., Any] | None:
    """Hook 2, replacing `_ResultMetric.to`: skip a move to the Neuron device the result is already on; on its first
    move there, its 0-dim states go as device buffers (`lightning_trn.hooks.metric_states`)."""
    if not callable(move):
        return None

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = args[0] if len(args) == 1 and not kwargs else None
        if isinstance(device, torch.device) and device.type in NEURON_DEVICE_TYPES:
            if self.__dict__.get(_MOVED_TO) == device:
                return self
            place_scalars(self, device)
            moved = move(self, *args, **kwargs)
            object.__setattr__(self, _MOVED_TO, device)
            return moved
        object.__setattr__(self, _MOVED_TO, None)  # moved elsewhere, or by other arguments
        return move(self, *args, **kwargs)

    return to


@dataclass(frozen=True)
class _StoredLog:
    """Where Lightning stored a validated `self.log` call: its `_ResultCollection` key and `_ResultMetric`."""

    key: str
    result_metric: Any


def _call_key(fx: str, name: str, results: Any, value: Any, options: dict[str, Any]) -> tuple | None:
    """What makes two `self.log` calls equivalent for Lightning's validation; None if not cacheable."""
    if isinstance(value, torch.Tensor):
        kind: tuple = ("tensor", value.device)
    elif isinstance(value, Metric):
        kind = ("metric", id(value))
    else:
        return None  # Python numbers become new tensors on every call: leave them to Lightning
    key = (fx, name, results.dataloader_idx, kind, tuple(sorted(options.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _storage_key(fx: str, name: str, results: Any, options: dict[str, Any]) -> str:
    """The key `_ResultCollection.log` files a value under."""
    key = f"{fx}.{name}"
    if options.get("add_dataloader_idx", True) and results.dataloader_idx is not None:
        key += f".{results.dataloader_idx}"
    return key


def _update_stored(stored: _StoredLog, value: Any, results: Any, batch_size: int | None) -> bool:
    """Update an already validated result as Lightning would; False if it cannot be done here (then Lightning logs)."""
    result_metric = stored.result_metric
    device = result_metric.__dict__.get(_MOVED_TO)  # set by the `_ResultMetric.to` shortcut
    if isinstance(value, torch.Tensor):
        if not result_metric.is_tensor or value.device != device or value.numel() != 1:
            return False
        # `LightningModule.__to_tensor`, op for op: an epoch's first call goes through Lightning, and on XLA a step
        # whose value went through here must trace the same graph (without the clone: 2 more compiles per job)
        value = value.clone().detach().squeeze()
    elif value is not result_metric.value or value.device != device:
        return False
    batch_size = results._extract_batch_size(result_metric, batch_size, result_metric.meta)
    result_metric.forward(value, batch_size)  # `_ResultCollection.update_metrics`
    result_metric.has_reset = False
    return True


def log_fast_path(log: Any) -> Callable[..., None] | None:
    """Hook 3, replacing `LightningModule.log`; None if this Lightning version lacks the internals it relies on."""
    required = (
        (logger_connector._LoggerConnector, "should_reset_tensors"),
        (result._ResultCollection, "_extract_batch_size"),
        (result._ResultMetric, "forward"),
    )
    if not callable(log) or not all(hasattr(owner, name) for owner, name in required):
        return None

    @functools.wraps(log)
    def fast_log(self: Any, name: str, value: Any, *args: Any, **options: Any) -> None:
        trainer = self._trainer
        if args or trainer is None or not contract_of(trainer.strategy).fast_log or self._fabric is not None:
            return log(self, name, value, *args, **options)
        results, fx = trainer._results, self._current_fx_name
        if results is None or fx is None or torch.compiler.is_compiling():
            return log(self, name, value, **options)
        cache: dict[tuple, _StoredLog] = results.__dict__.setdefault("_lightning_trn_stored_logs", {})
        call = _call_key(fx, name, results, value, options)
        stored = cache.get(call) if call is not None else None
        if (
            stored is not None
            and results.get(stored.key) is stored.result_metric
            and not trainer._logger_connector.should_reset_tensors(fx)
            and _update_stored(stored, value, results, options.get("batch_size"))
        ):
            trainer._logger_connector._current_fx = fx
            return None
        log(self, name, value, **options)
        if call is not None:
            key = _storage_key(fx, name, results, options)
            if key in results:
                cache[call] = _StoredLog(key, results[key])
        return None

    return fast_log
