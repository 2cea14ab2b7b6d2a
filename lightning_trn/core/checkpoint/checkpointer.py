"""`Checkpointer`: the one object a Neuron strategy (Trainer or Fabric) saves, loads and removes checkpoints through.

It owns what a checkpoint's journey needs besides Lightning's own save: the storage of each path
(`lightning_trn.core.checkpoint.storage`), the check that every rank shares a sharded checkpoint's directory, the
background writer of asynchronous saves, each rank's random-state file, and the second name of one checkpoint event
(`ModelCheckpoint(save_last=True)` beside a top-k file: linked, not written twice). The strategies' `save_checkpoint`,
`load_checkpoint` and `remove_checkpoint` delegate to it; what they keep is the layout of their checkpoints
(`CheckpointLayout`) and Lightning's own save and load inside the directories it hands them.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lightning_trn.core.checkpoint.async_save import AsyncCheckpointer
from lightning_trn.core.checkpoint.random_state import RANDOM_STATE_VERSION, RankFiles, rank_file_name
from lightning_trn.core.checkpoint.storage import recover_before_resume, storage_for
from lightning_trn.core.parallel.process_group import ProcessGroup


@dataclass(frozen=True)
class CheckpointLayout:
    """What a strategy's checkpoint is on disk: one of the three constants below (compared by identity)."""

    value: str
    #: whether every rank writes part of it (a directory)
    sharded: bool

    #: one file, written by rank 0 (DDP, single device, `state_dict_type="full"`)
    FILE: ClassVar[CheckpointLayout]
    #: a ZeRO-1 directory: `checkpoint.pt` and one `zero1-rank<r>.pt` per rank
    ZERO1: ClassVar[CheckpointLayout]
    #: a torch.distributed.checkpoint directory: every rank's shards and Lightning's `meta.pt`
    DCP: ClassVar[CheckpointLayout]


CheckpointLayout.FILE = CheckpointLayout("one file", sharded=False)
CheckpointLayout.ZERO1 = CheckpointLayout("ZeRO-1 directories", sharded=True)
CheckpointLayout.DCP = CheckpointLayout("torch.distributed.checkpoint directories", sharded=True)


class Checkpointer:
    """Saves, loads and removes a strategy's checkpoints (module docstring).

    Args:
        process_group: the strategy's process groups (barriers, broadcasts, gathers; their timeout).
    """

    def __init__(self, process_group: ProcessGroup) -> None:
        self._process_group = process_group
        self._writer: AsyncCheckpointer | None = None
        #: directories every rank was found to share
        self._shared: set[str] = set()
        #: the latest save: its event and path, for a second name of the same event
        self._latest: tuple[Hashable, str] | None = None
        #: inside `synchronous()`
        self._synchronous = False

    def configure(self, async_save: bool, layout: CheckpointLayout, strategy: str) -> None:
        """At the strategy's setup: the background writer where saves are asynchronous
        (`NeuronCheckpointIO(async_save=True)`), refused where checkpoints are not DCP directories."""
        if async_save and layout is not CheckpointLayout.DCP:
            raise ValueError(
                f"NeuronCheckpointIO(async_save=True) writes the torch.distributed.checkpoint directories of the "
                f"sharded strategies (model-parallel and FSDP with sharded checkpoints, native backend); {strategy} "
                f"writes {layout.value}, which it saves synchronously. Drop `async_save=True`, or for one-file "
                "checkpoints wrap the checkpoint IO in Lightning's `AsyncCheckpointIO`."
            )
        if async_save and self._writer is None:
            self._writer = AsyncCheckpointer(self._process_group.timeout)

    @property
    def writes_in_background(self) -> bool:
        """Whether DCP directories are written by the background writer (`write_in_background`)."""
        return self._writer is not None and not self._synchronous

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous save is still being written or committed."""
        return self._writer is not None and self._writer.in_flight

    @contextmanager
    def synchronous(self) -> Iterator[None]:
        """Saves inside the block are written before they return, also where saves are asynchronous (a final
        checkpoint the next step of a pipeline reads at once). The save in flight is finished first."""
        self.wait()
        self._synchronous = True
        try:
            yield
        finally:
            self._synchronous = False

    def check_directory(self, directory: Any, rank: int, world_size: int, layout: CheckpointLayout) -> None:
        """Refuse a directory a sharded checkpoint cannot be saved to: one its storage refuses for this layout, or one
        not every rank shares (probed once per directory, on every rank together)."""
        if not layout.sharded:
            return
        directory = os.fspath(directory)
        storage = storage_for(directory)
        reason = storage.refusal(directory, layout is CheckpointLayout.DCP, self._writer is not None)
        if reason is not None:
            raise ValueError(reason)
        if world_size > 1 and directory not in self._shared:
            storage.check_shared(directory, rank, lambda obj: self._process_group.gather_objects(obj, world_size))
            self._shared.add(directory)

    def save_destination(
        self, path: Any, rank: int, world_size: int, layout: CheckpointLayout, background: bool = False
    ) -> AbstractContextManager[str]:
        """Where this rank saves the checkpoint `path`: `path` itself for one file; for a sharded checkpoint a
        directory of its storage that becomes `path` atomically once every rank is done (`background`: once the
        background write into it is done; the caller writes through `write_in_background`)."""
        if not layout.sharded:
            return nullcontext(os.fspath(path))
        self.check_directory(os.path.dirname(os.fspath(path)), rank, world_size, layout)
        self.wait()  # rank 0 commits the previous save before it prepares this one
        defer = self._writer.defer if self._writer is not None and background else None
        return storage_for(path).save_destination(os.fspath(path), rank, self._process_group, defer)

    def write_in_background(self, shards: dict[str, Any], directory: str) -> None:
        """Write this rank's DCP `shards` into the save's `directory` in the background."""
        assert self._writer is not None
        self._writer.save(shards, directory)

    def load_source(self, path: Any, layout: CheckpointLayout) -> AbstractContextManager[str]:
        """What Lightning's load of `path` reads (every rank): `path` itself, or for a DCP directory its storage's
        local stand-in (S3: a directory whose DCP reads go to the committed version)."""
        path = os.fspath(path)
        storage = storage_for(path)
        reason = storage.load_refusal(path, layout is CheckpointLayout.DCP)
        if reason is not None:
            raise ValueError(reason)
        if layout is not CheckpointLayout.DCP:
            return nullcontext(path)
        return storage.load_source(path, self._process_group)

    # each rank's random state: its own file in a sharded checkpoint, gathered to rank 0 in a one-file one

    def random_state_to_save(self, entry: dict[str, Any], world_size: int, layout: CheckpointLayout) -> dict[str, Any]:
        """The checkpoint's random-state value for this rank's `entry`: a header (the entry goes to this rank's own
        file, `write_rank_file`) in a sharded checkpoint; every rank's entry, gathered to rank 0, in a one-file one."""
        if layout.sharded:
            return RankFiles(world_size).header()
        return {"version": RANDOM_STATE_VERSION, "ranks": self._process_group.gather_to_first(entry, world_size)}

    def write_rank_file(self, destination: str, path: Any, rank: int, entry: dict[str, Any]) -> None:
        """Write this rank's random-state `entry` into the sharded save's `destination`."""
        buffer = io.BytesIO()
        torch.save(entry, buffer)
        storage_for(path).write_file(destination, rank_file_name(rank), buffer.getvalue())

    def read_rank_file(self, saved: Any, source: str, path: Any, rank: int, world_size: int) -> Any:
        """The checkpoint's random-state value with this rank's entry read from its own file (only that file), where
        the checkpoint has one per rank and the world size is the same."""
        files = RankFiles.from_header(saved)
        if files is None or files.world_size != world_size:
            return saved
        data = storage_for(path).read_file(source, rank_file_name(rank))
        entry = None if data is None else torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return files.with_entry(entry)

    # one checkpoint event, several names

    def linked_source(self, event: Hashable | None, path: Any, layout: CheckpointLayout) -> str | None:
        """The checkpoint this process saved last, when it was saved for the same `event` (the Trainer's step, for
        example) into the same storage as `path`: `path` then becomes a second name of it (`link`) instead of a second
        write. None otherwise."""
        path = os.fspath(path)
        if event is None or layout is not CheckpointLayout.DCP or self._latest is None:
            return None
        latest_event, latest_path = self._latest
        if latest_event != event or latest_path == path or storage_for(latest_path) is not storage_for(path):
            return None
        return latest_path

    def saved(self, event: Hashable | None, path: Any) -> None:
        """Remember the save just made of `event` into `path`."""
        self._latest = None if event is None else (event, os.fspath(path))

    def link(self, source: str, path: Any, replace: dict[str, bytes], rank: int) -> None:
        """Make `path` a second name of `source`'s files (rank 0; after the save in flight is committed)."""
        if rank != 0:
            return
        action = functools.partial(storage_for(path).link, source, os.fspath(path), replace)
        if self._writer is None:
            action()
        else:
            self._writer.then(action)

    # removal, resume, teardown

    def remove(self, path: Any, rank: int, layout: CheckpointLayout, remove_file: Callable[[Any], None]) -> None:
        """Delete checkpoint `path` (`ModelCheckpoint`'s `save_top_k`): a sharded one through its storage by rank 0,
        after the save in flight is committed (a kill before leaves the older checkpoint); a one-file one by
        `remove_file` (Lightning's)."""
        path = os.fspath(path)
        if not layout.sharded:
            remove_file(path)
            return
        if rank != 0:
            return
        storage = storage_for(path)
        if self._writer is None:
            storage.remove(path)
        else:
            self._writer.then(functools.partial(storage.remove, path))

    def recover(self, directories: list[Any], rank: int) -> None:
        """Before a resume loads a checkpoint from `directories` (module `storage`); the ranks leave together."""
        recover_before_resume(directories, rank, self._process_group.barrier)

    def wait(self) -> None:
        """Wait for the save in flight (every rank together); raise on every rank if it failed on any."""
        if self._writer is not None:
            self._writer.wait()

    def teardown(self) -> None:
        """An asynchronous save in flight is written and committed before the run ends (each rank its own)."""
        if self._writer is not None:
            self._writer.close()
