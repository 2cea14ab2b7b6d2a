"""Fault tolerance: resumable `DevicePrefetchLoader`, random state in checkpoints, kill -9 (or SIGTERM to one rank of
a DDP job) and resume to the same weights (a job with every kind of randomness, DDP, Fabric, the MLP recipe), atomic
saves. Both suites run it."""

from __future__ import annotations

import contextlib
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

from lightning_trn.core.checkpoint.checkpoint_file import LOADER_STATES_KEY
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.checkpoint.random_state import (
    RANDOM_STATE_KEY,
    host_states,
    loader_generators,
    set_host_states,
    step_seed,
)
from lightning_trn.core.device_loader import BATCHES_YIELDED, DevicePrefetchLoader
from tests.launch import child_env
from tests.models import AugmentedDataset

pytestmark = pytest.mark.both

PROJECT_ROOT = Path(__file__).resolve().parents[2]
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
                self.transferred.append(int(batch[0]) if batch[0].numel() == 1 else batch)
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


def _draws() -> tuple[float, float, float]:
    import numpy as np

    return float(torch.rand(())), float(np.random.rand()), random.random()


def test_host_states_round_trip_through_a_weights_only_checkpoint(tmp_path: Path):
    torch.manual_seed(1), random.seed(1)
    __import__("numpy").random.seed(1)
    torch.save(host_states(), tmp_path / "s.pt")
    expected = _draws()
    _draws()  # move every generator on
    set_host_states(torch.load(tmp_path / "s.pt", weights_only=True))
    assert _draws() == expected


def test_loader_generators_are_found_once_each():
    shared = torch.Generator()
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=True, generator=shared)  # hands it to its sampler
    assert loader_generators(loader) == [shared]
    assert loader_generators(DataLoader(list(range(8)), batch_size=2)) == []


def test_loader_replays_the_interrupted_epochs_order_and_samples():
    """Mid-epoch, the loader's state is the epoch's start: restored in a fresh loader (and fresh host generators),
    the batches after the skip are those the interrupted epoch would have drawn next, augmentation included."""

    def loader() -> DevicePrefetchLoader:
        plain = DataLoader(AugmentedDataset(32), batch_size=4, shuffle=True)
        return DevicePrefetchLoader(plain, torch.device("cpu"), FakeRuntime(read_ahead=2))

    torch.manual_seed(0)
    first = loader()
    list(first)  # an earlier epoch moves the generators on
    iterator = iter(first)
    done = [next(iterator) for _ in range(3)]
    saved = first.random_state(mid_epoch=True)
    assert saved[BATCHES_YIELDED] == len(done)
    rest = list(iterator)

    torch.manual_seed(0)  # the restarted process seeds again
    second = loader()
    set_host_states(saved["host"])
    assert second.restore_random_state(saved, skip=True)
    replayed = list(second)
    assert len(replayed) == len(rest)
    for (_, (x_a, y_a)), (_, (x_b, y_b)) in zip(rest, replayed, strict=True):
        assert torch.equal(x_a, x_b) and torch.equal(y_a, y_b)


def test_step_seeds_differ_per_batch_and_depend_only_on_base_and_index():
    seeds = {step_seed(7, i) for i in range(1000)}
    assert len(seeds) == 1000 and step_seed(7, 3) == step_seed(7, 3) != step_seed(8, 3)


def test_resuming_a_random_sampler_warns_unless_its_order_was_restored(caplog: pytest.LogCaptureFixture):
    shuffled = DataLoader(list(range(10)), batch_size=1, shuffle=True, generator=torch.Generator())
    with caplog.at_level(logging.WARNING, logger="lightning_trn.core.device_loader"):
        for loader in (_numbers_loader(), shuffled):
            wrapped = DevicePrefetchLoader(loader, torch.device("cpu"), FakeRuntime())
            wrapped.load_state_dict({BATCHES_YIELDED: 3})
            next(iter(wrapped))  # the position is decided at the first batch
            if loader is not shuffled:
                assert not caplog.records  # a sequential order needs no warning
        assert "held no random state" in caplog.text
        caplog.clear()
        restored = DevicePrefetchLoader(shuffled, torch.device("cpu"), FakeRuntime())
        assert restored.restore_random_state(wrapped.random_state(mid_epoch=True), skip=True)
        next(iter(restored))
        assert not caplog.records


def test_loader_states_are_saved_outside_lightnings_loop_state_and_restored_on_load(tmp_path: Path):
    states = [{BATCHES_YIELDED: 3}]
    checkpoint = {
        "state_dict": {"w": torch.ones(2)},
        "loops": {"fit_loop": {"state_dict": {"combined_loader": states}, "epoch_progress": {"total": 1}}},
    }
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


def _popen(args: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _read_until(proc: subprocess.Popen, prefix: str, at_least: int) -> list[str]:
    """Read the child's stdout until a line `<prefix> <n>` with n >= at_least; returns the lines read."""
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line.strip())
        if line.startswith(prefix) and int(line.split()[1]) >= at_least:
            return lines
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    raise AssertionError(f"child ended before `{prefix} {at_least}`:\n{lines}\n{stderr}")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child and every process it started (a data-parallel job's other ranks)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def _train(out: Path, devices: int = 1, max_steps: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *_train_args(out, devices, max_steps)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


MAX_STEPS, EVERY, BATCHES_PER_EPOCH, KILL_AT = 40, 5, 16, 23


def _train_args(out: Path, devices: int = 1, max_steps: int | None = None, *extra: str) -> list[str]:
    # the same command for every run; the delay lets the parent kill at a chosen step
    return [
        str(SCRIPTS / "ft_train.py"),
        "--out",
        str(out),
        "--max-steps",
        str(max_steps or MAX_STEPS),
        "--every",
        str(EVERY),
        "--step-delay",
        "0.05",
        "--devices",
        str(devices),
        *extra,
    ]


def _start_step(stdout: str) -> int:
    return int(next(line for line in stdout.splitlines() if line.startswith("START")).split()[1])


def _assert_same_weights(a: Path, b: Path) -> None:
    weights_a, weights_b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:  # the same graphs on the same inputs with the same random numbers: bitwise equal
        assert torch.equal(weights_a[name], weights_b[name]), name


@pytest.mark.slow
def test_kill_9_mid_epoch_and_rerun_ends_with_the_uninterrupted_weights(tmp_path: Path):
    """The job has every kind of randomness: a plain shuffling DataLoader, random augmentation in the dataset
    (torch, numpy, Python) and dropout on the device. Killed mid-epoch, rerun, it ends bitwise as the uninterrupted
    run; without the random state in the checkpoint it would not (the data order, the noise and the dropout masks)."""
    uninterrupted = _train(tmp_path / "a")
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert _start_step(uninterrupted.stdout) == 0

    out = tmp_path / "b"
    proc = _popen(_train_args(out), start_new_session=True)
    try:
        _read_until(proc, "STEP", KILL_AT)
    finally:
        _kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "final.pt").exists()
    resumed = _train(out)
    assert resumed.returncode == 0, resumed.stderr
    assert "not exact" not in resumed.stderr
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved[LOADER_STATES_KEY] == [{BATCHES_YIELDED: saved["global_step"] % BATCHES_PER_EPOCH}]
    assert "combined_loader" not in saved["loops"]["fit_loop"]["state_dict"]  # a plain DataLoader can resume it too
    assert len(saved[RANDOM_STATE_KEY]["ranks"]) == 1
    start = _start_step(resumed.stdout)
    assert EVERY <= start < MAX_STEPS and start % EVERY == 0  # resumed from a mid-run checkpoint ...
    assert start % BATCHES_PER_EPOCH != 0  # ... taken mid-epoch (epoch 1), so the loader had to skip batches
    assert "not resumable" not in resumed.stderr  # Lightning saw a stateful loader
    _assert_same_weights(tmp_path / "a" / "final.pt", out / "final.pt")


@pytest.mark.slow
def test_sigterm_to_one_rank_of_a_data_parallel_job_stops_both_at_one_checkpoint_and_rerun_ends_equal(tmp_path: Path):
    """The same job on 2 processes (8 batches per rank and epoch). Rank 1 alone gets SIGTERM after step 13 (a
    preempted node): both ranks stop after that same step, one checkpoint of step 13 is written (mid-epoch 1); rerun,
    each rank resumes its own random state and the job ends bitwise as the uninterrupted run."""
    steps, stop_at = 16, 13
    uninterrupted = _train(tmp_path / "a", devices=2, max_steps=steps)
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    out = tmp_path / "b"
    # no session of its own (a warm start): if a rank hangs, killing the client ends the warm fork with its ranks
    proc = _popen(_train_args(out, 2, steps, "--sigterm-rank", "1", "--sigterm-step", str(stop_at)))
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)  # ends when both ranks closed their stdout
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the signalled job did not stop: a rank hung")
    assert proc.returncode == 0, stderr  # `SIGTERMException` is a `SystemExit` without a code
    assert sorted(line for line in stdout.splitlines() if line.startswith("STOPPED")) == [
        f"STOPPED {rank} {stop_at}" for rank in (0, 1)
    ], stdout + stderr
    assert not (out / "final.pt").exists()
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == stop_at and len(saved[RANDOM_STATE_KEY]["ranks"]) == 2
    resumed = _train(out, devices=2, max_steps=steps)
    assert resumed.returncode == 0, resumed.stderr
    assert "not exact" not in resumed.stderr
    assert _start_step(resumed.stdout) == stop_at
    _assert_same_weights(tmp_path / "a" / "final.pt", out / "final.pt")


def test_a_checkpoint_without_random_state_resumes_with_one_notice(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """As a checkpoint written by Lightning on a CPU/GPU or by an older lightning_trn: it resumes, and says once that
    the resume is not exact and why."""
    import lightning.pytorch as pl

    from tests.models import RegressionModel, regression_loader

    def trainer(steps: int) -> pl.Trainer:
        return pl.Trainer(
            accelerator="neuron",
            devices=1,
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=tmp_path,
        )

    first = trainer(2)
    first.fit(RegressionModel(), regression_loader(n=64))
    path = tmp_path / "old.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert len(checkpoint.pop(RANDOM_STATE_KEY)["ranks"]) == 1
    torch.save(checkpoint, path)
    resumed = trainer(3)
    with caplog.at_level(logging.WARNING, logger="lightning_trn"):
        resumed.fit(RegressionModel(), regression_loader(n=64), ckpt_path=path)
    assert resumed.global_step == 3
    notices = [r.getMessage() for r in caplog.records if "this resume is not exact" in r.getMessage()]
    assert len(notices) == 1 and "holds no lightning_trn random state" in notices[0], notices


def _fabric_run(path: Path, steps: int, save_at: int = 0, stop_at: int = 0) -> dict[str, torch.Tensor]:
    """A Fabric loop with a plain shuffling loader, augmentation and dropout; saves at step `save_at` (mid-epoch),
    returns at `stop_at`, and resumes from `path` if it exists (the loader skips the batches done)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="neuron", devices=1)
    fabric.seed_everything(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(AugmentedDataset(64, seed=3), batch_size=8, shuffle=True))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "epoch": 0, "step": 0}
    if path.exists():
        fabric.load(path, state)
    epoch, step = state["epoch"], state["step"]
    while step < steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step == save_at:
                fabric.save(path, {**state, "epoch": epoch, "step": step})
            if step in (stop_at, steps):
                return {k: v.detach().cpu() for k, v in model.state_dict().items()}
        epoch += 1
    raise AssertionError("unreachable")


def test_fabric_save_and_load_resume_mid_epoch_exactly(tmp_path: Path):
    uninterrupted = _fabric_run(tmp_path / "unused.ckpt", steps=20)
    _fabric_run(tmp_path / "f.ckpt", steps=20, save_at=11, stop_at=13)  # epoch 1, batch 3 of 8
    resumed = _fabric_run(tmp_path / "f.ckpt", steps=20)
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], resumed[name]), name


def _recipe(out: Path, *overrides: str, **kwargs: Any) -> subprocess.Popen:
    args = [
        "-m",
        "lightning_trn.recipes.mlp",
        f"out_dir={out}",
        "model.hidden=[32]",
        "trainer.max_epochs=4",
        "trainer.limit_train_batches=40",
        "trainer.enable_progress_bar=false",
        *overrides,
    ]
    return _popen(args, cwd=str(PROJECT_ROOT), **kwargs)


def _recipe_result(proc: subprocess.Popen, out: Path) -> tuple[str, dict[str, torch.Tensor]]:
    stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, stderr
    assert "not exact" not in stderr
    line = next(line for line in stdout.splitlines() if "held-out test" in line)
    return line, torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.slow
def test_mlp_recipe_killed_at_a_random_moment_and_restarted_ends_as_the_uninterrupted_run(tmp_path: Path):
    """`python -m recipes.mlp` (its plain generator-seeded shuffle, epoch-end checkpoints), killed at a random
    moment of its third epoch (training, validation or a save), restarted with `ckpt_path=`: the same test metrics
    and weights.

    The kill point is measured, not guessed: the time between the first two checkpoints is an epoch of this run on
    this machine, and the kill comes within one more, while two epochs are left (a fixed delay outlived a fast run)."""
    expected_line, expected = _recipe_result(_recipe(tmp_path / "a"), tmp_path / "a")
    out, rng = tmp_path / "b", random.Random()
    ckpt = out / "checkpoints" / "last.ckpt"
    proc = _recipe(out, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S

        def next_checkpoint(previous: tuple[int, int] | None) -> tuple[int, int] | None:
            """The checkpoint's (inode, mtime) once it differs from `previous` (a save replaces the file)."""
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(FileNotFoundError):
                    stat = ckpt.stat()
                    if (stat.st_ino, stat.st_mtime_ns) != previous:
                        return stat.st_ino, stat.st_mtime_ns
                time.sleep(0.005)
            return None

        first = next_checkpoint(None)
        first_at = time.monotonic()
        next_checkpoint(first)
        epoch = time.monotonic() - first_at
        time.sleep(rng.uniform(0.0, epoch))  # somewhere in the third epoch
    finally:
        _kill_group(proc)
    if proc.returncode != -signal.SIGKILL:
        pytest.fail(f"the run ended before the kill (exit {proc.returncode}): nothing was tested")
    line, resumed = _recipe_result(_recipe(out, f"ckpt_path={ckpt}"), out)
    assert line == expected_line
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name


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
    env = child_env(**tmpdir_elsewhere)
    for kill in range(4):
        proc = _popen(
            [str(SCRIPTS / "ft_save_loop.py"), "--path", str(path), "--first-version", str(1000 * kill)], env=env
        )
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
