"""Atomic sharded checkpoints (`lightning_trn.core.checkpoint.sharded_save`): the protocol's states in process, and
2-rank ZeRO-1 jobs with sharded checkpoints (`NeuronDDPStrategy(zero1=True, state_dict_type="sharded")`) killed with
SIGKILL inside a save. Both suites run it (tests/checkpoint/test_sharded_save_dcp.py kills DCP saves on the
stand-in)."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from benchmarks import checkpoint_syscalls
from benchmarks.checkpoint_syscalls import OPERATIONS, count_per_save, without_exchange
from lightning_trn.core.checkpoint import leases, sharded_save
from lightning_trn.core.checkpoint.sharded_save import (
    recover,
    recover_all,
    recover_local,
    remove,
    staged_directory,
)
from lightning_trn.core.parallel.zero1 import chunk_file
from tests.models import RegressionModel, regression_loader
from tests.sharded_runs import can_exchange, kill_inside_a_save, load, resume_to_the_end, run_job

pytestmark = pytest.mark.both


class Killed(BaseException):
    """Stands for a SIGKILL at that point: nothing after it runs."""


#: a writer that holds no lease: gone (`leases`)
DEAD = "d" * 16


def _owned(name: str, kind: str, writer: str | None = None) -> str:
    """The name of lightning_trn's entry of `kind` beside checkpoint `name`, by `writer` (this process's)."""
    return f".{name}.{leases.OWNER_TAG}-{writer or leases.writer().id}.{kind}"


def _save(path: Path, files: dict[str, str]) -> None:
    """One sharded save by a one-rank job: `files` written into the staging directory."""
    with staged_directory(path, rank=0, barrier=lambda: None, broadcast=lambda o: o) as staging:
        for name, text in files.items():
            Path(staging, name).write_text(text)


def _contents(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in path.iterdir()}


def _hidden(parent: Path) -> list[str]:
    """The hidden entries of `parent`, each save's or removal's token left out of lightning_trn's names (what
    `_owned` names)."""
    return sorted(_TOKEN.sub(r"\1", p.name) for p in parent.iterdir() if p.name.startswith("."))


#: the per-save token after the writer id in lightning_trn's names
_TOKEN = re.compile(r"(lightning_trn-[0-9a-f]{16})-[0-9a-f]{8}")


def _raw_hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_save_replaces_the_whole_directory_never_file_by_file(tmp_path: Path) -> None:
    """A save starts from an empty directory: no file of an earlier save, nor of a killed save's leftovers, can end
    up beside the new files (the same shard names from save to save would load as a silent mix)."""
    path = tmp_path / "last.ckpt"
    _save(path, {"__0_0.distcp": "step 1", "__1_0.distcp": "step 1"})
    (tmp_path / _owned("last.ckpt", "partial")).mkdir()
    (tmp_path / _owned("last.ckpt", "partial") / "__1_0.distcp").write_text("killed save of step 2")
    _save(path, {"__0_0.distcp": "step 3"})
    assert _contents(path) == {"__0_0.distcp": "step 3"}
    assert _hidden(tmp_path) == []


def test_a_rank_that_fails_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    _save(path, {"shard": "step 1"})
    with pytest.raises(OSError), staged_directory(path, 0, lambda: None, lambda o: o) as staging:
        Path(staging, "shard").write_text("step 2, half")
        raise OSError("disk full")
    assert _contents(path) == {"shard": "step 1"}


@pytest.fixture(name="without_exchange")
def without_exchange_fixture() -> Iterator[None]:
    """A filesystem without `RENAME_EXCHANGE` (NFS, Lustre): `renameat2` fails with EINVAL, the commit takes two
    renames."""
    with without_exchange():
        yield


def _kill_at_rename(monkeypatch: pytest.MonkeyPatch, number: int) -> None:
    """The process dies at its `number`-th `os.rename` from now (1-based), before it happens."""
    rename = os.rename
    calls = {"count": 0}

    def dying(source: str, target: str) -> None:
        calls["count"] += 1
        if calls["count"] == number:
            raise Killed
        rename(source, target)

    monkeypatch.setattr(os, "rename", dying)


def test_a_kill_between_the_two_renames_is_recovered_to_the_previous_checkpoint(
    tmp_path: Path, without_exchange: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    _save(path, {"shard": "step 1"})
    with monkeypatch.context() as patch:
        _kill_at_rename(patch, 2)  # the first moved step 1 aside
        with pytest.raises(Killed):
            _save(path, {"shard": "step 2"})
    assert not path.exists() and _hidden(tmp_path) == [_owned("last.ckpt", "old"), _owned("last.ckpt", "partial")]
    recover_all(tmp_path)
    assert _contents(path) == {"shard": "step 1"}
    _save(path, {"shard": "step 3"})
    assert _contents(path) == {"shard": "step 3"} and _hidden(tmp_path) == []


def test_a_kill_after_the_two_renames_is_finished_by_recover(
    tmp_path: Path, without_exchange: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after both renames, before the old copy was deleted: the new checkpoint stays, the old copy goes."""
    path = tmp_path / "last.ckpt"
    _save(path, {"shard": "step 1"})
    with monkeypatch.context() as patch:
        patch.setattr(sharded_save, "_discard", lambda target: None)
        _save(path, {"shard": "step 2"})
    assert _contents(path) == {"shard": "step 2"} and _hidden(tmp_path) == [_owned("last.ckpt", "old")]
    recover(path)
    assert _contents(path) == {"shard": "step 2"} and _hidden(tmp_path) == []


def test_the_commit_swaps_in_one_step_where_the_filesystem_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`RENAME_EXCHANGE` (Linux, local filesystems): no rename at all, the name holds a complete checkpoint at
    every instant; the previous one is left under the staging name if the job dies before deleting it."""
    if not can_exchange(tmp_path):
        pytest.skip("this filesystem cannot exchange two directories")
    path = tmp_path / "last.ckpt"
    _save(path, {"shard": "step 1"})
    _kill_at_rename(monkeypatch, 1)
    monkeypatch.setattr(sharded_save, "_discard", lambda target: None)
    _save(path, {"shard": "step 2"})
    assert _contents(path) == {"shard": "step 2"}
    (staging,) = tmp_path.glob(".last.ckpt.lightning_trn-*.partial")
    assert _contents(staging) == {"shard": "step 1"}  # the next save deletes it


def test_removing_a_checkpoint_directory_never_leaves_part_of_it_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "step=1.ckpt"
    _save(path, {"a": "1", "b": "1"})

    def killed(*args: object, **kwargs: object) -> None:
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", killed)
        with pytest.raises(Killed):
            remove(path)
    assert not path.exists() and _hidden(tmp_path) == [_owned("step=1.ckpt", "removing")]
    recover_all(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["zero1", "dcp"])
def test_a_save_syncs_each_file_once_so_its_cost_grows_linearly_with_the_ranks(kind: str) -> None:
    """W simulated ranks (threads) save through `staged_directory` with the real writers (benchmarks/
    checkpoint_syscalls.py). Every rank fsyncing every file of the staging directory cost W x (W + 2) fsyncs; each
    file synced once by its writer, and by rank 0 only what no writer synced, costs a*W + b, as do the renames,
    mkdirs and deletions."""
    sizes = (2, 4, 8, 64, 256)
    counts = {size: count_per_save(size, kind) for size in sizes}
    for operation in OPERATIONS:
        line = {size: counts[size][operation] for size in sizes}
        slope = (line[4] - line[2]) // 2
        intercept = line[2] - 2 * slope
        assert slope <= 2 and intercept <= 6, (operation, line)
        assert line == {size: slope * size + intercept for size in sizes}, (operation, line)
    if kind == "dcp":  # each shard, `.metadata` and `meta.pt` once, the staging directory and its parent
        assert {size: counts[size]["fsync"] for size in sizes} == {size: size + 4 for size in sizes}


def test_the_benchmark_prints_a_row_per_format_commit_and_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint_syscalls.main(["--world-sizes", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| zero1 |", "| dcp |"))]
    assert len(rows) == 4, rows


def test_only_files_no_writer_synced_are_synced_by_rank_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    monkeypatch.setattr(sharded_save, "_fsync_file", synced.append)
    names = ["__0_0.distcp", "__13_2.distcp", ".metadata", chunk_file(3), "meta.pt", "checkpoint.pt", "extra.bin"]
    for name in names:
        (tmp_path / name).write_text("x")
    sharded_save.sync_unsynced(str(tmp_path))
    assert sorted(Path(path).name for path in synced) == ["checkpoint.pt", "extra.bin", "meta.pt"]


def _leftovers(parent: Path) -> None:
    """What killed commits and deletions leave, many of each, for several recoverers to race on."""
    for index in range(12):
        for name, step in (
            (f"kept{index}.ckpt", 2),
            (_owned(f"kept{index}.ckpt", "old", DEAD), 1),
            (_owned(f"lost{index}.ckpt", "old", DEAD), 1),
            (_owned(f"gone{index}.ckpt", "removing", DEAD), 0),
        ):
            (parent / name).mkdir()
            for shard in range(30):
                (parent / name / f"__{shard}_0.distcp").write_text(f"step {step}")


def _recover_all_at_once(directory: Path, callers: int) -> list[BaseException]:
    """`recover_all(directory)` from `callers` threads started together; what each raised."""
    start = threading.Barrier(callers)
    errors: list[BaseException] = []

    def recoverer() -> None:
        start.wait()
        try:
            recover_all(directory)
        except Exception as error:  # noqa: BLE001  # any error is the test's failure, reported by the caller
            errors.append(error)

    threads = [threading.Thread(target=recoverer) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_concurrent_recover_all_calls_do_not_raise_and_agree(tmp_path: Path) -> None:
    """Four processes resuming at once (or a rank 0 beside a user's script): whatever one renamed or deleted first,
    the others skip."""
    for attempt in range(3):
        parent = tmp_path / str(attempt)
        parent.mkdir()
        _leftovers(parent)
        assert _recover_all_at_once(parent, 4) == []
        assert _hidden(parent) == []
        for index in range(12):
            assert set(_contents(parent / f"kept{index}.ckpt").values()) == {"step 2"}
            assert set(_contents(parent / f"lost{index}.ckpt").values()) == {"step 1"}


def test_a_previous_copy_that_cannot_be_deleted_never_fails_the_save(
    tmp_path: Path, without_exchange: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NFS keeps a file another process still has open as `.nfs*`, and its directory cannot be removed (EBUSY,
    ENOTEMPTY): the commit is done, so the save succeeds with a warning; the copy moves out of the way of the next
    save's two renames, which deletes it."""
    path = tmp_path / "last.ckpt"
    _save(path, {"shard": "step 1"})
    rmtree = shutil.rmtree

    def busy(target: str, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), target)

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="lightning_trn"):
        patch.setattr(shutil, "rmtree", busy)
        _save(path, {"shard": "step 2"})
    assert _contents(path) == {"shard": "step 2"}
    (left,) = _raw_hidden(tmp_path)
    assert _TOKEN.sub(r"\1", left) == _owned("last.ckpt", "removing")
    assert _contents(tmp_path / left) == {"shard": "step 1"}
    old = re.escape(str(tmp_path / _owned("last.ckpt", "")[:-1])) + r"-[0-9a-f]{8}\.old"
    assert re.search(f"could not delete {old}", caplog.text) and left in caplog.text
    assert shutil.rmtree is rmtree
    _save(path, {"shard": "step 3"})
    assert _contents(path) == {"shard": "step 3"} and _hidden(tmp_path) == []


def test_other_ranks_wait_for_rank_0_to_put_back_a_checkpoint(tmp_path: Path) -> None:
    """Before the Trainer's process group exists: rank 1 watches the directory until rank 0's `recover_all` is
    done, and gives up with a message naming the checkpoint if it never is."""
    (tmp_path / _owned("last.ckpt", "old", DEAD)).mkdir()
    with pytest.raises(TimeoutError, match="last.ckpt"):
        recover_local([str(tmp_path)], rank=1, barrier=None, timeout_s=0.3)
    assert _hidden(tmp_path) == [_owned("last.ckpt", "old", DEAD)]  # only rank 0 changes anything
    rank_0 = threading.Timer(0.3, recover_local, args=([str(tmp_path)], 0, None))
    rank_0.start()
    recover_local([str(tmp_path)], rank=1, barrier=None, timeout_s=30)
    assert (tmp_path / "last.ckpt").is_dir()
    rank_0.join()


# resuming: the checkpoint a commit killed between its two renames left aside is put back before one is chosen


class _RecordStart(Callback):
    """Records the step a fit starts at (a resume: the checkpoint's)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def _fit(ckpts: Path, steps: int, accelerator: str = "neuron", ckpt_path: str | Path | None = None) -> _RecordStart:
    start = _RecordStart()
    checkpoints = ModelCheckpoint(dirpath=ckpts, save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints, start],
        default_root_dir=ckpts.parent,
    )
    trainer.fit(RegressionModel(), regression_loader(n=64), ckpt_path=ckpt_path)
    return start


@pytest.mark.parametrize("resume", ["last", "explicit path"])
def test_fit_puts_back_the_checkpoint_a_killed_commit_left_aside_before_choosing_one(tmp_path: Path, resume: str):
    """`last.ckpt` renamed aside, its new copy not yet renamed in: `ckpt_path="last"` would find no checkpoint and
    train from scratch, an explicit path would not be found. Rank 0 puts it back first (`hooks/resume.py`)."""
    ckpts = tmp_path / "ckpts"
    _fit(ckpts, steps=2)
    (ckpts / "last.ckpt").rename(ckpts / _owned("last.ckpt", "old", DEAD))
    start = _fit(ckpts, steps=3, ckpt_path="last" if resume == "last" else ckpts / "last.ckpt")
    assert start.step == 2
    assert _hidden(ckpts) == [] and torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 3


def test_runs_on_other_accelerators_resolve_the_checkpoint_as_lightning_does(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / _owned("last.ckpt", "old", DEAD)).write_text("what a killed sharded save of a Neuron run left")
    with pytest.warns(UserWarning, match="there is no last checkpoint"):
        assert _fit(ckpts, steps=1, accelerator="cpu", ckpt_path="last").step == 0
    assert _owned("last.ckpt", "old", DEAD) in _hidden(ckpts)


def test_fabric_load_puts_back_the_checkpoint_a_killed_commit_left_aside(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="neuron", devices=1)
    model = fabric.setup(torch.nn.Linear(2, 2))
    path = tmp_path / "state.ckpt"
    fabric.save(path, {"model": model, "step": 7})
    path.rename(tmp_path / _owned("state.ckpt", "old", DEAD))
    state = {"model": model, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 7 and _hidden(tmp_path) == []


# 2-rank ZeRO-1 jobs killed inside a save (tests/scripts/sharded_save_train.py), each checkpoint left checked against
# the uninterrupted run's checkpoint of the step it claims


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job, every step's checkpoint kept."""
    return run_job(tmp_path_factory.mktemp("reference"), "zero1", "--keep-all")


@pytest.mark.slow
def test_zero1_job_killed_after_one_ranks_file_keeps_the_previous_checkpoint_and_resumes_exactly(
    tmp_path: Path, reference: Path
) -> None:
    """Save 6 (`last.ckpt` of step 3): rank 1 wrote its `zero1-rank1.pt`, rank 0 had not written yet. Written in
    place, `last.ckpt` would claim step 2 with rank 1's optimizer state of step 3."""
    assert kill_inside_a_save(tmp_path, reference, "zero1", "6:1:wrote") == {"last.ckpt": 2, "step=3.ckpt": 3}
    resume_to_the_end(tmp_path, reference, "zero1", from_step=2)


@pytest.mark.slow
# CI time: the commit is the same code for every strategy; the native suite kills it in a DCP save
@pytest.mark.xla_only
def test_zero1_job_killed_right_after_the_commit_has_the_new_checkpoint(tmp_path: Path, reference: Path) -> None:
    if not can_exchange(tmp_path):
        pytest.skip("this filesystem cannot exchange two directories (the unit tests cover its two renames)")
    assert kill_inside_a_save(tmp_path, reference, "zero1", "6:0:commit") == {"last.ckpt": 3, "step=3.ckpt": 3}


@pytest.mark.slow
# CI time: the recovery is the same code on both backends; the XLA suite kills a ZeRO-1 commit right after its swap
@pytest.mark.native_only
def test_zero1_job_killed_between_the_two_renames_resumes_from_the_checkpoint_put_back(
    tmp_path: Path, reference: Path
) -> None:
    """NFS, Lustre: `renameat2` answers EINVAL and the commit takes two renames. Killed between them in save 6
    (`last.ckpt` of step 3): no `last.ckpt`, step 2's set aside by the killed writer. `fit(ckpt_path="last")` has
    rank 0 put it back (its writer's process is gone) while rank 1 waits, before the path is chosen: the job resumes
    at step 2 (not from scratch), its later commits take two renames too, and it ends with the uninterrupted run's
    checkpoints and no entry of the killed writer left."""
    ckpts = run_job(tmp_path, "zero1", "--no-exchange", "--kill", "6:0:renamed", killed=True)
    assert not (ckpts / "last.ckpt").exists()
    (aside,) = ckpts.glob(".last.ckpt.lightning_trn-*.old")
    assert load(aside)["global_step"] == 2
    resume_to_the_end(tmp_path, reference, "zero1", "--no-exchange", from_step=2)
    assert _hidden(ckpts) == []
