"""Two version-guarded hooks into Lightning's logging internals that cost XLA runs a sync or time every step.

1. Stop Lightning from reading `prog_bar=True` metrics on the host after every batch in Neuron runs.
`_LoggerConnector.on_batch_end` rebuilds the metric dictionaries each batch, and `_ResultCollection.metrics` turns
every progress-bar value into a Python number (`.item()`): a device-to-host sync per step even with the progress bar
off. While a Neuron strategy says `defer_progress_bar_metrics`, that conversion is skipped and the values stay tensors;
a host-sync-free progress bar (or the user) converts them when it wants to. Version-guarded like `_registration`.

2. Skip `_ResultMetric.to(device)` when its tensors are already there. `_ResultCollection.log` calls it on every
`self.log`, and it walks the whole result object (states, defaults, caches) through `apply_to_collection`: about
0.4 ms of host time per call, a sizeable share of a small model's step (benchmarks/README.md). Only XLA devices take
the shortcut, and only when the previous move went to the same device, so any move elsewhere is still done in full.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch

from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result

_DEFER_CONVERSION: ContextVar[bool] = ContextVar("lightning_trn_defer_pbar_conversion", default=False)


def install_deferred_metrics_hook() -> bool:
    """Wrap the progress-bar conversion; returns False if this Lightning version lacks the expected internals."""
    connector = logger_connector._LoggerConnector
    if getattr(connector, "_lightning_trn_hooked", False):
        return True
    metrics_property = connector.__dict__.get("metrics")
    if not isinstance(metrics_property, property) or not callable(getattr(result, "convert_tensors_to_scalars", None)):
        return False

    convert = result.convert_tensors_to_scalars

    def convert_unless_deferred(value: Any) -> Any:
        return value if _DEFER_CONVERSION.get() else convert(value)

    def metrics(self: Any) -> Any:
        if not getattr(self.trainer.strategy, "defer_progress_bar_metrics", False):
            return metrics_property.fget(self)
        token = _DEFER_CONVERSION.set(True)
        try:
            return metrics_property.fget(self)
        finally:
            _DEFER_CONVERSION.reset(token)

    result.convert_tensors_to_scalars = convert_unless_deferred
    connector.metrics = property(metrics, doc=metrics_property.__doc__)
    connector._lightning_trn_hooked = True
    return True


def install_result_move_shortcut() -> bool:
    """Wrap `_ResultMetric.to`; returns False if this Lightning version lacks the expected method."""
    result_metric = result._ResultMetric
    if getattr(result_metric, "_lightning_trn_hooked", False):
        return True
    move = result_metric.__dict__.get("to")
    if not callable(move):
        return False

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = args[0] if len(args) == 1 and not kwargs else None
        if isinstance(device, torch.device) and device.type == "xla":
            if self.__dict__.get("_lightning_trn_device") == device:
                return self
            moved = move(self, *args, **kwargs)
            object.__setattr__(self, "_lightning_trn_device", device)
            return moved
        object.__setattr__(self, "_lightning_trn_device", None)  # moved elsewhere, or by other arguments
        return move(self, *args, **kwargs)

    result_metric.to = to
    result_metric._lightning_trn_hooked = True
    return True
