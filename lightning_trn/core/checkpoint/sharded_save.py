"""Checkpoints on a filesystem (`LocalStorage`): a directory that every rank writes part of replaces the previous one
whole, or not at all, and nothing but lightning_trn's own entries is ever renamed or deleted.

A sharded checkpoint `<parent>/<name>` (a torch.distributed.checkpoint directory of the model-parallel and FSDP
strategies, a ZeRO-1 directory of `state_dict_type="sharded"`) is never written in place: its shard offsets are the
same from save to save, so a directory holding one rank's file from the new save and another's from the previous one
would load without an error, a silent mix of two steps. The protocol (`staged_directory`), with `W` the id of the
committing process (`leases.Writer`), whose lease `<parent>/.lightning_trn-lease-W` is held from step 1 to the end
of step 3:

1. Rank 0 takes its lease, finishes what dead writers left in `<parent>` (`recover_all`), and creates the staging
   directory `<parent>/.<name>.lightning_trn-W-T.partial` (T: a token new for each save); the ranks get its name
   from rank 0.
2. Every rank writes its files into the staging directory. Barrier: the save is complete.
3. Rank 0 commits: fsync the files no writer synced and the staging directory (`sync_unsynced`); swap it with
   `<name>` in one atomic step (`renameat2` with `RENAME_EXCHANGE`, Linux: ext4, XFS, btrfs, tmpfs...) or rename it
   to `<name>` when there was none; fsync `<parent>`; delete the previous checkpoint, now under the staging name.
   Where the system or filesystem cannot exchange (NFS and Lustre reject the flag with EINVAL; macOS), two renames:
   `<name>` to `.<name>.lightning_trn-W-T.old`, the staging directory to `<name>`; fsync `<parent>`; delete the old
   copy. Then the lease is released.

**Ownership.** Only names of the form `.<name>.lightning_trn-<16 hex>[-<8 hex>].{partial,old,removing}` and lease
files `.lightning_trn-lease-<16 hex>` holding a lease record are ever renamed or deleted by recovery; a user's
`.notes.old`, `y.removing` or `.z.partial` are never touched. **Concurrency.** Another process (a second job, an
evaluation job, the next run after a crash) acts on writer W's entries only when W is proven gone
(`leases.is_live`: its process gone on this host, or its lease not renewed for `leases.EXPIRY_S` seconds, or no
lease): a live writer between its two renames is never undone under it.

What syncs: each file once, by the rank that wrote it (`SYNCED_BY_WRITER`: DCP's `FileSystemWriter` with
`sync_files`; `atomic_local_save`, ZeRO-1's files); rank 0 the rest and the directories it creates and renames: O(W)
fsyncs per save on W ranks (benchmarks/checkpoint_syscalls.py).

What a kill leaves, at any moment: `<name>` complete, the previous save's or the new one's; and maybe the killed
writer's hidden staging or old copy, which `ModelCheckpoint` and `ckpt_path="last"` never pick (no `.ckpt` suffix).
The one exception is the two-rename fallback killed between its renames: `<name>` missing, the old copy the previous
complete checkpoint. Once its writer is proven gone, the next save into `<parent>` or a resume puts it back
(`recover_before_resume`: the Trainer's fit, `lightning_trn.hooks.resume`; Fabric's `load`).

Deleting a previous copy never fails a save whose commit is done: where it cannot be deleted (an `.nfs*` file on NFS,
EBUSY, permissions), it is moved to `.<name>.lightning_trn-W-<token>.removing` with a warning, and a later recovery
deletes it. Deleting a checkpoint directory (`remove`, ModelCheckpoint's `save_top_k`) renames it to a hidden name
first, so a kill mid-delete never leaves a partial directory under a checkpoint's name.
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
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from lightning.fabric.utilities.types import _PATH

from lightning_trn.core.checkpoint import leases
from lightning_trn.core.checkpoint.async_save import Deferral
from lightning_trn.core.checkpoint.checkpoint_file import atomic_local_write, fsync_directory
from lightning_trn.core.checkpoint.shared_storage import check_shared_directory
from lightning_trn.core.parallel.process_group import ProcessGroup

log = logging.getLogger(__name__)

STAGING_SUFFIX = ".partial"
ASIDE_SUFFIX = ".old"
_REMOVING_SUFFIX = ".removing"
#: every entry this module creates beside a checkpoint: `.<name>.lightning_trn-<writer>[-<token>].<kind>`
_OWNED = re.compile(
    r"\.(?P<name>.+)\." + leases.OWNER_TAG + r"-(?P<writer>[0-9a-f]{16})(?:-(?P<token>[0-9a-f]{8}))?"
    r"\.(?P<kind>partial|old|removing)"
)
_LEASE = re.compile(r"\." + leases.OWNER_TAG + r"-lease-(?P<writer>[0-9a-f]{16})")
#: the files of a sharded checkpoint that their writer fsyncs itself, before the save's barrier: DCP's shards
#: `__<rank>_<n>.distcp` and `.metadata` (`FileSystemWriter(sync_files=True)`, what Lightning's save uses), ZeRO-1's
#: `zero1-rank<r>.pt` (`lightning_trn.core.parallel.zero1.chunk_file`, written by `atomic_local_save`), each rank's
#: random state (`atomic_local_write`)
SYNCED_BY_WRITER = re.compile(r"__\d+_\d+\.distcp|\.metadata|zero1-rank\d+\.pt|random-state-rank\d+\.pt")
#: how long the ranks of a resume wait for an interrupted commit to be put back (by its live writer finishing, or by
#: rank 0 once that writer is proven gone: `leases.EXPIRY_S` at most)
RECOVERY_TIMEOUT_S = 300.0
_RECOVERY_POLL_S = 0.1

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
#: errors meaning "this filesystem or kernel cannot exchange": take the two-rename path
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _owned_name(path: str, suffix: str, writer: str | None = None) -> str:
    """`.<name>.lightning_trn-<writer>-<token>.<suffix>` beside `path`, `writer` this process's by default, the token
    new: no two saves or removals of one writer share a name, so a recovery that listed the directory before this
    writer's next save can never act on that save's entries."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    owner = f"{leases.OWNER_TAG}-{writer or leases.writer().id}-{uuid.uuid4().hex[:8]}"
    return os.path.join(directory, f".{name}.{owner}{suffix}")


def aside_path(path: _PATH, writer: str | None = None) -> str:
    """A new name where the two-rename commit of `writer` (this process by default) sets the previous `path`
    aside."""
    return _owned_name(os.fspath(path), ASIDE_SUFFIX, writer)


def _lease_path(directory: str, writer: str) -> str:
    return os.path.join(directory, f".{leases.OWNER_TAG}-lease-{writer}")


def _lease(directory: str) -> AbstractContextManager[None]:
    """This process's lease on `directory` for the block (module docstring)."""
    path = _lease_path(directory, leases.writer().id)
    return leases.writer().hold(path, lambda data: atomic_local_write(data, path, sync=False), lambda: os.remove(path))


def _writer_gone(directory: str, writer: str) -> bool:
    """Whether `writer`'s entries in `directory` may be finished or deleted by this process (module docstring)."""
    if leases.writer().owns(writer):
        return True
    try:
        with open(_lease_path(directory, writer), "rb") as file:
            record = leases.LeaseRecord.decode(file.read())
    except FileNotFoundError:
        return True
    return not leases.is_live(record)


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
    """Delete `target`, one of this module's entries beside `checkpoint`, without ever raising: where that fails,
    `target` moves to `.<name>.lightning_trn-<writer>-<token>.removing` (its own name is then free for the next save)
    and a warning says so; a later recovery tries again."""
    try:
        _discard(target)
        return
    except OSError as error:
        reason = error
    left = target
    owned = _OWNED.fullmatch(os.path.basename(target))
    if owned is None or owned["kind"] != "removing":  # a copy already waiting to be deleted keeps its name
        set_aside = _owned_name(checkpoint, _REMOVING_SUFFIX)
        try:
            os.rename(target, set_aside)
            left = set_aside
        except OSError:
            pass
    log.warning(
        "lightning_trn: could not delete %s (%s); it is left as %s and deleted by a later save into or resume from %s.",
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


def _finish(directory: str, entry: str, match: re.Match[str]) -> None:
    """Finish one dead writer's entry: an old copy is put back where its checkpoint is missing (a two-rename commit
    killed between its renames) and deleted otherwise; staging and removal leftovers are deleted."""
    path = os.path.join(directory, entry)
    checkpoint = os.path.join(directory, match["name"])
    if match["kind"] == "old" and not os.path.lexists(checkpoint):
        with contextlib.suppress(FileNotFoundError):  # another process put it back first
            os.rename(path, checkpoint)
        fsync_directory(directory)
        return
    _delete_copy(path, checkpoint)


def recover_all(directory: _PATH) -> None:
    """Finish what dead writers left in `directory` (module docstring): only lightning_trn's own entries, each only
    once its writer is proven gone, checked right before acting on it; then delete those writers' lease files.
    Idempotent; other processes running it at the same time are harmless (what another renamed or deleted first is
    skipped)."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        entries = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        match = _OWNED.fullmatch(entry)
        if match is not None and _writer_gone(directory, match["writer"]):
            _finish(directory, entry, match)
    for entry in entries:
        lease = _LEASE.fullmatch(entry)
        if lease is not None and not leases.writer().owns(lease["writer"]) and _writer_gone(directory, lease["writer"]):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, entry))


def recover(path: _PATH) -> None:
    """`recover_all` on the directory of checkpoint `path`."""
    recover_all(os.path.dirname(os.path.abspath(os.fspath(path))))


def interrupted_commits(directory: _PATH) -> list[str]:
    """The checkpoints of `directory` that a two-rename commit left without their name, by any writer (its old copy
    and no `<name>`): what a resume waits for (the live writer finishes, or recovery puts it back)."""
    try:
        entries = set(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = {m["name"] for m in map(_OWNED.fullmatch, entries) if m is not None and m["kind"] == "old"}
    return sorted(os.path.join(os.fspath(directory), name) for name in names if name not in entries)


def recover_local(
    directories: Iterable[str], rank: int, barrier: Callable[[], None] | None, timeout_s: float = RECOVERY_TIMEOUT_S
) -> None:
    """Before a checkpoint is chosen or loaded from the local `directories`: rank 0 runs `recover_all` on each until
    no checkpoint there is left without its name; the other ranks wait for it, at `barrier` (Fabric's `load`), or,
    where no process group exists yet (the Trainer resolves `ckpt_path` before its strategy's setup), by watching the
    directories the same way.

    Raises:
        TimeoutError: a checkpoint was still left aside after `timeout_s` seconds.
    """
    local = sorted({os.path.abspath(name) for name in directories})
    if rank == 0:
        _wait_for_recovery(local, rank, timeout_s, recover=True)
    if barrier is not None:
        barrier()
    elif rank != 0:
        _wait_for_recovery(local, rank, timeout_s, recover=False)


def _wait_for_recovery(directories: list[str], rank: int, timeout_s: float, recover: bool) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if recover:
            for directory in directories:
                recover_all(directory)
        pending = [path for directory in directories for path in interrupted_commits(directory)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"lightning_trn: rank {rank} waited {timeout_s:.0f} s for the checkpoints {pending} to be put back: a "
                "save between its two renames left them aside, and its writer still holds its lease there (it is "
                "live, or was on another host less than lightning_trn.core.checkpoint.leases.EXPIRY_S seconds ago)."
            )
        time.sleep(_RECOVERY_POLL_S)


def _prepare(path: str, staging: str) -> None:
    """Step 1 (rank 0, holding the lease): see the module docstring."""
    parent = os.path.dirname(path)
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
        previous = aside_path(path)
        os.rename(path, previous)
        os.rename(staging, path)
    fsync_directory(parent)
    _delete_copy(previous, path)


def _no_commit() -> None:
    """The commit of a rank other than 0: rank 0 commits for all."""


@contextmanager
def staged_directory(
    path: _PATH,
    rank: int,
    barrier: Callable[[], None],
    broadcast: Callable[[Any], Any],
    defer: Deferral | None = None,
) -> Iterator[str]:
    """Every rank saves its part of the sharded checkpoint `path` into the directory this yields; on leaving the
    block, it becomes `path` atomically once all ranks are done (module docstring). A rank that raises leaves `path`
    as it was (the other ranks then fail in the barrier, or time out there).

    Args:
        path: the checkpoint directory, local.
        rank: this process's global rank; rank 0 prepares and commits.
        barrier: waits for every rank.
        defer: for a save whose writes go on after the block (`lightning_trn.core.checkpoint.async_save`): on leaving
            the block, each rank hands it the commit (step 3 on rank 0, nothing on the others) to run once its
            writes are done, instead of the barrier and the commit.
        broadcast: rank 0's object on every rank (the staging directory's name, which carries rank 0's writer id).
    """
    path = os.path.abspath(os.fspath(path))
    lease = contextlib.ExitStack()
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lease.enter_context(_lease(os.path.dirname(path)))
    with contextlib.ExitStack() as held:
        held.push(lease)  # released on leaving, unless a deferred commit took it over
        if rank == 0:
            staging = _owned_name(path, STAGING_SUFFIX)
            _prepare(path, staging)
        staging = broadcast(staging if rank == 0 else None)  # also waits for rank 0's staging directory
        yield staging
        if defer is not None:  # rank 0's lease goes with the commit: released once it ran, or its write failed
            defer(functools.partial(_commit, staging, path) if rank == 0 else _no_commit, held.pop_all().close)
            return
        barrier()
        if rank == 0:
            _commit(staging, path)


def link_checkpoint(source: str, path: str, replace: dict[str, bytes]) -> None:
    """Make `path` a second committed name of the checkpoint directory `source` (rank 0): its files hard-linked (copied
    where the filesystem has no hard links) into a staging directory, the files of `replace` written instead, then
    committed as a save is. No byte of the shards is written again."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _lease(os.path.dirname(path)):
        staging = _owned_name(path, STAGING_SUFFIX)
        _prepare(path, staging)
        for root, _, files in os.walk(source):
            relative = os.path.relpath(root, source)
            os.makedirs(os.path.join(staging, relative), exist_ok=True)
            for name in files:
                if os.path.normpath(os.path.join(relative, name)) in replace:
                    continue
                try:
                    os.link(os.path.join(root, name), os.path.join(staging, relative, name))
                except OSError:  # EXDEV, EPERM, a filesystem without hard links
                    shutil.copy2(os.path.join(root, name), os.path.join(staging, relative, name))
        for name, data in replace.items():
            atomic_local_write(data, os.path.join(staging, name))
        _commit(staging, path)


def remove(path: _PATH) -> None:
    """Delete the checkpoint `path` (one process only): a directory is renamed to a hidden name first, so no partial
    directory is ever left under the checkpoint's name; what cannot be deleted then is left for `recover_all`."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and not os.path.islink(path):
        with _lease(os.path.dirname(path)):
            removing = _owned_name(path, _REMOVING_SUFFIX)
            _delete_copy(removing, path)
            os.rename(path, removing)
            fsync_directory(os.path.dirname(path))
            _delete_copy(removing, path)
        return
    _discard(path)


class LocalStorage:
    """Checkpoints on a filesystem (module docstring): every path that no other storage claims."""

    name = "filesystem"

    def claims(self, path: str) -> bool:
        return True

    def refusal(self, path: str, writes_dcp: bool, async_save: bool) -> str | None:
        """Every layout and asynchronous saves are written here."""
        return None

    def check_shared(self, directory: str, rank: int, gather: Callable[[Any], list[Any]]) -> None:
        """Refuse a sharded checkpoint directory that not every rank sees (`shared_storage`)."""
        check_shared_directory(os.path.abspath(directory), rank, gather)

    def save_destination(
        self, path: str, rank: int, group: ProcessGroup, defer: Deferral | None
    ) -> AbstractContextManager[str]:
        return staged_directory(path, rank, group.barrier, group.broadcast, defer)

    def load_refusal(self, path: str, reads_dcp: bool) -> str | None:
        """A DCP directory loads anywhere: `NeuronCheckpointIO` consolidates it for one-file strategies."""
        return None

    def load_source(self, path: str, group: ProcessGroup) -> AbstractContextManager[str]:
        return contextlib.nullcontext(path)

    def write_file(self, destination: str, name: str, data: bytes) -> None:
        """Write one rank's file `name` into the save's `destination` (a staging directory)."""
        atomic_local_write(data, os.path.join(destination, name))

    def read_file(self, source: str, name: str) -> bytes | None:
        try:
            with open(os.path.join(source, name), "rb") as file:
                return file.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def link(self, source: str, path: str, replace: dict[str, bytes]) -> None:
        link_checkpoint(source, path, replace)

    def remove(self, path: str) -> None:
        remove(path)

    def recover(self, directories: list[str], rank: int, barrier: Callable[[], None] | None) -> None:
        recover_local(directories, rank, barrier)

    def newest_last(self, directories: list[str]) -> str | None:
        """Lightning's own "last" lookup serves filesystems."""
        return None
