"""Where checkpoints are kept: the `Storage` protocol, one implementation per kind of storage, and the registry that
picks one for a path. Every branch on where a checkpoint goes (a filesystem, `s3://`) lives in an implementation;
the checkpointer (`lightning_trn.core.checkpoint.checkpointer`) and the resume hook only ask `storage_for(path)`.

A new storage is one file with a class that has the members below, and one line in `_STORAGES`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from lightning_trn.core.checkpoint.async_save import Deferral
from lightning_trn.core.checkpoint.s3_checkpoint import S3Storage
from lightning_trn.core.checkpoint.sharded_save import LocalStorage
from lightning_trn.core.parallel.process_group import ProcessGroup


class Storage(Protocol):
    """One kind of storage for checkpoints. Every method that changes anything acts only on what lightning_trn wrote
    there, and never on a live writer's work (docs/fault-tolerance.md, "Who may change what")."""

    #: how the docs and errors name it
    name: str

    def claims(self, path: str) -> bool:
        """Whether `path` is kept in this storage."""
        ...

    def refusal(self, path: str, writes_dcp: bool, async_save: bool) -> str | None:
        """Why a sharded checkpoint of this layout cannot be saved to `path` (None: it can)."""
        ...

    def check_shared(self, directory: str, rank: int, gather: Callable[[Any], list[Any]]) -> None:
        """Raise where not every rank reaches the same `directory` (called on every rank together)."""
        ...

    def save_destination(
        self, path: str, rank: int, group: ProcessGroup, defer: Deferral | None
    ) -> AbstractContextManager[str]:
        """The local directory every rank writes its part of sharded checkpoint `path` into; on leaving, `path` is
        that save, atomically (or, with `defer`, once the deferred commit runs). `group`: its barrier and broadcast."""
        ...

    def load_refusal(self, path: str, reads_dcp: bool) -> str | None:
        """Why `path` cannot be loaded by a strategy that does (`reads_dcp`) or does not read DCP directories (None:
        it can)."""
        ...

    def load_source(self, path: str, group: ProcessGroup) -> AbstractContextManager[str]:
        """The local directory Lightning's load of sharded checkpoint `path` reads (every rank)."""
        ...

    def write_file(self, destination: str, name: str, data: bytes) -> None:
        """Write one rank's own file into a save's `destination`."""
        ...

    def read_file(self, source: str, name: str) -> bytes | None:
        """One file of a load's `source`, or None."""
        ...

    def link(self, source: str, path: str, replace: dict[str, bytes]) -> None:
        """Make `path` a second checkpoint of committed `source`'s files without writing them again, `replace`'s files
        written instead (rank 0)."""
        ...

    def remove(self, path: str) -> None:
        """Delete checkpoint `path` (rank 0), never leaving part of it under its name."""
        ...

    def recover(self, directories: list[str], rank: int, barrier: Callable[[], None] | None) -> None:
        """Before a training resume chooses a checkpoint there: finish or delete what dead writers left."""
        ...

    def newest_last(self, directories: list[str]) -> str | None:
        """The newest committed `last*.ckpt` of `directories`, where Lightning's own lookup cannot find it (None:
        Lightning's lookup serves)."""
        ...


#: the registered storages, asked in order; the filesystem takes every path no other claims
_STORAGES: list[Storage] = [S3Storage(), LocalStorage()]


def storage_for(path: Any) -> Storage:
    """The storage that keeps `path`."""
    name = os.fspath(path)
    return next(storage for storage in _STORAGES if storage.claims(name))


def by_storage(paths: Iterable[Any]) -> list[tuple[Storage, list[str]]]:
    """`paths` grouped by their storage, in registration order."""
    groups: dict[int, list[str]] = {}
    for path in paths:
        groups.setdefault(id(storage_for(path)), []).append(os.fspath(path))
    return [(storage, groups[id(storage)]) for storage in _STORAGES if id(storage) in groups]


def recover_before_resume(directories: Iterable[Any], rank: int, barrier: Callable[[], None] | None = None) -> None:
    """Before a training resume chooses or loads a checkpoint from `directories`: each storage finishes what dead
    writers left there (rank 0; the other ranks wait at `barrier`, or, before a process group exists, by watching)."""
    for storage, paths in by_storage(directories):
        storage.recover(paths, rank, barrier)


def newest_last(directories: Iterable[Any]) -> str | None:
    """The newest committed `last*.ckpt` a storage finds where Lightning's lookup cannot, or None."""
    for storage, paths in by_storage(directories):
        found = storage.newest_last(paths)
        if found is not None:
            return found
    return None
