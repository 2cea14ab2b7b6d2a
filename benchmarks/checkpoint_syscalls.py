"""What one sharded checkpoint save costs the filesystem, by world size: its fsyncs and its metadata operations
(rename, `renameat2` exchange, mkdir, unlink, rmdir), for the protocol of `lightning_trn.core.checkpoint.sharded_save`
with the writers of both sharded formats.

`python -m benchmarks.checkpoint_syscalls [--world-sizes 2 4 8 64 256]`

W simulated ranks, one thread each, run `staged_directory` with a `threading.Barrier` and write what that format's
rank writes, through the real writers: ZeRO-1 (`NeuronDDPStrategy(zero1=True, state_dict_type="sharded")`) each rank
`zero1-rank<r>.pt` with `atomic_local_save`, rank 0 `checkpoint.pt` through `NeuronCheckpointIO`; DCP (FSDP,
model-parallel) each rank its `__<r>_0.distcp` through torch's `FileSystemWriter` (`sync_files=True`, as Lightning's
save), rank 0 `.metadata` (`FileSystemWriter.finish`) and Lightning's `meta.pt` (a plain `torch.save`). The counts
are of the second save to the same name, the steady state (it replaces a checkpoint and deletes it), through
`os.fsync`, `os.rename`, `os.replace`, `os.mkdir`, `os.unlink`/`os.remove`, `os.rmdir` and the exchange
(`sharded_save._RENAMEAT2`), replaced by counting wrappers for the run (fsync only counted, not done). "two renames"
rows: `renameat2` fails with EINVAL, as on NFS and Lustre. "fsync before": the protocol before this change, where
every rank fsynced every file of the staging directory after its writes (counted when the ranks finish writing
together). Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import os
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

if __package__ in (None, ""):  # `python benchmarks/checkpoint_syscalls.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_trn.core.checkpoint import sharded_save
from lightning_trn.core.checkpoint.checkpoint_file import atomic_local_save, fsync_directory
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.parallel.zero1 import SHARDED_MAIN_FILE, chunk_file

FORMATS = ("zero1", "dcp")
OPERATIONS = ("fsync", "rename", "exchange", "mkdir", "unlink", "rmdir")
#: the `os` functions counted, by the operation each is
_COUNTED = {
    "fsync": "fsync",
    "rename": "rename",
    "replace": "rename",
    "mkdir": "mkdir",
    "unlink": "unlink",
    "remove": "unlink",
    "rmdir": "rmdir",
}
#: elements of each rank's shard
_SHARD = 64
#: the thread that renews this process's leases (`lightning_trn.core.checkpoint.leases.Writer`)
_HEARTBEAT = "lightning_trn-lease"


@contextmanager
def counting() -> Iterator[Counter]:
    """Count the operations (`OPERATIONS`) of every thread while the block runs; fsync is counted, not done."""
    counts: Counter = Counter()
    lock = threading.Lock()
    originals = {name: getattr(os, name) for name in _COUNTED}
    exchange = sharded_save._RENAMEAT2

    def counted(name: str, function: Callable[..., Any] | None) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # a writer's lease heartbeat (every `leases.RENEW_S`) renews on its own clock, not per save
            if threading.current_thread().name != _HEARTBEAT:
                with lock:
                    counts[_COUNTED.get(name, name)] += 1
            return None if function is None else function(*args, **kwargs)

        return wrapper

    for name, function in originals.items():
        setattr(os, name, counted(name, None if name == "fsync" else function))
    if exchange is not None:
        sharded_save._RENAMEAT2 = counted("exchange", exchange)
    try:
        yield counts
    finally:
        for name, function in originals.items():
            setattr(os, name, function)
        sharded_save._RENAMEAT2 = exchange


@contextmanager
def without_exchange() -> Iterator[None]:
    """`renameat2(RENAME_EXCHANGE)` fails with EINVAL, as NFS and Lustre answer it: the commit takes two renames."""
    original = sharded_save._RENAMEAT2

    def einval(*args: Any) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    sharded_save._RENAMEAT2 = einval
    try:
        yield
    finally:
        sharded_save._RENAMEAT2 = original


class _Planner:
    """What `FileSystemWriter.write_data` asks its planner: the tensor of a write item."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        return self.tensor


def _write_dcp_shard(staging: str, rank: int) -> Any:
    """Rank `rank`'s part of a DCP save: its rows of a tensor sharded on dim 0, in `__<rank>_0.distcp`, as DCP's
    global plan assigns it (`FileSystemWriter.write_data`); returns its write results."""
    tensor = torch.full((_SHARD,), float(rank))
    writer = FileSystemWriter(staging)
    writer.set_up_storage_writer(rank == 0)
    chunk = ChunkStorageMetadata(offsets=torch.Size([rank * _SHARD]), sizes=tensor.size())
    item = WriteItem(
        index=MetadataIndex("state_dict.weight", chunk.offsets),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties.create_from_tensor(tensor), size=torch.Size([_SHARD])
        ),
    )
    plan = dataclasses.replace(writer.prepare_local_plan(SavePlan([item])), storage_data=_StoragePrefix(f"__{rank}_"))
    return writer.write_data(plan, _Planner(tensor)).wait()


def _finish_dcp(staging: str, results: list[Any]) -> None:
    """Rank 0 after every rank's shard: DCP's `.metadata` (`FileSystemWriter.finish`), then Lightning's `meta.pt`."""
    world_size = len(results)
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size([r * _SHARD]), sizes=torch.Size([_SHARD])) for r in range(world_size)
    ]
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([world_size * _SHARD]), chunks)
    writer = FileSystemWriter(staging)
    writer.set_up_storage_writer(True)
    writer.finish(Metadata({"state_dict.weight": entry}), results)
    torch.save({"global_step": 1, "loops": {}}, os.path.join(staging, "meta.pt"))


def _write_zero1(staging: str, rank: int) -> None:
    """Rank `rank`'s part of a sharded ZeRO-1 save (`DataParallelCore._split_checkpoint`), rank 0's main file too."""
    atomic_local_save({"chunks": [torch.full((_SHARD,), float(rank))]}, os.path.join(staging, chunk_file(rank)))
    if rank == 0:
        NeuronCheckpointIO().save_checkpoint(
            {"global_step": 1, "state_dict": {}}, os.path.join(staging, SHARDED_MAIN_FILE)
        )


def _fsync_every_file(staging: str) -> None:
    """The sync of the protocol before: every rank fsynced every file and directory of the staging directory."""
    for root, _, files in os.walk(staging):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(root)


def save(path: str, world_size: int, kind: str, before: bool = False) -> None:
    """One sharded save of `path` in the format `kind` by `world_size` simulated ranks (threads)."""
    barrier = threading.Barrier(world_size)
    dcp_results: list[Any] = [None] * world_size
    errors: list[BaseException] = []
    sent: list[Any] = [None]

    def broadcast(obj: Any) -> Any:
        """Rank 0's `obj` on every thread (a barrier on each side, as a collective)."""
        if obj is not None:
            sent[0] = obj
        barrier.wait()
        received = sent[0]
        barrier.wait()
        return received

    def rank_main(rank: int) -> None:
        try:
            with sharded_save.staged_directory(path, rank, barrier.wait, broadcast) as staging:
                if kind == "zero1":
                    _write_zero1(staging, rank)
                else:
                    dcp_results[rank] = _write_dcp_shard(staging, rank)
                    barrier.wait()  # DCP gathers the write results to the coordinator
                    if rank == 0:
                        _finish_dcp(staging, dcp_results)
                if before:
                    barrier.wait()
                    _fsync_every_file(staging)
        except Exception as error:  # noqa: BLE001  # raised again in the caller's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def count_per_save(world_size: int, kind: str, exchange: bool = True, before: bool = False) -> dict[str, int]:
    """The operations of one steady-state save (the second to one name) on `world_size` ranks: `OPERATIONS`."""
    with tempfile.TemporaryDirectory() as directory, nullcontext() if exchange else without_exchange():
        path = os.path.join(directory, "last.ckpt")
        save(path, world_size, kind)
        original_sync = sharded_save.sync_unsynced
        if before:  # the commit synced the staging directory alone; the ranks synced every file
            sharded_save.sync_unsynced = fsync_directory  # type: ignore[assignment]
        try:
            with counting() as counts:
                save(path, world_size, kind, before)
        finally:
            sharded_save.sync_unsynced = original_sync
    return {operation: counts[operation] for operation in OPERATIONS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint_syscalls",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8, 64, 256])
    args = parser.parse_args(argv)
    from benchmarks._harness import format_table  # the recipes' harness: not needed by the tests that count

    header = ["format", "commit", "ranks", "fsync before", *OPERATIONS]
    rows = []
    for kind in FORMATS:
        for exchange in (True, False):
            for world_size in args.world_sizes:
                now = count_per_save(world_size, kind, exchange)
                before = count_per_save(world_size, kind, exchange, before=True)["fsync"]
                rows.append(
                    [
                        kind,
                        "exchange" if exchange else "two renames",
                        world_size,
                        before,
                        *(now[operation] for operation in OPERATIONS),
                    ]
                )
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
