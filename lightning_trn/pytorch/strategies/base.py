"""`NeuronStrategyBase`: the base of every Trainer Neuron strategy, over Lightning's strategy class.

`setup` runs the strategy's `setup_steps` in order, each a method `_<name>(trainer)` defined once, here or in the
strategy that adds it, listed by reference at the end of the class (an editor follows them); docs/architecture.md
lists each strategy's steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.profilers import XLAProfiler
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import find_shared_parameters, set_shared_parameters
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trn.core.checkpoint.random_state import RANDOM_STATE_KEY
from lightning_trn.core.device_loader import DevicePrefetchLoader
from lightning_trn.core.strategy import NeuronStrategyCore
from lightning_trn.hooks import registry as lightning_hooks
from lightning_trn.hooks.contract import HookContract
from lightning_trn.hooks.logging import settle_progress_bar_metrics
from lightning_trn.hooks.loop_shortcuts import install_run_shortcuts
from lightning_trn.precompile import GRAPHS_ONLY_ENV, apply_precompile_limits, graphs_only
from lightning_trn.pytorch.callbacks.progress_bar import HostSyncFreeMetricsMixin, host_sync_free_replacement
from lightning_trn.pytorch.precision import NeuronPrecision
from lightning_trn.pytorch.strategies.host_signals import install_host_sigterm_sync

# the type checker sees Lightning's strategy members here; at run time each strategy names its Lightning class after
# this base, which keeps it out of the MRO in between (`object` changes nothing)
if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy as _LightningStrategy
else:
    _LightningStrategy = object

log = logging.getLogger(__name__)


class _NotResuming:
    """`_resume_random_state` when the run does not resume a training checkpoint. It copies as itself, because a
    strategy may be deep-copied (the estimator copies one per simulated rank) and a copied `object()` sentinel would
    read as a checkpoint's random state ("a format this version does not read")."""

    def __copy__(self) -> _NotResuming:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _NotResuming:
        return self


_NOT_RESUMING = _NotResuming()

#: LightningModule / LightningDataModule hooks that may change a batch on its way to the device
_BATCH_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def _resume_position(trainer: pl.Trainer) -> Callable[[], int]:
    """How many training batches of the current epoch the fit loop counts as done when it resumes mid-epoch (0
    otherwise, and for every evaluation loader); read at the loader's first `next()`, after the loop's restore."""
    fit_loop = trainer.fit_loop
    progress = fit_loop.epoch_loop.batch_progress

    def position() -> int:
        if trainer.training and fit_loop.restarting and not progress.is_last_batch:
            # Lightning declares `current` a `_ReadyCompletedTracker`; it holds a `_ProcessedTracker`
            return progress.current.processed  # type: ignore[attr-defined]  # see above
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
    # Lightning declares `current` a `_ReadyCompletedTracker`; it holds a `_ProcessedTracker`
    processed: int = progress.current.processed  # type: ignore[attr-defined]  # see above
    return trainer.training and not progress.is_last_batch and processed > 0


def _checkpoint_event(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> tuple | None:
    """What identifies the state a save inside a running `fit` writes: two saves of one event (the top-k file and
    `last.ckpt` of `ModelCheckpoint(save_last=True)`) hold the same weights, optimizer and random state. The stage and
    the validation batches run tell a save after a step from one after the validation that followed it (which drew
    from the host generators). None outside a running fit, where the user may change the model between two saves."""
    if trainer.state.fn != TrainerFn.FITTING or trainer.state.status != TrainerStatus.RUNNING:
        return None
    epoch_loop = trainer.fit_loop.epoch_loop
    return (
        id(trainer),
        trainer.global_step,
        epoch_loop.total_batch_idx,
        trainer.current_epoch,
        trainer.state.stage,
        epoch_loop.val_loop.batch_progress.total.ready,
        "optimizer_states" in checkpoint,
    )


#: a step of `setup`: a strategy method taking the Trainer
Step = Callable[[Any, "pl.Trainer"], None]


class NeuronStrategyBase(NeuronStrategyCore, _LightningStrategy):
    """Over a Lightning strategy class: device placement, prefetching, one graph cut per optimizer step, portable
    checkpoints. Strategies override `reduce_gradients` to all-reduce between backward and the optimizer update."""

    _precision_plugin: Precision | None

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
        self._trace_dir: str | None = None
        #: the random state of the checkpoint `fit` resumes from, put back at `on_train_start`
        self._resume_random_state: Any = _NOT_RESUMING
        #: what the hooks into Lightning's internals read from this strategy (`lightning_trn.hooks.contract`)
        self.hook_contract = HookContract()

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = NeuronPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = plugin

    @override
    def _neuron_precision(self) -> Precision:
        return self.precision_plugin

    @override
    def model_to_device(self) -> None:
        assert self.model is not None  # Lightning moves the model once it is connected
        self._move_keeping_ties(self.model)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Batches are copied to the device in the background while the previous step runs; a training loader
        resumes mid-epoch at the fit loop's own count."""
        module = self._lightning_module
        trainer = module._trainer if module is not None else None
        return self._prefetching(dataloader, position=None if trainer is None else _resume_position(trainer))

    @override
    def batch_to_device(self, batch: Any, device: Any | None = None, dataloader_idx: int = 0) -> Any:
        """A batch just delivered by the device prefetcher is on the device already: hand it over as it is, unless a
        batch-transfer hook is overridden. Lightning's path would walk it through two more hooks and a `.to()` per
        tensor that changes nothing (host time every step)."""
        if device is None and self._batch_transfer_is_default and self._delivered(batch):
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        """Reduce `tensor` over all ranks with sum, mean ("avg"), max or min (one process: `tensor` itself);
        non-tensors are returned unchanged."""
        return self.all_reduce(tensor, group, reduce_op)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._explain_failure(exception)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run forward/backward, reduce gradients, update, then cut the graph once so the step compiles as one."""

        def closure_and_reduce() -> Any:
            result = closure()
            self.reduce_gradients(optimizer)
            return result

        output = super().optimizer_step(optimizer, closure_and_reduce, model, **kwargs)
        self._after_update(optimizer)
        self.runtime.sync()
        self._cut_after_step = True
        return output

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Cut the graph before this step unless the previous step ended with its optimizer-step cut.

        Cut: at an epoch's first batch, after validation, and after a batch without an optimizer step (gradient
        accumulation, manual optimization): the work traced since then becomes its own small graph instead of
        joining, and changing, this step's graph. No cut otherwise: a cut with nothing to run still takes about the
        last step's execution time in a training loop (benchmarks/README.md), time in which the host can trace this
        step while the device runs the last one. Then the device RNG is seeded for this batch of the run
        (`lightning_trn.core.checkpoint.random_state.step_seed`: an exact resume whatever the cuts before).
        """
        if batch_idx == 0 or not self._cut_after_step:
            self.runtime.sync()
        self._cut_after_step = False
        assert self.lightning_module is not None  # called by the Trainer's fit loop
        trainer = self.lightning_module.trainer
        self._seed_batch(trainer.fit_loop.epoch_loop.total_batch_idx)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_train_start(self) -> None:
        """Resuming a checkpoint: put back its random state (host, training loaders, device seed) now, after the
        sanity check and before the first training batch is drawn, or say once why the resume is not exact."""
        super().on_train_start()
        if self._resume_random_state is not _NOT_RESUMING:
            saved, self._resume_random_state = self._resume_random_state, _NOT_RESUMING
            assert self.lightning_module is not None  # called by the Trainer's fit loop
            trainer = self.lightning_module.trainer
            self._restore_random_state(saved, _train_prefetchers(trainer))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load; when `fit` resumes the checkpoint, its random state (this rank's own, from its own file in
        a sharded checkpoint) is kept for `on_train_start`."""
        module = self._lightning_module
        resuming = module is not None and module._trainer is not None and module._trainer.state.fn == TrainerFn.FITTING
        # an `s3://` sharded checkpoint: its committed version, DCP's reads sent there by the hooks
        with (
            lightning_hooks.installed(lightning_hooks.S3_CHECKPOINT_HOOKS),
            self._checkpointer.load_source(checkpoint_path, self._checkpoint_layout()) as source,
        ):
            checkpoint = super().load_checkpoint(source, *args, **kwargs)
            saved = checkpoint.pop(RANDOM_STATE_KEY, None)
            if resuming:
                self._resume_random_state = self._checkpointer.read_rank_file(
                    saved, source, checkpoint_path, self.global_rank, self.world_size
                )
        return checkpoint

    @override
    def on_validation_end(self) -> None:
        self._cut_after_step = False  # epoch-end work of the validation loop is pending
        super().on_validation_end()

    def _step_then_cut(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        output = step(*args, **kwargs)
        self.runtime.sync()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Each evaluation step is one graph: cut right after it, so the next batch is traced while it runs."""
        return self._step_then_cut(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """See `validation_step`."""
        return self._step_then_cut(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """See `validation_step`."""
        return self._step_then_cut(super().predict_step, *args, **kwargs)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Materialise pending device work first, so the tensors copied to the host are the current ones; add this
        rank's random state (`lightning_trn.core.checkpoint.random_state`). Called on every rank. A sharded checkpoint
        (a directory every rank writes part of) replaces the previous one only once complete, through the
        strategy's checkpointer (`lightning_trn.core.checkpoint.checkpointer`); a second name of the same
        `ModelCheckpoint` event (`save_last=True` beside a top-k file) links the first's files.

        Skipped (with a log line) under `NEURON_EXTRACT_GRAPHS_ONLY=1`, where tensors hold fake values.
        """
        if graphs_only():
            log.info("lightning_trn: %s=1, outputs are fake: not saving checkpoint %s.", GRAPHS_ONLY_ENV, filepath)
            return
        self.runtime.sync()
        module = self._lightning_module
        entry: dict[str, Any] = {}
        event = None
        if module is not None and module._trainer is not None:
            trainer = module._trainer
            entry = self._random_state_entry(_train_prefetchers(trainer), _resumes_mid_epoch(trainer))
            event = _checkpoint_event(trainer, checkpoint)

        # Lightning's sharded save refuses `storage_options`: such a save is written synchronously
        background = self._checkpointer.writes_in_background and storage_options is None

        def write(state: dict[str, Any], target: Any) -> None:
            if background:
                self._save_in_background(state, target)
            else:
                super(NeuronStrategyBase, self).save_checkpoint(state, target, storage_options=storage_options)

        with lightning_hooks.installed(lightning_hooks.S3_CHECKPOINT_HOOKS):
            self._save_through_checkpointer(checkpoint, filepath, entry, write, event, background)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """`ModelCheckpoint`'s `save_top_k`: a sharded checkpoint is removed by rank 0 through its storage, never
        leaving part of it under its name, and under asynchronous saves only once the save in flight is committed (a
        kill before leaves the older checkpoint); a one-file checkpoint as Lightning removes it."""
        self._checkpointer.remove(filepath, self.global_rank, self._checkpoint_layout(), super().remove_checkpoint)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """The strategy's `setup_steps`, in order."""
        self._run_steps(self.setup_steps, trainer)

    def _run_steps(self, steps: tuple[Step, ...], trainer: pl.Trainer) -> None:
        """Each step as this strategy's method of the step's name: a subclass's override of a step runs."""
        for step in steps:
            getattr(self, step.__name__)(trainer)

    def _probe_checkpoint_dirs(self, trainer: pl.Trainer) -> None:
        """Before the first step of `fit`: refuse a checkpoint callback's directory that not every rank shares when
        checkpoints are sharded (`lightning_trn.core.checkpoint.shared_storage`). The callbacks resolved their `dirpath`
        (the same on every rank) in their `setup`, which the Trainer runs before the strategy's."""
        if trainer.state.fn != TrainerFn.FITTING:
            return
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath is not None:
                self._checkpointer.check_directory(
                    dirpath, self.global_rank, self.world_size, self._checkpoint_layout()
                )

    def _hold_lightning_hooks(self, trainer: pl.Trainer) -> None:
        """Install the hooks into Lightning's internals for this run (`lightning_trn.hooks.registry`)."""
        if not self._holds_lightning_hooks:
            lightning_hooks.acquire()
            self._holds_lightning_hooks = True

    def _seed_device_rng(self, trainer: pl.Trainer) -> None:
        self._seed_device()

    def _checkpoint_activations(self, trainer: pl.Trainer) -> None:
        """Apply `activation_checkpointing_policy` to the model."""
        assert self.model is not None  # the Trainer connects the model before `setup`
        self._apply_activation_checkpointing(self.model)

    def _lightning_setup(self, trainer: pl.Trainer) -> None:
        """Lightning's own setup: the accelerator, the precision's module conversion, the move to the device (or
        materialization), the optimizers and the precision plugin."""
        super().setup(trainer)

    def _limit_precompile(self, trainer: pl.Trainer) -> None:
        """`python -m lightning_trn.precompile` shortens the run."""
        apply_precompile_limits(trainer)

    def _install_run_shortcuts(self, trainer: pl.Trainer) -> None:
        install_run_shortcuts(trainer)

    def _detect_batch_transfer_hooks(self, trainer: pl.Trainer) -> None:
        """Whether no batch-transfer hook of the model or datamodule is overridden (`batch_to_device`)."""
        # Lightning's connectors set `datamodule` on the Trainer; its class does not declare it
        datamodule = trainer.datamodule  # type: ignore[attr-defined]  # see above
        self._batch_transfer_is_default = not any(
            is_overridden(hook, instance)
            for instance in (trainer.lightning_module, datamodule)
            if instance is not None
            for hook in _BATCH_TRANSFER_HOOKS
        )

    def _sync_torchmetrics(self, trainer: pl.Trainer) -> None:
        """Route the LightningModule's torchmetrics syncs through the collectives (multi-process strategies)."""
        self._route_metric_syncs(self.lightning_module)

    def _agree_on_sigterm(self, trainer: pl.Trainer) -> None:
        """Agree on SIGTERM over the host group (`lightning_trn.pytorch.strategies.host_signals`)."""
        install_host_sigterm_sync(trainer, self._process_group.host_group)

    @override
    def teardown(self) -> None:
        """Hand the deferred progress-bar metrics back as numbers (one host read), then Lightning's teardown, which
        moves the model to the CPU: re-tie the weights that moving off the device untied. Lightning's internals get
        their originals back (`lightning_trn.hooks.registry`)."""
        try:
            module = self._lightning_module
            if module is None:
                super().teardown()
                return
            if self.hook_contract.defer_progress_bar_metrics and module._trainer is not None:
                settle_progress_bar_metrics(module._trainer)
            shared = find_shared_parameters(module)
            super().teardown()
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
        # Lightning's connectors set `profiler` on the Trainer; its class does not declare it
        profiler = trainer.profiler  # type: ignore[attr-defined]  # see above
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
            rank_zero_info(
                f"lightning_trn: recording an XLA profiler trace of this run into {trace_dir} "
                "(TensorBoard's profile plugin reads it)."
            )

    def _evaluate_under_no_grad(self, trainer: pl.Trainer) -> None:
        """XLA tensors fail under `torch.inference_mode` ("Cannot set version_counter for inference tensor");
        Lightning switches its loops to `no_grad` only for its own XLAAccelerator, so do it here."""
        loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
        for loop in loops:
            loop.inference_mode = False

    def _swap_progress_bar(self, trainer: pl.Trainer) -> None:
        """Swap Lightning's stock progress bar for one that reads the device only at logging intervals, and keep
        progress-bar metrics as tensors (`defer_progress_bar_metrics`) when no other bar needs them every step."""
        bar = trainer.progress_bar_callback
        replacement = host_sync_free_replacement(bar)
        if replacement is not None:
            # Lightning's connectors set `callbacks` on the Trainer; its class does not declare it
            callbacks = trainer.callbacks  # type: ignore[attr-defined]  # see above
            callbacks[callbacks.index(bar)] = replacement
            assert trainer.state.fn is not None  # the Trainer's entry point set it before the strategy's setup
            replacement.setup(trainer, trainer.lightning_module, stage=trainer.state.fn)
            bar = replacement
        elif bar is not None and not isinstance(bar, HostSyncFreeMetricsMixin):
            rank_zero_info(
                f"lightning_trn: keeping your progress bar {type(bar).__name__}: it reads its metrics from the device "
                "at every refresh, a host sync that stalls the device each time (Lightning's own TQDMProgressBar and "
                "RichProgressBar are swapped for host-sync-free ones that keep your options)."
            )
        defer = bar is None or isinstance(bar, HostSyncFreeMetricsMixin)
        self.hook_contract = replace(self.hook_contract, defer_progress_bar_metrics=defer)

    #: what `setup` does, in order (`_run_steps`)
    setup_steps: tuple[Step, ...] = (
        _hold_lightning_hooks,
        _seed_device_rng,
        _checkpoint_activations,
        _lightning_setup,
        _limit_precompile,
        _swap_progress_bar,
        _evaluate_under_no_grad,
        _install_run_shortcuts,
        _start_profiler_trace,
        _detect_batch_transfer_hooks,
    )
