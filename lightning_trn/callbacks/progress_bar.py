"""Progress bars that read metrics from the device only every `log_every_n_steps` steps, not every batch.

Lightning's stock bars turn every `prog_bar=True` value into a Python number at each refresh: a device-to-host
sync per step that stalls the XLA pipeline. These show the same metrics, refreshed at the logging interval and at
epoch/validation ends.
"""

from __future__ import annotations

from typing import Optional, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import get_standard_metrics

_Metrics = dict[str, Union[int, str, float, dict[str, float]]]


class HostSyncFreeMetricsMixin:
    """`get_metrics` that reuses the last values between logging intervals instead of reading the device."""

    _cached_metrics: Optional[_Metrics] = None
    _cached_step: int = -1

    def _refresh_due(self, trainer: pl.Trainer) -> bool:
        if self._cached_metrics is None or not trainer.training:
            return True
        interval = max(1, trainer.log_every_n_steps)  # refresh on the steps the logger reads the device anyway
        return trainer.global_step // interval != self._cached_step // interval

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> _Metrics:
        if self._refresh_due(trainer):
            # Lightning's own conversion (not the one `_logging_hooks` defers): one `.item()` per value
            pbar = convert_tensors_to_scalars(dict(trainer.progress_bar_metrics))
            self._cached_metrics = {**get_standard_metrics(trainer), **pbar}
            self._cached_step = trainer.global_step
        return dict(self._cached_metrics or {})

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cached_metrics = None  # show the epoch's final values
        super().on_train_epoch_end(trainer, pl_module)  # type: ignore[misc]

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cached_metrics = None  # show the new validation metrics
        super().on_validation_end(trainer, pl_module)  # type: ignore[misc]


class NeuronTQDMProgressBar(HostSyncFreeMetricsMixin, TQDMProgressBar):
    """`TQDMProgressBar` without a host sync per step."""


class NeuronRichProgressBar(HostSyncFreeMetricsMixin, RichProgressBar):
    """`RichProgressBar` without a host sync per step."""


def host_sync_free_replacement(progress_bar: object) -> Optional[HostSyncFreeMetricsMixin]:
    """Our bar for Lightning's stock bar of exactly that type (the Trainer's default), else None."""
    if type(progress_bar) is TQDMProgressBar:
        return NeuronTQDMProgressBar(refresh_rate=progress_bar.refresh_rate)
    if type(progress_bar) is RichProgressBar:
        return NeuronRichProgressBar(refresh_rate=progress_bar.refresh_rate)
    return None
