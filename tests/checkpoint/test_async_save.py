"""Asynchronous sharded saves (`NeuronCheckpointIO(async_save=True)`, `lightning_trn.core.checkpoint.async_save`).

In-process, on the writer and the commit protocol (`staged_directory(..., defer=...)`, one process, no process
group): the state is staged before `save` returns, the checkpoint changes only once the background write is done,
one save at a time, a failed write commits nothing, teardown waits. Then a 2-rank FSDP job on the stand-in
(tests/scripts/async_save_train.py): its checkpoints equal the synchronous job's bitwise, training goes on during the
writes with one save in flight at a time, `fit` returns with the last save committed, and a kill during a background
write leaves the previous checkpoints loadable."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from lightning_trn.core.checkpoint.async_save import AsyncCheckpointer
from lightning_trn.core.checkpoint.distributed_checkpoint import load_consolidated
from lightning_trn.core.checkpoint.sharded_save import remove, staged_directory
from tests.sharded_runs import _assert_equal, assert_checkpoints_match_reference, load, run_job

pytestmark = pytest.mark.native_only

TIMEOUT = timedelta(seconds=60)
SCRIPT = Path(__file__).parents[1] / "scripts" / "async_save_train.py"
FABRIC_SCRIPT = Path(__file__).parents[1] / "scripts" / "async_save_fabric.py"


class Gate:
    """Holds every DCP file write until `open`; counts the writes and the most running at once."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.writes = 0
        self.running = 0
        self.most_running = 0
        self.lock = threading.Lock()

    def wrap(self, write_data: Any) -> Any:
        def held(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.writes += 1
                self.running += 1
                self.most_running = max(self.most_running, self.running)
            try:
                assert self.opened.wait(timeout=60), "the test never opened the gate"
                return write_data(*args, **kwargs)
            finally:
                with self.lock:
                    self.running -= 1

        return held


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    gate = Gate()
    monkeypatch.setattr(FileSystemWriter, "write_data", gate.wrap(FileSystemWriter.write_data))
    yield gate
    gate.opened.set()  # never leave a background write held


def _save(saver: AsyncCheckpointer, path: Path, weight: torch.Tensor) -> None:
    """One rank's save of a one-tensor checkpoint, as the checkpointer does it (`Checkpointer.save_destination`)."""
    saver.wait()
    with staged_directory(path, 0, lambda: None, lambda o: o, saver.defer) as staging:
        saver.save({"model": {"weight": weight}}, staging)


def _weight(path: Path) -> torch.Tensor:
    return load_consolidated(path)["model"]["weight"]


def test_the_checkpoint_changes_only_once_the_write_that_was_staged_before_save_returned_is_done(
    tmp_path: Path, gate: Gate
) -> None:
    saver, path = AsyncCheckpointer(TIMEOUT), tmp_path / "last.ckpt"
    gate.opened.set()
    _save(saver, path, torch.zeros(64))
    saver.wait()
    gate.opened.clear()
    weight = torch.arange(64.0)
    _save(saver, path, weight)
    weight += 1000  # the next step's update, while the write is held: the staged copy must not see it
    time.sleep(0.2)
    assert saver.in_flight
    assert torch.equal(_weight(path), torch.zeros(64)), "the checkpoint changed before its write was done"
    threading.Timer(0.3, gate.opened.set).start()
    saver.close()  # the strategy's teardown: waits for the write and the commit
    assert not saver.in_flight
    assert torch.equal(_weight(path), torch.arange(64.0))
    assert not list(tmp_path.glob(".last.ckpt.*.partial"))


def test_a_new_save_waits_for_the_one_in_flight_and_deletions_wait_for_its_commit(tmp_path: Path, gate: Gate) -> None:
    saver, path, older = AsyncCheckpointer(TIMEOUT), tmp_path / "last.ckpt", tmp_path / "step=1.ckpt"
    gate.opened.set()
    _save(saver, older, torch.ones(8))
    saver.wait()
    gate.opened.clear()
    _save(saver, path, torch.full((8,), 2.0))
    saver.then(lambda: remove(older))  # ModelCheckpoint's `save_top_k` deleting the older checkpoint
    second = threading.Thread(target=_save, args=(saver, path, torch.full((8,), 3.0)))
    second.start()
    time.sleep(0.3)
    assert second.is_alive() and gate.writes == 2, "a second save started while the first was in flight"
    assert older.is_dir(), "the older checkpoint was deleted before the new one was committed"
    gate.opened.set()
    second.join(timeout=60)
    saver.wait()
    assert gate.writes == 3 and gate.most_running == 1
    assert not older.exists()
    assert torch.equal(_weight(path), torch.full((8,), 3.0))


def test_a_failed_write_commits_nothing_and_raises_at_the_next_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saver, path = AsyncCheckpointer(TIMEOUT), tmp_path / "last.ckpt"
    _save(saver, path, torch.zeros(4))
    saver.wait()

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    _save(saver, path, torch.ones(4))
    with pytest.raises(CheckpointException) as raised:
        saver.wait()
    assert isinstance(raised.value.failures[0][0], OSError)  # (error, traceback) per failed rank
    assert torch.equal(_weight(path), torch.zeros(4))


# a 2-rank FSDP job (tests/scripts/async_save_train.py); about 40 s each on 2 busy cores


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synchronous job, every step's checkpoint kept."""
    return run_job(tmp_path_factory.mktemp("sync"), "dcp", "--keep-all", script=SCRIPT)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job with asynchronous saves whose writes each take 0.3 s longer: every step's checkpoint kept."""
    out = tmp_path_factory.mktemp("async")
    run_job(out, "dcp", "--keep-all", "--async-save", "--write-delay", "0.3", script=SCRIPT)
    return out


@pytest.mark.slow
def test_the_async_jobs_checkpoints_equal_the_sync_jobs_bitwise(reference: Path, async_run: Path) -> None:
    names = sorted(p.name for p in (async_run / "ckpts").iterdir() if p.name.endswith(".ckpt"))
    assert names == sorted(p.name for p in reference.iterdir() if p.name.endswith(".ckpt"))
    for name in names:
        saved, expected = load(async_run / "ckpts" / name), load(reference / name)
        # ModelCheckpoint's own state names the job's directory: the rest is the training state
        saved.pop("callbacks"), expected.pop("callbacks")
        _assert_equal(saved, expected, name)


def _events(out: Path) -> list[tuple[float, str]]:
    lines = (out / "events-rank0.txt").read_text().split("\n")
    return [(float(time_s), event) for time_s, event in (line.split() for line in lines if line)]


@pytest.mark.slow
def test_training_goes_on_during_the_writes_one_save_at_a_time_and_fit_ends_with_the_last_committed(
    async_run: Path,
) -> None:
    events = _events(async_run)
    saves = []  # each save's (write start, commit end) on rank 0
    for time_s, event in events:
        if event == "write-start":
            saves.append([time_s, None])
        elif event == "commit-end":
            saves[-1][1] = time_s
    # one write per step: `last.ckpt` is linked to the step's top-k file once that is committed
    assert len(saves) == 5 and all(end is not None for _, end in saves)
    assert all(saves[i + 1][0] >= saves[i][1] for i in range(len(saves) - 1)), "two saves were in flight at once"
    steps = [time_s for time_s, event in events if event == "step-end"]
    assert any(start < step < end for start, end in saves for step in steps), "no training step ran during a write"
    assert (async_run / "after_fit").read_text() == "5", "fit returned before its last save was committed"


@pytest.mark.slow
def test_a_kill_during_a_background_write_leaves_the_previous_checkpoints_loadable(
    tmp_path: Path, reference: Path
) -> None:
    # the 3rd write is step=3.ckpt's (one per step, last.ckpt linked to it); step=2.ckpt and last.ckpt (step 2) are
    # committed, and ModelCheckpoint asked for step=2.ckpt's deletion meanwhile
    ckpts = run_job(tmp_path, "dcp", "--async-save", "--kill-write", "3", killed=True, script=SCRIPT)
    assert assert_checkpoints_match_reference(ckpts, reference) == {"last.ckpt": 2, "step=2.ckpt": 2}


@pytest.mark.slow
def test_fabrics_async_save_equals_its_sync_save_bitwise_and_load_waits_for_it(tmp_path: Path) -> None:
    run_job(tmp_path, "dcp", script=FABRIC_SCRIPT)
    assert (tmp_path / "done").read_text() == "ok"
    _assert_equal(load(tmp_path / "async.ckpt"), load(tmp_path / "sync.ckpt"), "async.ckpt")


def test_the_benchmark_counts_the_time_over_the_median_step_per_save() -> None:
    from benchmarks.async_save import summarize

    times = [1.0, 1.0, 5.0] + [1.0, 1.0, 4.0] * 2  # 3 steps a save, the first (warm-up) one left out
    starts = [sum(times[:i]) for i in range(len(times) + 1)]
    record = {"starts": starts, "state_dict_s": [9.0, 0.2, 0.4], "staging_s": [9.0, 0.5, 0.7]}
    expected = {"step": 1.0, "blocked": 3.0, "save_step": 3.0, "state_dict": 0.3, "staging": 0.6}
    assert summarize(record, every=3) == pytest.approx(expected)  # float64 means of decimals (0.2, 0.4): rounding only
