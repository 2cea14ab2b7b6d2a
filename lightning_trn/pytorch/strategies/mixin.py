"""`NeuronStrategyMixin`: what every Neuron strategy does the same way, single-device or data-parallel."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.profilers import XLAProfiler
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import find_shared_parameters, set_shared_parameters
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

from lightning_trn.core.device_loader import DevicePrefetchLoader
from lightning_trn.core.random_state import RANDOM_STATE_KEY
from lightning_trn.core.sharded_save import remove
from lightning_trn.core.strategy import NeuronStrategyCore
from lightning_trn.hooks import registry as lightning_hooks
from lightning_trn.hooks.logging import settle_progress_bar_metrics
from lightning_trn.hooks.loop_shortcuts import install_run_shortcuts
from lightning_trn.precompile import GRAPHS_ONLY_ENV, apply_precompile_limits, graphs_only
from lightning_trn.pytorch.callbacks.progress_bar import HostSyncFreeMetricsMixin, host_sync_free_replacement
from lightning_trn.pytorch.precision import NeuronPrecision

log = logging.getLogger(__name__)

#: `_resume_random_state` when the run does not resume a training checkpoint
_NOT_RESUMING = object()

#: LightningModule / LightningDataModule hooks that may change a batch on its way to the device
_BATCH_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def _resume_position(trainer: pl.Trainer) -> Callable[[], int]:
    """How many training batches of the current epoch the fit loop counts as done when it resumes mid-epoch (0
    otherwise, and for every evaluation loader); read at the loader's first `next()`, after the loop's restore."""
    fit_loop = trainer.fit_loop
    progress = fit_loop.epoch_loop.batch_progress

    def position() -> int:
        if trainer.training and fit_loop.restarting and not progress.is_last_batch:
            return progress.current.processed
        return 0

    return position


def _train_prefetchers(trainer: pl.Trainer) -> list[DevicePrefetchLoader]:
    """The device prefetchers iterating the fit loop's training loaders (empty before the fit loop set them up)."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return [] if combined is None else [dl for dl in combined.flattened if isinstance(dl, DevicePrefetchLoader)]


def _resumes_mid_epoch(trainer: pl.Trainer) -> bool:
    """Whether a run resumed from a checkpoint taken now continues inside the current training epoch (the loader
    then skips the batches done, see `_resume_position`), rather than at the next epoch's start."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return trainer.training and not progress.is_last_batch and progress.current.processed > 0


class NeuronStrategyMixin(NeuronStrategyCore):
    """Mixed into a Lightning strategy: device placement, prefetching, one graph cut per optimizer step, portable
    checkpoints. Strategies override `reduce_gradients` to all-reduce between backward and the optimizer update."""

    #: read by `lightning_trn.hooks.logging`: leave `prog_bar=True` values as tensors instead of syncing per step
    defer_progress_bar_metrics: bool = False
    #: read by `lightning_trn.hooks.logging`: repeated `self.log` calls update Lightning's stored result directly
    fast_log: bool = True
    #: read by `lightning_trn.hooks.loop_shortcuts`: `reduce` takes host tensors (data-parallel: over the host group)
    reduces_host_tensors: bool = True
    #: read by `lightning_trn.hooks.logging`: epoch-level logged values are computed from host copies of their
    #: states (one transfer), not as small graphs (in one-process runs)
    epoch_values_on_host: bool = True
    _precision_plugin: Optional[Precision]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: set in `setup`: no batch-transfer hook of the model or datamodule is overridden
        self._batch_transfer_is_default = False
        #: the last training batch ended with the optimizer step's graph cut, and nothing ran since (see
        #: `on_train_batch_start`)
        self._cut_after_step = False
        #: this strategy's run holds the hooks into Lightning's internals (`lightning_trn.hooks.registry`)
        self._holds_lightning_hooks = False
        #: where the runtime records the `XLAProfiler` trace of the current run (None: no trace running)
        self._trace_dir: Optional[str] = None
        #: the random state of the checkpoint `fit` resumes from, put back at `on_train_start`
        self._resume_random_state: Any = _NOT_RESUMING

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = NeuronPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = plugin

    def _neuron_precision(self) -> Precision:
        return self.precision_plugin

    def model_to_device(self) -> None:
        self._move_keeping_ties(self.model)  # type: ignore[attr-defined]

    def process_dataloader(self, dataloader: object) -> object:
        """Batches are copied to the device in the background while the previous step runs; a training loader
        resumes mid-epoch at the fit loop's own count."""
        module = self._lightning_module  # type: ignore[attr-defined]
        trainer = module._trainer if module is not None else None
        return self._prefetching(dataloader, position=None if trainer is None else _resume_position(trainer))

    def batch_to_device(self, batch: Any, device: Optional[Any] = None, dataloader_idx: int = 0) -> Any:
        """A batch just delivered by the device prefetcher is on the device already: hand it over as it is, unless a
        batch-transfer hook is overridden. Lightning's path would walk it through two more hooks and a `.to()` per
        tensor that changes nothing (host time every step)."""
        if device is None and self._batch_transfer_is_default and self._delivered(batch):
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Hook between backward and the optimizer update; single-device strategies have nothing to reduce."""

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        """Run forward/backward, reduce gradients, update, then cut the graph once so the step compiles as one."""

        def closure_and_reduce() -> Any:
            result = closure()
            self.reduce_gradients(optimizer)
            return result

        output = super().optimizer_step(optimizer, closure_and_reduce, model, **kwargs)  # type: ignore[misc]
        self._after_update(optimizer)
        self.runtime.sync()
        self._cut_after_step = True
        return output

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Cut the graph before this step unless the previous step ended with its optimizer-step cut.

        Cut: at an epoch's first batch, after validation, and after a batch without an optimizer step (gradient
        accumulation, manual optimization): the work traced since then becomes its own small graph instead of
        joining, and changing, this step's graph. No cut otherwise: a cut with nothing to run still takes about the
        last step's execution time in a training loop (benchmarks/README.md), time in which the host can trace this
        step while the device runs the last one. Then the device RNG is seeded for this batch of the run
        (`lightning_trn.core.random_state.step_seed`: an exact resume whatever the cuts before).
        """
        if batch_idx == 0 or not self._cut_after_step:
            self.runtime.sync()
        self._cut_after_step = False
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        self._seed_batch(trainer.fit_loop.epoch_loop.total_batch_idx)
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    def on_train_start(self) -> None:
        """Resuming a checkpoint: put back its random state (host, training loaders, device seed) now, after the
        sanity check and before the first training batch is drawn, or say once why the resume is not exact."""
        super().on_train_start()  # type: ignore[misc]
        if self._resume_random_state is not _NOT_RESUMING:
            saved, self._resume_random_state = self._resume_random_state, _NOT_RESUMING
            trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
            self._restore_random_state(saved, _train_prefetchers(trainer))

    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load; when `fit` resumes the checkpoint, its random state is kept for `on_train_start`."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        module = self._lightning_module  # type: ignore[attr-defined]
        if module is not None and module._trainer is not None and module._trainer.state.fn == TrainerFn.FITTING:
            self._resume_random_state = checkpoint.pop(RANDOM_STATE_KEY, None)
        return checkpoint

    def on_validation_end(self) -> None:
        self._cut_after_step = False  # epoch-end work of the validation loop is pending
        super().on_validation_end()  # type: ignore[misc]

    def _step_then_cut(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        output = step(*args, **kwargs)
        self.runtime.sync()
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Each evaluation step is one graph: cut right after it, so the next batch is traced while it runs."""
        return self._step_then_cut(super().validation_step, *args, **kwargs)  # type: ignore[misc]

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """See `validation_step`."""
        return self._step_then_cut(super().test_step, *args, **kwargs)  # type: ignore[misc]

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """See `validation_step`."""
        return self._step_then_cut(super().predict_step, *args, **kwargs)  # type: ignore[misc]

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Materialise pending device work first, so the tensors copied to the host are the current ones; add every
        rank's random state (`lightning_trn.core.random_state`). Called on every rank. A sharded checkpoint (a
        directory every rank writes part of) replaces the previous one only once complete
        (`lightning_trn.core.sharded_save`).

        Skipped (with a log line) under `NEURON_EXTRACT_GRAPHS_ONLY=1`, where tensors hold fake values.
        """
        if graphs_only():
            log.info("lightning_trn: %s=1, outputs are fake: not saving checkpoint %s.", GRAPHS_ONLY_ENV, filepath)
            return
        self.runtime.sync()
        module = self._lightning_module  # type: ignore[attr-defined]
        if module is not None and module._trainer is not None:
            trainer = module._trainer
            random_state = self._random_state_to_save(_train_prefetchers(trainer), _resumes_mid_epoch(trainer))
            checkpoint = {**checkpoint, RANDOM_STATE_KEY: random_state}
        with self._save_destination(filepath) as target:
            checkpoint, target = self._split_checkpoint(checkpoint, target)
            super().save_checkpoint(checkpoint, target, storage_options=storage_options)  # type: ignore[misc]

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 deletes a local checkpoint directory (`ModelCheckpoint`'s `save_top_k`) by renaming it to a hidden
        name first (`lightning_trn.core.sharded_save.remove`): a kill never leaves half of it under its name."""
        if not (self.is_global_zero and os.path.isdir(filepath)):  # type: ignore[attr-defined]
            super().remove_checkpoint(filepath)  # type: ignore[misc]
            return
        remove(filepath)

    def setup(self, trainer: pl.Trainer) -> None:
        if not self._holds_lightning_hooks:
            lightning_hooks.acquire()
            self._holds_lightning_hooks = True
        self._seed_device()
        self._apply_activation_checkpointing(self.model)  # type: ignore[attr-defined]
        super().setup(trainer)  # type: ignore[misc]
        apply_precompile_limits(trainer)  # `python -m lightning_trn.precompile` shortens the run
        self._use_host_sync_free_progress_bar(trainer)
        self._evaluate_under_no_grad(trainer)
        install_run_shortcuts(trainer)
        self._start_profiler_trace(trainer)
        self._batch_transfer_is_default = not any(
            is_overridden(hook, instance)
            for instance in (trainer.lightning_module, trainer.datamodule)
            if instance is not None
            for hook in _BATCH_TRANSFER_HOOKS
        )

    def teardown(self) -> None:
        """Hand the deferred progress-bar metrics back as numbers (one host read), then Lightning's teardown, which
        moves the model to the CPU: re-tie the weights that moving off the device untied. Lightning's internals get
        their originals back (`lightning_trn.hooks.registry`)."""
        try:
            module = self._lightning_module  # type: ignore[attr-defined]
            if module is None:
                super().teardown()  # type: ignore[misc]
                return
            if self.defer_progress_bar_metrics and module._trainer is not None:
                settle_progress_bar_metrics(module._trainer)
            shared = find_shared_parameters(module)
            super().teardown()  # type: ignore[misc]
            set_shared_parameters(module, shared)
        finally:
            self._resume_random_state = _NOT_RESUMING
            if self._holds_lightning_hooks:
                self._holds_lightning_hooks = False
                lightning_hooks.release()
            if self._trace_dir is not None:
                self._trace_dir = None
                self.runtime.stop_trace()

    def _start_profiler_trace(self, trainer: pl.Trainer) -> None:
        """With `Trainer(profiler="xla")` Lightning only starts torch_xla's profiler server, for a capture from
        TensorBoard. Record the run as well: the trace is written at teardown, TensorBoard's profile layout, under
        the profiler's `dirpath`, else the Trainer's log dir (`<dir>/xla_trace[/rank<N>]/plugins/profile/<run>/`)."""
        profiler = trainer.profiler
        if not isinstance(profiler, XLAProfiler) or self._trace_dir is not None:
            return
        trace_dir = os.path.join(str(profiler.dirpath), "xla_trace")  # the Trainer set it to its log dir if unset
        if trainer.world_size > 1:  # each rank writes `<host>.xplane.pb`: ranks on one host would overwrite
            trace_dir = os.path.join(trace_dir, f"rank{trainer.global_rank}")
        try:
            started = self.runtime.start_trace(trace_dir)
        except (RuntimeError, AttributeError) as err:  # another trace is running; torch_xla < 2.7 has no start_trace
            rank_zero_warn(f"lightning_trn: not recording an XLA profiler trace of this run: {err}")
            return
        if started:
            self._trace_dir = trace_dir
            rank_zero_info(f"lightning_trn: recording an XLA profiler trace of this run into {trace_dir} "
                           "(TensorBoard's profile plugin reads it).")

    @staticmethod
    def _evaluate_under_no_grad(trainer: pl.Trainer) -> None:
        """XLA tensors fail under `torch.inference_mode` ("Cannot set version_counter for inference tensor");
        Lightning switches its loops to `no_grad` only for its own XLAAccelerator, so do it here."""
        loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
        for loop in loops:
            loop.inference_mode = False

    def _use_host_sync_free_progress_bar(self, trainer: pl.Trainer) -> None:
        """Swap Lightning's stock progress bar for one that reads the device only at logging intervals, and keep
        progress-bar metrics as tensors (`defer_progress_bar_metrics`) when no other bar needs them every step."""
        bar = trainer.progress_bar_callback
        replacement = host_sync_free_replacement(bar)
        if replacement is not None:
            trainer.callbacks[trainer.callbacks.index(bar)] = replacement
            replacement.setup(trainer, trainer.lightning_module, stage=trainer.state.fn)
            bar = replacement
        elif bar is not None and not isinstance(bar, HostSyncFreeMetricsMixin):
            rank_zero_info(
                f"lightning_trn: keeping your progress bar {type(bar).__name__}: it reads its metrics from the device "
                "at every refresh, a host sync that stalls the device each time (Lightning's own TQDMProgressBar and "
                "RichProgressBar are swapped for host-sync-free ones that keep your options)."
            )
        self.defer_progress_bar_metrics = bar is None or isinstance(bar, HostSyncFreeMetricsMixin)
