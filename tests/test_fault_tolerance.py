"""Fault tolerance: resumable `DevicePrefetchLoader`, kill -9 and resume to the same weights, atomic saves."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_trn.core.checkpoint_io import LOADER_STATES_KEY, NeuronCheckpointIO
from lightning_trn.core.device_loader import BATCHES_YIELDED, DevicePrefetchLoader

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = PROJECT_ROOT / "tests" / "scripts"
RUN_TIMEOUT_S = 120


class FakeRuntime:
    """Runtime boundary stand-in: `prefetch` reads `read_ahead` host batches ahead (as MpDeviceLoader's thread does)
    and records every batch it 'transfers', tagging each as on the device."""

    def __init__(self, read_ahead: int = 3) -> None:
        self.read_ahead = read_ahead
        self.transferred: list[int] = []

    def prefetch(self, dataloader: Iterable, device: torch.device) -> Iterator:
        source = iter(dataloader)
        queue: list[Any] = []
        while True:
            while len(queue) <= self.read_ahead:
                try:
                    batch = next(source)
                except StopIteration:
                    break
                self.transferred.append(int(batch[0]))
                queue.append(("device", batch))
            if not queue:
                return
            yield queue.pop(0)


def _numbers_loader(n: int = 10) -> DataLoader:
    return DataLoader(list(range(n)), batch_size=1)


def _values(batches: Iterable) -> list[int]:
    return [int(batch[0]) for _, batch in batches]


def test_loader_is_stateful_for_lightning():
    loader = DevicePrefetchLoader(_numbers_loader(), torch.device("cpu"), FakeRuntime())
    assert isinstance(loader, _Stateful)  # what Lightning checks before saving/restoring loader state


def test_lightning_worker_seeding_reaches_the_wrapped_loader(monkeypatch: pytest.MonkeyPatch):
    """`seed_everything(workers=True)` makes Lightning set `worker_init_fn` on the loader it sees: ours."""
    from lightning.fabric.utilities.data import _auto_add_worker_init_fn

    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    wrapped = _numbers_loader()
    _auto_add_worker_init_fn(DevicePrefetchLoader(wrapped, torch.device("cpu"), FakeRuntime()), rank=0)
    assert wrapped.worker_init_fn is not None


def test_state_counts_batches_yielded_not_prefetched():
    runtime = FakeRuntime(read_ahead=3)
    loader = DevicePrefetchLoader(_numbers_loader(), torch.device("cpu"), runtime)
    iterator = iter(loader)
    assert loader.state_dict() == {BATCHES_YIELDED: 0}
    next(iterator), next(iterator)
    assert len(runtime.transferred) > 2  # the prefetcher ran ahead ...
    assert loader.state_dict() == {BATCHES_YIELDED: 2}  # ... but only what reached the loop counts


def test_restored_loader_skips_on_host_without_transfers():
    runtime = FakeRuntime()
    loader = DevicePrefetchLoader(_numbers_loader(), torch.device("cpu"), runtime)
    loader.load_state_dict({BATCHES_YIELDED: 4})
    assert loader.state_dict() == {BATCHES_YIELDED: 4}  # a checkpoint taken before the first batch keeps the position
    assert _values(loader) == [4, 5, 6, 7, 8, 9]
    assert runtime.transferred == [4, 5, 6, 7, 8, 9]  # skipped batches never went to the device
    assert _values(loader) == list(range(10))  # the skip applies to the resumed epoch only


def test_position_keeps_counting_after_a_restore():
    loader = DevicePrefetchLoader(_numbers_loader(), torch.device("cpu"), FakeRuntime())
    loader.load_state_dict({BATCHES_YIELDED: 4})
    iterator = iter(loader)
    next(iterator), next(iterator)
    assert loader.state_dict() == {BATCHES_YIELDED: 6}


def test_end_of_epoch_position_resumes_at_next_epoch_start():
    loader = DevicePrefetchLoader(_numbers_loader(), torch.device("cpu"), FakeRuntime())
    loader.load_state_dict({BATCHES_YIELDED: 10})  # saved on the last batch of the epoch
    assert _values(loader) == list(range(10))
    assert loader.state_dict() == {BATCHES_YIELDED: 0}  # exhausted: the next checkpoint points at the epoch start


def test_prefetch_starts_after_set_epoch():
    """Lightning calls `iter()` before `set_epoch()`; the epoch's order must still be the new epoch's."""
    dataset = TensorDataset(torch.arange(12))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    wrapped = DataLoader(dataset, batch_size=1, sampler=sampler)
    loader = DevicePrefetchLoader(wrapped, torch.device("cpu"), FakeRuntime())
    iterator = iter(loader)
    sampler.set_epoch(1)
    order = [int(batch[0][0]) for _, batch in iterator]
    sampler.set_epoch(1)
    assert order == list(sampler)
    sampler.set_epoch(0)
    assert order != list(sampler)


def test_resuming_a_random_sampler_warns(caplog: pytest.LogCaptureFixture):
    shuffled = DataLoader(list(range(10)), batch_size=1, shuffle=True)
    with caplog.at_level(logging.WARNING, logger="lightning_trn.core.device_loader"):
        for loader in (_numbers_loader(), shuffled):
            wrapped = DevicePrefetchLoader(loader, torch.device("cpu"), FakeRuntime())
            wrapped.load_state_dict({BATCHES_YIELDED: 3})
            next(iter(wrapped))  # the position is decided at the first batch
            if loader is not shuffled:
                assert not caplog.records  # a sequential order needs no warning
    assert "set_epoch" in caplog.text


def test_loader_states_are_saved_outside_lightnings_loop_state_and_restored_on_load(tmp_path: Path):
    states = [{BATCHES_YIELDED: 3}]
    checkpoint = {"state_dict": {"w": torch.ones(2)},
                  "loops": {"fit_loop": {"state_dict": {"combined_loader": states}, "epoch_progress": {"total": 1}}}}
    io = NeuronCheckpointIO()
    io.save_checkpoint(checkpoint, tmp_path / "c.ckpt")

    raw = torch.load(tmp_path / "c.ckpt", weights_only=True)
    assert raw["loops"]["fit_loop"] == {"state_dict": {}, "epoch_progress": {"total": 1}}
    assert raw[LOADER_STATES_KEY] == states
    assert checkpoint["loops"]["fit_loop"]["state_dict"] == {"combined_loader": states}  # caller's dict untouched
    loaded = io.load_checkpoint(tmp_path / "c.ckpt")
    assert loaded["loops"] == checkpoint["loops"] and LOADER_STATES_KEY not in loaded


class FailsToPickle:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("fails mid-save")


def test_failed_save_keeps_the_previous_checkpoint_and_no_temp_file(tmp_path: Path):
    path = tmp_path / "last.ckpt"
    io = NeuronCheckpointIO()
    io.save_checkpoint({"version": 1}, path)
    with pytest.raises(RuntimeError, match="fails mid-save"):
        io.save_checkpoint({"version": 2, "weights": torch.ones(1000), "bad": FailsToPickle()}, path)
    assert torch.load(path, weights_only=True) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


# ---------------------------------------------------------------- subprocess tests (slow)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=str(PROJECT_ROOT), **extra)
    return env


def _popen(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _read_until(proc: subprocess.Popen, prefix: str, at_least: int) -> list[str]:
    """Read the child's stdout until a line `<prefix> <n>` with n >= at_least; returns the lines read."""
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line.strip())
        if line.startswith(prefix) and int(line.split()[1]) >= at_least:
            return lines
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    raise AssertionError(f"child ended before `{prefix} {at_least}`:\n{lines}\n{stderr}")


def _train(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *_train_args(out)], env=_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


MAX_STEPS, EVERY, BATCHES_PER_EPOCH, KILL_AT = 40, 5, 16, 23


def _train_args(out: Path) -> list[str]:
    # the same command for every run; the delay lets the parent kill at a chosen step
    return [str(SCRIPTS / "ft_train.py"), "--out", str(out), "--max-steps", str(MAX_STEPS), "--every", str(EVERY),
            "--step-delay", "0.05"]


def _start_step(stdout: str) -> int:
    return int(next(line for line in stdout.splitlines() if line.startswith("START")).split()[1])


@pytest.mark.slow
def test_kill_9_mid_epoch_and_rerun_ends_with_the_uninterrupted_weights(tmp_path: Path):
    uninterrupted = _train(tmp_path / "a")
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert _start_step(uninterrupted.stdout) == 0

    out = tmp_path / "b"
    proc = _popen(_train_args(out))
    try:
        _read_until(proc, "STEP", KILL_AT)  # the step-20 checkpoint is written (saves run before the next step)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "final.pt").exists()
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved[LOADER_STATES_KEY] == [{BATCHES_YIELDED: saved["global_step"] % BATCHES_PER_EPOCH}]
    assert "combined_loader" not in saved["loops"]["fit_loop"]["state_dict"]  # a plain DataLoader can resume it too

    resumed = _train(out)
    assert resumed.returncode == 0, resumed.stderr
    start = _start_step(resumed.stdout)
    assert EVERY <= start < MAX_STEPS and start % EVERY == 0  # resumed from a mid-run checkpoint ...
    assert start % BATCHES_PER_EPOCH != 0  # ... taken mid-epoch (epoch 1), so the loader had to skip batches
    assert "not resumable" not in resumed.stderr  # Lightning saw a stateful loader

    weights_a = torch.load(tmp_path / "a" / "final.pt", weights_only=True)
    weights_b = torch.load(out / "final.pt", weights_only=True)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:  # XLA:CPU replays the same graphs on the same inputs: bitwise equal
        assert torch.equal(weights_a[name], weights_b[name]), name


@pytest.fixture
def tmpdir_elsewhere(tmp_path: Path) -> Iterator[dict[str, str]]:
    """`TMPDIR` on another filesystem than `tmp_path` (tmpfs /dev/shm), where a save that is staged in the temp dir
    and then moved becomes a copy into the target: the case a naive "temp file + move" gets wrong."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != tmp_path.stat().st_dev):
        yield {}
        return
    staging = Path(tempfile.mkdtemp(dir=shm, prefix="ft_test_"))
    try:
        yield {"TMPDIR": str(staging)}
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@pytest.mark.slow
def test_kill_9_during_saves_never_leaves_a_partial_checkpoint(tmp_path: Path, tmpdir_elsewhere: dict[str, str]):
    path = tmp_path / "last.ckpt"
    rng = random.Random(0)
    env = _env(**tmpdir_elsewhere)
    for kill in range(4):
        proc = _popen([str(SCRIPTS / "ft_save_loop.py"), "--path", str(path), "--first-version", str(1000 * kill)],
                      env=env)
        try:
            _read_until(proc, "SAVED", 1000 * kill)  # at least one complete save of this round
            time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside a later save
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.communicate()

        checkpoint = torch.load(path, weights_only=True)  # raises on a truncated or half-written zip archive
        version, weights = checkpoint["version"], checkpoint["weights"]
        assert version >= 1000 * kill
        assert torch.equal(weights, torch.arange(weights.numel(), dtype=torch.float64) + version)
        assert checkpoint["checksum"] == float(weights.sum())
    # a kill mid-save leaves its temp file, hidden and without the checkpoint suffix
    assert all(p.name.startswith(".last.ckpt.") and p.suffix == ".tmp" for p in tmp_path.iterdir() if p != path)
