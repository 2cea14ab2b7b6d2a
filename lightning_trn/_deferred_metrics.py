"""Stop Lightning from reading `prog_bar=True` metrics on the host after every batch in Neuron runs.

`_LoggerConnector.on_batch_end` rebuilds the metric dictionaries each batch, and `_ResultCollection.metrics` turns
every progress-bar value into a Python number (`.item()`): a device-to-host sync per step even with the progress bar
off. While a Neuron strategy says `defer_progress_bar_metrics`, that conversion is skipped and the values stay tensors;
a host-sync-free progress bar (or the user) converts them when it wants to. Version-guarded like `_registration`.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

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
