"""The one-file checkpoint on local disk, as every writer in lightning_trn produces it.

Local writes are atomic and durable (`atomic_local_save`): temp file in the target's directory, fsync, `os.replace`,
fsync of the directory (`fsync_directory`). Lightning's own `_atomic_save` stages the file in the system temp dir
through fsspec; when that is another filesystem, e.g. a tmpfs `/tmp`, the final move is a copy into the target, and a
kill mid-copy truncates it.

The train loaders' resume positions (`DevicePrefetchLoader.state_dict`) are stored under their own top-level key
(`stash_loader_states`) instead of Lightning's fit-loop state: a CPU/GPU run, whose plain DataLoader is not stateful,
would otherwise refuse the checkpoint ("0 stateful loaders, but found 1 states"). `unstash_loader_states` puts them
back.

Kept apart from `NeuronCheckpointIO` so that both the checkpoint IO and the readers and writers below it
(`distributed_checkpoint`, `sharded_save`) use one implementation without importing each other.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH

#: top-level checkpoint key holding the train loaders' states, moved out of `loops.fit_loop.state_dict`
LOADER_STATES_KEY = "lightning_trn_train_loader_states"
_FIT_LOOP_PATH = ("loops", "fit_loop", "state_dict")
_LIGHTNING_LOADER_STATES = "combined_loader"


def stash_loader_states(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Copy of `checkpoint` with Lightning's train-loader states moved to `LOADER_STATES_KEY` (see module docstring)."""
    fit_loop_state = _nested(checkpoint, _FIT_LOOP_PATH)
    if not isinstance(fit_loop_state, dict) or _LIGHTNING_LOADER_STATES not in fit_loop_state:
        return checkpoint
    loops = dict(checkpoint["loops"])
    loops["fit_loop"] = dict(loops["fit_loop"])
    loops["fit_loop"]["state_dict"] = {k: v for k, v in fit_loop_state.items() if k != _LIGHTNING_LOADER_STATES}
    return {**checkpoint, "loops": loops, LOADER_STATES_KEY: fit_loop_state[_LIGHTNING_LOADER_STATES]}


def unstash_loader_states(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Put states saved by `stash_loader_states` back where Lightning's fit loop reads them (in place)."""
    states = checkpoint.pop(LOADER_STATES_KEY, None)
    fit_loop_state = _nested(checkpoint, _FIT_LOOP_PATH)
    if states is not None and isinstance(fit_loop_state, dict):
        fit_loop_state[_LIGHTNING_LOADER_STATES] = states
    return checkpoint


def _nested(mapping: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def atomic_local_save(checkpoint: dict[str, Any], path: _PATH) -> None:
    """`torch.save` to local `path` so that a reader (or a crash) sees the old file or the new one, never a part.

    The bytes go to a hidden `.<name>.<pid>.<random>.tmp` next to `path` (same filesystem, so the rename is atomic)
    and are fsynced before the rename. A process killed mid-write leaves that temp file behind; it never has the
    checkpoint suffix, so `ckpt_path="last"` and `ModelCheckpoint` ignore it.
    """
    _atomic_write(path, lambda file: torch.save(checkpoint, file), sync=True, make_directory=True)


def atomic_local_write(data: bytes, path: _PATH, sync: bool = True) -> None:
    """Write `data` to local `path` as `atomic_local_save` writes a checkpoint (`sync=False`: no fsync, for records
    that are rewritten often and worthless after a crash, such as a writer's lease)."""
    _atomic_write(path, lambda file: file.write(data), sync=sync, make_directory=False)


def _atomic_write(path: _PATH, write: Callable[[Any], object], sync: bool, make_directory: bool) -> None:
    """`write(file)` into a temp file beside `path`, then `os.replace` it to `path` (fsyncs with `sync`)."""
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    if make_directory:
        os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as file:  # created with 0o666 & ~umask, like any new file
            write(file)
            if sync:
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if sync:
        fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Persist a rename itself (the directory entry); not possible on every OS/filesystem, so best effort."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
