"""The probe that refuses a sharded checkpoint directory not every rank shares
(`lightning_trn.core.checkpoint.shared_storage`), with ranks simulated by threads in this process: an all-gather over a
thread barrier stands in for the host group.
The same probe across two torchrun "nodes", one of them on its own tmpfs: tests/checkpoint/test_sharded_save_dcp.py."""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_trn.core.checkpoint.checkpointer import Checkpointer, CheckpointLayout
from lightning_trn.core.checkpoint.shared_storage import (
    PROBE_PREFIX,
    RankProbe,
    SharedDirectoryReport,
    UnsharedDirectoryError,
    check_shared_directory,
    probe_shared_directory,
)

pytestmark = pytest.mark.both

#: how long a simulated rank looks for files it does not see at once (the default is for real filesystems)
TIMEOUT_S = 0.2
HOST = socket.gethostname()


class _ThreadGroup:
    """An all-gather between `world_size` threads, one per simulated rank."""

    def __init__(self, world_size: int) -> None:
        self._barrier = threading.Barrier(world_size, timeout=30)
        self._slots: list[Any] = [None] * world_size

    def gather_for(self, rank: int) -> Any:
        def gather(obj: Any) -> list[Any]:
            self._slots[rank] = obj
            self._barrier.wait()
            gathered = list(self._slots)
            self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
            return gathered

        return gather


def _run_ranks(directories: list[Path], probe: Any = probe_shared_directory) -> list[Any]:
    """`probe(directory, rank, gather, timeout)` on one thread per rank, rank r with `directories[r]`: each rank's
    result, or the exception it raised."""
    group = _ThreadGroup(len(directories))
    results: list[Any] = [None] * len(directories)

    def rank_main(rank: int) -> None:
        try:
            results[rank] = probe(str(directories[rank]), rank, group.gather_for(rank), TIMEOUT_S)
        except Exception as err:  # noqa: BLE001  # handed to the test, which checks which one it is
            results[rank] = err

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(len(directories))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _probe_files(*directories: Path) -> list[Path]:
    return [path for directory in directories for path in directory.glob(f"{PROBE_PREFIX}*")]


def test_a_shared_directory_passes_and_is_left_as_it_was(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"  # created by the probe, as a first save would
    reports = _run_ranks([directory] * 3)
    assert all(isinstance(report, SharedDirectoryReport) and report.shared for report in reports)
    assert reports[0].unseen == [[], [], []]
    assert list(directory.iterdir()) == []


def test_a_rank_on_storage_of_its_own_is_found_on_every_rank_and_named(tmp_path: Path) -> None:
    """Ranks 0 and 1 share a directory, rank 2 has its own (a node-local disk): every rank raises the same error,
    which says who saw whose files."""
    shared, local = tmp_path / "shared", tmp_path / "node2"
    errors = _run_ranks([shared, shared, local], probe=check_shared_directory)
    assert all(isinstance(error, UnsharedDirectoryError) for error in errors), errors
    message = str(errors[0])
    assert all(str(error) == message for error in errors)
    assert (
        f"Ranks 0-1 (host {HOST}) saw only the files of ranks 0-1; rank 2 (host {HOST}) saw only the files of rank 2."
        in message
    )
    assert f"rank 0: {shared}; rank 1: {shared}; rank 2: {local}" in message
    assert "FSx for Lustre or EFS" in message and "dirpath" in message
    assert _probe_files(shared, local) == []


def test_a_rank_that_cannot_write_there_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    shared = tmp_path / "shared"
    reports = _run_ranks([shared, blocker / "ckpts", shared])
    assert not reports[0].shared
    assert reports[0].unseen == [[], [0, 2], []]  # rank 1 sees nothing where it looked; its own file is no one's miss
    message = reports[0].explain()
    assert f"Rank 1 (host {HOST}) could not write there: " in message and "Not a directory" in message
    assert _probe_files(shared) == []


class _Group:
    """The process group a checkpointer reads: rank 0 of `world_size`, the other ranks simulated in its gather (they
    wrote their probe files where rank 0 did, and miss `others_miss`)."""

    timeout = timedelta(seconds=5)

    def __init__(self, world_size: int = 2, others_miss: tuple[int, ...] = ()) -> None:
        self.world_size, self.others_miss = world_size, list(others_miss)
        #: the directory of each probe run
        self.probed: list[str] = []

    def gather_objects(self, obj: Any, world_size: int) -> list[Any]:
        if isinstance(obj, RankProbe):
            self.probed.append(obj.directory)
            return [obj] + [replace(obj, rank=rank) for rank in range(1, self.world_size)]
        return [obj] + [self.others_miss] * (self.world_size - 1)

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj


def _checkpointer(group: _Group) -> Checkpointer:
    return Checkpointer(group)  # type: ignore[arg-type]  # the members a checkpointer uses


def test_the_strategy_probes_each_sharded_checkpoint_directory_once(tmp_path: Path) -> None:
    group = _Group()
    checkpointer = _checkpointer(group)
    for directory in (tmp_path / "a", str(tmp_path / "a"), tmp_path / "b", "s3://bucket/ckpts"):
        # `s3://` is not probed: every node reaches an S3 prefix alike
        checkpointer.check_directory(directory, 0, 2, CheckpointLayout.DCP)
    assert group.probed == [str(tmp_path / "a"), str(tmp_path / "b")]
    for layout, world_size in ((CheckpointLayout.FILE, 2), (CheckpointLayout.DCP, 1)):  # one-file; one process
        group = _Group(world_size)
        _checkpointer(group).check_directory(tmp_path / "c", 0, world_size, layout)
        assert group.probed == []


def test_a_sharded_save_into_an_unshared_directory_is_refused_before_any_rank_writes(tmp_path: Path) -> None:
    """`trainer.save_checkpoint` and `fabric.save` into a directory not probed yet (Fabric has no checkpoint
    directory before its first save): rank 1 does not see rank 0's probe file."""
    group = _Group(others_miss=(0,))
    with pytest.raises(UnsharedDirectoryError, match=re.escape(f"rank 1 (host {HOST}) saw only the files of rank 1")):
        _checkpointer(group).save_destination(tmp_path / "ckpts" / "last.ckpt", 0, 2, CheckpointLayout.DCP)
    assert group.probed == [str(tmp_path / "ckpts")]
    assert list((tmp_path / "ckpts").iterdir()) == []  # no staging directory, no probe file
