"""Atomic sharded checkpoints: a directory that every rank writes part of replaces the previous one whole, or not at
all.

A sharded checkpoint `<parent>/<name>` (a torch.distributed.checkpoint directory of the model-parallel and FSDP
strategies, a ZeRO-1 directory of `state_dict_type="sharded"`) is never written in place: its shard offsets are the
same from save to save, so a directory holding one rank's file from the new save and another's from the previous one
would load without an error, a silent mix of two steps. The protocol (`staged_directory`):

1. Rank 0 finishes any interrupted commit (`recover`), deletes what a killed save left in the staging directory
   `<parent>/.<name>.partial` and creates it empty. Barrier.
2. Every rank writes its files into the staging directory, then fsyncs them. Barrier: the save is complete.
3. Rank 0 commits: fsync the staging directory; swap it with `<name>` in one atomic step (`renameat2` with
   `RENAME_EXCHANGE`, Linux: ext4, XFS, btrfs, tmpfs...) or rename it to `<name>` when there was none; fsync
   `<parent>`; delete the previous checkpoint, now under the staging name.
   Where the system or filesystem cannot exchange (NFS, for one; macOS), two renames: `<name>` to `.<name>.old`, the
   staging directory to `<name>`; fsync `<parent>`; delete `.<name>.old`.

What a kill leaves, at any moment: `<name>` complete, the previous save's or the new one's; and maybe a hidden
`.<name>.partial` or `.<name>.old`, which `ModelCheckpoint` and `ckpt_path="last"` never pick (not a `.ckpt` suffix).
The one exception is the two-rename fallback killed between its renames: `<name>` missing, `.<name>.old` the previous
complete checkpoint. `recover(path)` puts it back; the next save to `path` runs it first, and a resume should too
before choosing a checkpoint (`recover_all(checkpoint_dir)`).

Deleting a checkpoint directory (`remove`, ModelCheckpoint's `save_top_k`) renames it to a hidden name first, so a
kill mid-delete never leaves a partial directory under a checkpoint's name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lightning.fabric.utilities.types import _PATH

from lightning_trn.core.checkpoint_file import fsync_directory

STAGING_SUFFIX = ".partial"
ASIDE_SUFFIX = ".old"
_REMOVING_SUFFIX = ".removing"

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
#: errors meaning "this filesystem or kernel cannot exchange": take the two-rename path
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _sibling(path: str, suffix: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}{suffix}")


def staging_path(path: _PATH) -> str:
    """The hidden directory a sharded save of `path` writes into before it becomes `path`."""
    return _sibling(os.path.abspath(os.fspath(path)), STAGING_SUFFIX)


def _renameat2() -> Callable[..., int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError, TypeError):  # no C library by that name, or no renameat2 in it
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    return function


_RENAMEAT2 = _renameat2()


def _exchange(first: str, second: str) -> bool:
    """Swap two existing paths in one atomic step; False where the system or filesystem cannot."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), first, None, second)


def _discard(path: str) -> None:
    """Delete a directory (or file) that is no checkpoint's name any more."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _fsync_tree(directory: str) -> None:
    """fsync every file under `directory` and the directories themselves. Each rank runs it once its own writes are
    done, so its files reach the disk however the writer (DCP, torch.save) left them; re-syncing another rank's file
    costs an open and a no-op flush. A file that vanished meanwhile is another rank's temp file, renamed by its
    writer, which syncs it itself."""
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(root)


def recover(path: _PATH) -> None:
    """Finish what a kill during a commit or a removal of `path` left (rank 0, or one process, only).

    `.<name>.old` with `<name>` present: the commit was done, delete the old copy. `.<name>.old` without `<name>`: the
    two-rename commit died between its renames, so put the previous complete checkpoint back. A leftover
    `.<name>.removing` is deleted.
    """
    path = os.path.abspath(os.fspath(path))
    aside = _sibling(path, ASIDE_SUFFIX)
    if os.path.lexists(aside):
        if os.path.lexists(path):
            _discard(aside)
        else:
            os.rename(aside, path)
            fsync_directory(os.path.dirname(path))
    _discard(_sibling(path, _REMOVING_SUFFIX))


def recover_all(directory: _PATH) -> None:
    """`recover` every checkpoint of `directory` that a killed commit or removal left in an intermediate state."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return
    for entry in os.listdir(directory):
        for suffix in (ASIDE_SUFFIX, _REMOVING_SUFFIX):
            if entry.startswith(".") and entry.endswith(suffix):
                recover(os.path.join(directory, entry[1 : -len(suffix)]))


def _commit(staging: str, path: str) -> None:
    """Make the complete `staging` directory `path` (rank 0): see the module docstring, step 3."""
    fsync_directory(staging)
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(staging, path)
        fsync_directory(parent)
        return
    if os.path.isdir(path) and _exchange(staging, path):
        previous = staging
    else:  # no exchange here, or `path` is a file (a full checkpoint saved there before)
        previous = _sibling(path, ASIDE_SUFFIX)
        os.rename(path, previous)
        os.rename(staging, path)
    fsync_directory(parent)
    _discard(previous)


@contextmanager
def staged_directory(path: _PATH, rank: int, barrier: Callable[[], None]) -> Iterator[str]:
    """Every rank saves its part of the sharded checkpoint `path` into the directory this yields; on leaving the
    block, it becomes `path` atomically once all ranks are done (module docstring). A rank that raises leaves `path`
    as it was (the other ranks then fail in the barrier, or time out there).

    Args:
        path: the checkpoint directory, local.
        rank: this process's global rank; rank 0 prepares and commits.
        barrier: waits for every rank.
    """
    if "://" in os.fspath(path):
        raise ValueError(f"Sharded checkpoints are written to local directories, not {path}.")
    path = os.path.abspath(os.fspath(path))
    staging = staging_path(path)
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        recover(path)
        _discard(staging)
        os.mkdir(staging)
    barrier()
    yield staging
    _fsync_tree(staging)
    barrier()
    if rank == 0:
        _commit(staging, path)


def remove(path: _PATH) -> None:
    """Delete the checkpoint `path` (one process only): a directory is renamed to a hidden name first, so no partial
    directory is ever left under the checkpoint's name."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and not os.path.islink(path):
        removing = _sibling(path, _REMOVING_SUFFIX)
        _discard(removing)
        os.rename(path, removing)
        fsync_directory(os.path.dirname(path))
        path = removing
    _discard(path)
