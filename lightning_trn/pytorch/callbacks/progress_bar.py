"""Progress bars that read metrics from the device only every `log_every_n_steps` steps, and redraw at most 10 times
a second.

Lightning's stock bars turn every `prog_bar=True` value into a Python number at each refresh: a device-to-host
sync per step that stalls the XLA pipeline. These show the same metrics, refreshed at the logging interval and at
epoch/validation ends, read in one transfer that the logger of the same step shares (`values_to_host`). The stock
bars also redraw on every batch (TQDM) or up to 100 times a second (Rich, from a thread that holds the GIL while it
renders). On XLA the host's Python time is what feeds the device, so a small model pays for every redraw; these
redraw on a clock instead.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar, get_standard_metrics
from typing_extensions import override

from lightning_trn.hooks.logging import values_to_host

_Metrics = dict[str, int | str | float | dict[str, float]]
DEFAULT_MAX_REDRAWS_PER_SECOND = 10.0

# the type checker sees `ProgressBar`'s members here; at run time the mixin comes before one of Lightning's bars,
# which brings `ProgressBar` into the MRO (`object` changes nothing)
if TYPE_CHECKING:
    _ProgressBarBase = ProgressBar
else:
    _ProgressBarBase = object


class HostSyncFreeMetricsMixin(_ProgressBarBase):
    """`get_metrics` that reuses the last values between logging intervals instead of reading the device, and a
    clock that limits redraws to `max_redraws_per_second`."""

    _cached_metrics: _Metrics | None = None
    _cached_step: int = -1
    _last_redraw: float = float("-inf")

    def __init__(
        self, *args: Any, max_redraws_per_second: float = DEFAULT_MAX_REDRAWS_PER_SECOND, **kwargs: Any
    ) -> None:
        if max_redraws_per_second <= 0:
            raise ValueError(f"max_redraws_per_second must be > 0, got {max_redraws_per_second}.")
        self.max_redraws_per_second = max_redraws_per_second
        super().__init__(*args, **kwargs)

    def _redraw_due(self, last: bool = False) -> bool:
        """True (and the clock restarts) if the last redraw is at least 1 / `max_redraws_per_second` ago, or `last`."""
        now = time.monotonic()
        if last or now - self._last_redraw >= 1.0 / self.max_redraws_per_second:
            self._last_redraw = now
            return True
        return False

    def _refresh_due(self, trainer: pl.Trainer) -> bool:
        if self._cached_metrics is None or not trainer.training:
            return True
        # refresh on the steps the logger reads the device anyway (Lightning's logger connector sets
        # `log_every_n_steps` on the Trainer; its class does not declare it)
        interval = max(1, trainer.log_every_n_steps)  # type: ignore[attr-defined]  # see above
        return trainer.global_step // interval != self._cached_step // interval

    def _read_metrics_if_due(self, trainer: pl.Trainer) -> None:
        if self._refresh_due(trainer):
            metrics = trainer.progress_bar_metrics
            # in a Neuron run, one transfer for all device values, shared with the step's logger (left in Lightning's
            # store as host copies); Lightning's own conversion (not the one `lightning_trn.hooks.logging` defers)
            # then reads host tensors
            values_to_host(trainer, metrics)
            pbar = convert_tensors_to_scalars(dict(metrics))
            self._cached_metrics = {**get_standard_metrics(trainer), **pbar}
            self._cached_step = trainer.global_step

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> _Metrics:
        self._read_metrics_if_due(trainer)
        return dict(self._cached_metrics or {})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # read on the same steps whether or not this batch is drawn (the redraw clock must not decide when the device
        # is read): the first batch, the logging steps, and the first batch after an epoch end
        self._read_metrics_if_due(trainer)
        super().on_train_batch_end(trainer, pl_module, *args)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cached_metrics = None  # show the epoch's final values
        super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cached_metrics = None  # show the new validation metrics
        super().on_validation_end(trainer, pl_module)


class NeuronTQDMProgressBar(HostSyncFreeMetricsMixin, TQDMProgressBar):
    """`TQDMProgressBar` without a host sync per step; redraws every `refresh_rate` batches, at most
    `max_redraws_per_second` times a second, and at each loop's last batch."""

    @override
    def _should_update(self, current: int, total: int | float) -> bool:
        # Lightning passes `float("inf")` totals (an iterable without a length) despite its `int` annotation
        should_update = super()._should_update(current, total)  # type: ignore[arg-type]  # see above
        return should_update and self._redraw_due(last=current == total)


class NeuronRichProgressBar(HostSyncFreeMetricsMixin, RichProgressBar):
    """`RichProgressBar` without a host sync per step; draws at most `max_redraws_per_second` times a second (hard
    refreshes, and the final frame when the bar stops, are always drawn)."""

    @property
    @override
    def refresh_rate(self) -> float:
        """Wake-ups per second of the render thread: each one takes the GIL from the training loop."""
        return min(super().refresh_rate, self.max_redraws_per_second)

    @override
    def refresh(self, hard: bool = False) -> None:
        if hard or self._redraw_due():
            super().refresh(hard=hard)


def host_sync_free_replacement(progress_bar: object) -> HostSyncFreeMetricsMixin | None:
    """Our bar for Lightning's stock bar of exactly that type (the Trainer's default, or one the user configured),
    holding every option of `progress_bar` (`refresh_rate`, `leave`, `process_position`, `theme`, console settings):
    its attributes are copied as they are. None for any other bar."""
    replacement_class = _REPLACEMENTS.get(type(progress_bar))
    if replacement_class is None:
        return None
    replacement = replacement_class.__new__(replacement_class)
    replacement.__dict__.update(vars(progress_bar))
    replacement.max_redraws_per_second = DEFAULT_MAX_REDRAWS_PER_SECOND
    return replacement


_REPLACEMENTS: dict[type, type[HostSyncFreeMetricsMixin]] = {
    TQDMProgressBar: NeuronTQDMProgressBar,
    RichProgressBar: NeuronRichProgressBar,
}
