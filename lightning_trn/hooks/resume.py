"""A Trainer resume puts back the checkpoint an interrupted sharded save left aside before Lightning chooses one.

A two-rename commit (`lightning_trn.core.checkpoint.sharded_save`; NFS, Lustre) killed between its renames leaves no
`last.ckpt`, the previous complete checkpoint as `.last.ckpt.old`: `ckpt_path="last"` would not see it and start from
scratch, an explicit `ckpt_path=".../last.ckpt"` would not find it. The Trainer resolves `ckpt_path` ("last": the
newest `last*.ckpt` of every `ModelCheckpoint`'s directory; "hpc": SLURM's `hpc_ckpt_<n>.ckpt` in
`default_root_dir`; or a path) in `_CheckpointConnector._select_ckpt_path`, before the strategy's
`setup_environment`: no strategy hook runs before it and no process group exists yet. So that method is wrapped at
`import lightning_trn` (version-guarded, as the connector hooks of `lightning_trn.registration`): for `fit` with a
Neuron strategy, rank 0 first finishes what dead writers left in the directories the checkpoint is looked for in and
the other ranks wait until nothing there is left aside (`lightning_trn.core.checkpoint.storage.recover_before_resume`);
`validate`, `test` and `predict` only read (an evaluation job never changes another job's checkpoints); every other
strategy gets Lightning's method unchanged. Fabric has no such resolution: its Neuron strategies recover the
directory of the path `fabric.load` gets.

`ckpt_path="last"` where Lightning's lookup cannot see a storage's checkpoints (`s3://`): the newest committed
`last*.ckpt` there (`Storage.newest_last`), when there is one, taken before a filesystem's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_registry import _is_registry

from lightning_trn.core.checkpoint import storage
from lightning_trn.core.strategy import NeuronStrategyCore
from lightning_trn.hooks.registry import lightning_version_tested

#: the `ckpt_path` values Lightning resolves itself, not paths
_KEYWORDS = ("last", "hpc", "best")


def _rank_before_setup(strategy: NeuronStrategyCore) -> int:
    """This process's global rank before the strategy's setup tells Lightning's environment (which says 0 until
    then), from the launcher's node and local ranks, as `set_world_ranks` computes it."""
    if not isinstance(strategy, ParallelStrategy):
        return 0
    return strategy.node_rank * strategy.num_processes + strategy.local_rank


def checkpoint_directories(trainer: Any, ckpt_path: Any) -> list[str]:
    """Where the Trainer looks for the checkpoint `ckpt_path` names: every `ModelCheckpoint`'s `dirpath` (for "last",
    also the directory those without one resolve from the logger, as Lightning does), `default_root_dir` for SLURM's
    "hpc" checkpoints, the directory of an explicit local path."""
    callbacks = [callback for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
    directories = [callback.dirpath for callback in callbacks if callback.dirpath is not None]
    resumes_last = ckpt_path == "last" or (
        ckpt_path is None
        and trainer.state.fn == TrainerFn.FITTING
        and any(isinstance(callback, OnExceptionCheckpoint) for callback in trainer.callbacks)
    )
    if resumes_last:
        directories += [
            # Lightning's own choice of directory, a name-mangled private method
            callback._ModelCheckpoint__resolve_ckpt_dir(trainer)  # type: ignore[attr-defined]  # see above
            for callback in callbacks
            if callback.dirpath is None
        ]
    explicit = ckpt_path is not None and ckpt_path not in _KEYWORDS and not _is_registry(ckpt_path)
    if ckpt_path == "hpc" or (ckpt_path is None and SLURMEnvironment.detect()):
        directories.append(trainer.default_root_dir)
    elif explicit:
        directories.append(os.path.dirname(os.fspath(ckpt_path)))
    return [os.fspath(directory) for directory in directories]


def recovering_select_ckpt_path(original: Callable[..., Any]) -> Callable[..., Any]:
    """`_CheckpointConnector._select_ckpt_path`, after `recover_before_resume` on a Neuron strategy's `fit`."""

    @functools.wraps(original)
    def select(self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = self.trainer
        strategy = trainer.strategy
        if isinstance(strategy, NeuronStrategyCore):
            path = self._ckpt_path if ckpt_path is None and self._user_managed else ckpt_path
            directories = checkpoint_directories(trainer, path)
            if state_fn == TrainerFn.FITTING:
                storage.recover_before_resume(directories, _rank_before_setup(strategy))
            if path == "last":
                ckpt_path = storage.newest_last(directories) or ckpt_path
        return original(self, state_fn, ckpt_path, *args, **kwargs)

    select._lightning_trn = True  # type: ignore[attr-defined]  # marks the wrapper: installed once
    return select


def install_resume_hook() -> None:
    """Wrap `_CheckpointConnector._select_ckpt_path` (once; not where the Lightning version is untested)."""
    original = getattr(_CheckpointConnector, "_select_ckpt_path", None)
    if not lightning_version_tested() or original is None or getattr(original, "_lightning_trn", False):
        return
    _CheckpointConnector._select_ckpt_path = recovering_select_ckpt_path(original)  # type: ignore[method-assign]  # the hook
