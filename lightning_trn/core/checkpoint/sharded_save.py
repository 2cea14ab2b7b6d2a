"""Atomic sharded checkpoints: a directory that every rank writes part of replaces the previous one whole, or not at
all.

A sharded checkpoint `<parent>/<name>` (a torch.distributed.checkpoint directory of the model-parallel and FSDP
strategies, a ZeRO-1 directory of `state_dict_type="sharded"`) is never written in place: its shard offsets are the
same from save to save, so a directory holding one rank's file from the new save and another's from the previous one
would load without an error, a silent mix of two steps. The protocol (`staged_directory`):

1. Rank 0 finishes what an interrupted commit or deletion left in `<parent>` (`recover_all`), deletes what a killed
   save left in the staging directory `<parent>/.<name>.partial` and creates it empty. Barrier.
2. Every rank writes its files into the staging directory. Barrier: the save is complete.
3. Rank 0 commits: fsync the files no writer synced and the staging directory (`sync_unsynced`); swap it with
   `<name>` in one atomic step (`renameat2` with `RENAME_EXCHANGE`, Linux: ext4, XFS, btrfs, tmpfs...) or rename it
   to `<name>` when there was none; fsync `<parent>`; delete the previous checkpoint, now under the staging name.
   Where the system or filesystem cannot exchange (NFS and Lustre reject the flag with EINVAL; macOS), two renames:
   `<name>` to `.<name>.old`, the staging directory to `<name>`; fsync `<parent>`; delete `.<name>.old`.

What a save syncs: each file once, by the rank that wrote it. The writers sync their own files before the barrier
(`SYNCED_BY_WRITER`: DCP's `FileSystemWriter` with `sync_files`, on by default; `atomic_local_save`, which writes
ZeRO-1's files); rank 0 syncs the rest (Lightning's `meta.pt` beside DCP's shards, a file of a writer not known
here) and the directories it creates and renames. A save on W ranks costs O(W) fsyncs (benchmarks/
checkpoint_syscalls.py counts them); every rank syncing every file of the directory cost O(W^2).

What a kill leaves, at any moment: `<name>` complete, the previous save's or the new one's; and maybe a hidden
`.<name>.partial` or `.<name>.old`, which `ModelCheckpoint` and `ckpt_path="last"` never pick (not a `.ckpt` suffix).
The one exception is the two-rename fallback killed between its renames: `<name>` missing, `.<name>.old` the previous
complete checkpoint. `recover(path)` puts it back; the next save into `<parent>` runs it first, and a resume does
before it chooses a checkpoint (`recover_before_resume`: the Trainer's `ckpt_path`, `lightning_trn.hooks.resume`;
Fabric's `load`).

Deleting a previous copy never fails a save whose commit is done: where it cannot be deleted (a file still open
leaves an `.nfs*` file behind on NFS, EBUSY, permissions), it is moved to `.<name>.<token>.removing` with a warning,
and the next save's `recover_all` deletes it. Deleting a checkpoint directory (`remove`, ModelCheckpoint's
`save_top_k`) renames it to a hidden name first, so a kill mid-delete never leaves a partial directory under a
checkpoint's name. `recover` and `recover_all` are idempotent, and safe while another process runs them on the same
directory (what the other one renamed or deleted first is skipped).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from lightning.fabric.utilities.types import _PATH

from lightning_trn.core.checkpoint import s3_checkpoint
from lightning_trn.core.checkpoint.checkpoint_file import fsync_directory

log = logging.getLogger(__name__)

STAGING_SUFFIX = ".partial"
ASIDE_SUFFIX = ".old"
_REMOVING_SUFFIX = ".removing"
#: the name a copy that could not be deleted is moved to (`_delete_copy`)
_SET_ASIDE = re.compile(r"\..+\.[0-9a-f]{8}" + re.escape(_REMOVING_SUFFIX))
#: the files of a sharded checkpoint that their writer fsyncs itself, before the save's barrier: DCP's shards
#: `__<rank>_<n>.distcp` and `.metadata` (`FileSystemWriter(sync_files=True)`, what Lightning's save uses), ZeRO-1's
#: `zero1-rank<r>.pt` (`lightning_trn.core.parallel.zero1.chunk_file`, written by `atomic_local_save`)
SYNCED_BY_WRITER = re.compile(r"__\d+_\d+\.distcp|\.metadata|zero1-rank\d+\.pt")
#: how long the other ranks of a Trainer wait for rank 0 to put back an interrupted commit before a resume
RECOVERY_TIMEOUT_S = 300.0
_RECOVERY_POLL_S = 0.1

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


def _skip_vanished(function: Callable[..., object], path: str, error: BaseException) -> None:
    """`shutil.rmtree`'s error handler: what another process deleted meanwhile is done; anything else raises."""
    if not isinstance(error, FileNotFoundError):
        raise error


def _discard(path: str) -> None:
    """Delete a directory (or file) that is no checkpoint's name any more; already gone is fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=_skip_vanished)
            else:
                shutil.rmtree(path, onerror=lambda function, target, info: _skip_vanished(function, target, info[1]))
        elif os.path.lexists(path):
            os.remove(path)
    except FileNotFoundError:  # another process deleted it meanwhile
        pass


def _delete_copy(target: str, checkpoint: str) -> None:
    """Delete `target`, a previous copy of `checkpoint` or a leftover of one, without ever raising: where that fails,
    `target` moves to `.<name>.<token>.removing` (its own name is then free for the next save) and a warning says so;
    `recover_all`, which the next save into the directory runs, tries again."""
    try:
        _discard(target)
        return
    except OSError as error:
        reason = error
    left = target
    if not _SET_ASIDE.fullmatch(os.path.basename(target)):
        set_aside = _sibling(checkpoint, f".{uuid.uuid4().hex[:8]}{_REMOVING_SUFFIX}")
        try:
            os.rename(target, set_aside)
            left = set_aside
        except OSError:
            pass
    log.warning(
        "lightning_trn: could not delete %s (%s); it is left as %s and deleted by the next save into %s.",
        target,
        reason,
        left,
        os.path.dirname(checkpoint),
    )


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_unsynced(staging: str) -> None:
    """fsync what no writer synced in the complete staging directory (rank 0, after every rank's writes): its files
    not in `SYNCED_BY_WRITER`, its subdirectories and itself (the entries every rank created in it)."""
    for root, _, files in os.walk(staging):
        for name in files:
            if not SYNCED_BY_WRITER.fullmatch(name):
                _fsync_file(os.path.join(root, name))
        fsync_directory(root)


def recover(path: _PATH) -> None:
    """Finish what a kill during a commit or a removal of `path` left.

    `.<name>.old` with `<name>` present: the commit was done, delete the old copy. `.<name>.old` without `<name>`: the
    two-rename commit died between its renames, so put the previous complete checkpoint back. A leftover
    `.<name>.removing` is deleted. Idempotent; another process running it at the same time is harmless.
    """
    path = os.path.abspath(os.fspath(path))
    aside = _sibling(path, ASIDE_SUFFIX)
    if os.path.lexists(aside):
        if os.path.lexists(path):
            _delete_copy(aside, path)
        else:
            with contextlib.suppress(FileNotFoundError):  # another process put it back first
                os.rename(aside, path)
            fsync_directory(os.path.dirname(path))
    _delete_copy(_sibling(path, _REMOVING_SUFFIX), path)


def recover_all(directory: _PATH) -> None:
    """`recover` every checkpoint of `directory` that a killed commit left aside, and delete every copy waiting to be
    deleted (`.<name>.removing`, `.<name>.<token>.removing`)."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        entries = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if not entry.startswith("."):
            continue
        if entry.endswith(ASIDE_SUFFIX):
            recover(os.path.join(directory, entry[1 : -len(ASIDE_SUFFIX)]))
        elif entry.endswith(_REMOVING_SUFFIX):
            _delete_copy(os.path.join(directory, entry), os.path.join(directory, entry[1 : -len(_REMOVING_SUFFIX)]))


def interrupted_commits(directory: _PATH) -> list[str]:
    """The checkpoints of `directory` that a two-rename commit killed between its renames left without their name
    (`.<name>.old` and no `<name>`): what `recover` puts back."""
    try:
        entries = set(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = (
        entry[1 : -len(ASIDE_SUFFIX)] for entry in entries if entry.startswith(".") and entry.endswith(ASIDE_SUFFIX)
    )
    return sorted(os.path.join(os.fspath(directory), name) for name in names if name not in entries)


def recover_before_resume(
    directories: Iterable[_PATH],
    rank: int,
    barrier: Callable[[], None] | None = None,
    timeout_s: float = RECOVERY_TIMEOUT_S,
) -> None:
    """Before a checkpoint is chosen or loaded from `directories`: rank 0 runs `recover_all` on each local one ("" is
    the working directory), and deletes what killed saves left in each `s3://` one (`s3_checkpoint.sweep`); the
    other ranks wait for it, at `barrier` (Fabric's `load`), or, where no process group exists yet (the Trainer
    resolves `ckpt_path` before its strategy's setup), by watching the directories until no checkpoint there is left
    aside without its name.

    Raises:
        TimeoutError: a rank other than 0 still saw an interrupted commit after `timeout_s` seconds.
    """
    names = [os.fspath(d) for d in directories]
    local = sorted({os.path.abspath(name) for name in names if "://" not in name})
    if rank == 0:
        for directory in local:
            recover_all(directory)
        for remote in sorted({name for name in names if s3_checkpoint.is_s3(name)}):
            s3_checkpoint.sweep(remote)
    if barrier is not None:
        barrier()
        return
    if rank != 0:
        _wait_for_recovery(local, rank, timeout_s)


def _wait_for_recovery(directories: list[str], rank: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [path for directory in directories for path in interrupted_commits(directory)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"lightning_trn: rank {rank} waited {timeout_s:.0f} s for rank 0 to put back the checkpoints "
                f"{pending} (a save killed between its two renames left them as `.<name>{ASIDE_SUFFIX}`); rank 0 "
                "runs `lightning_trn.core.checkpoint.sharded_save.recover_all` on them before a resume."
            )
        time.sleep(_RECOVERY_POLL_S)


def _prepare(path: str, staging: str) -> None:
    """Step 1 (rank 0): see the module docstring."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    recover_all(parent)
    _delete_copy(staging, path)
    os.mkdir(staging)


def _commit(staging: str, path: str) -> None:
    """Make the complete `staging` directory `path` (rank 0): see the module docstring, step 3."""
    sync_unsynced(staging)
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
    _delete_copy(previous, path)


def _no_commit() -> None:
    """The commit of a rank other than 0: rank 0 commits for all."""


@contextmanager
def staged_directory(
    path: _PATH, rank: int, barrier: Callable[[], None], defer: Callable[[Callable[[], None]], None] | None = None
) -> Iterator[str]:
    """Every rank saves its part of the sharded checkpoint `path` into the directory this yields; on leaving the
    block, it becomes `path` atomically once all ranks are done (module docstring). A rank that raises leaves `path`
    as it was (the other ranks then fail in the barrier, or time out there).

    Args:
        path: the checkpoint directory, local.
        rank: this process's global rank; rank 0 prepares and commits.
        barrier: waits for every rank.
        defer: for a save whose writes go on after the block (`lightning_trn.core.checkpoint.async_save`): on leaving
        the block,
            each rank hands it the commit (step 3 on rank 0, nothing on the others) to run once its writes are done,
            instead of the barrier and the commit.
    """
    if "://" in os.fspath(path):
        raise ValueError(f"Sharded checkpoints are written to local directories, not {path}.")
    path = os.path.abspath(os.fspath(path))
    staging = staging_path(path)
    if rank == 0:
        _prepare(path, staging)
    barrier()
    yield staging
    if defer is not None:
        defer(functools.partial(_commit, staging, path) if rank == 0 else _no_commit)
        return
    barrier()
    if rank == 0:
        _commit(staging, path)


def remove(path: _PATH) -> None:
    """Delete the checkpoint `path` (one process only): a directory is renamed to a hidden name first, so no partial
    directory is ever left under the checkpoint's name; what cannot be deleted then is left for `recover_all`."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and not os.path.islink(path):
        removing = _sibling(path, _REMOVING_SUFFIX)
        _delete_copy(removing, path)
        os.rename(path, removing)
        fsync_directory(os.path.dirname(path))
        _delete_copy(removing, path)
        return
    _discard(path)
