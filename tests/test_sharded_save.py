"""Atomic sharded checkpoints (`lightning_trn.core.sharded_save`): the protocol's states in process, and 2-rank ZeRO-1
jobs with sharded checkpoints (`NeuronDDPStrategy(zero1=True, state_dict_type="sharded")`) killed with SIGKILL inside
a save. Both suites run it (tests/standin/test_sharded_save_dcp.py kills DCP saves on the stand-in)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_trn.core import sharded_save
from lightning_trn.core.sharded_save import recover, recover_all, remove, staged_directory, staging_path
from tests.sharded_runs import can_exchange, kill_inside_a_save, resume_to_the_end, run_job

pytestmark = pytest.mark.both


class Killed(BaseException):
    """Stands for a SIGKILL at that point: nothing after it runs."""


def _save(path: Path, files: dict[str, str]) -> None:
    """One sharded save by a one-rank job: `files` written into the staging directory."""
    with staged_directory(path, rank=0, barrier=lambda: None) as staging:
        for name, text in files.items():
            Path(staging, name).write_text(text)


def _contents(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in path.iterdir()}


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_save_replaces_the_whole_directory_never_file_by_file(tmp_path: Path) -> None:
    """A save starts from an empty directory: no file of an earlier save, nor of a killed save's leftovers, can end
    up beside the new files (the same shard names from save to save would load as a silent mix)."""
    path = tmp_path / "last.ckpt"
    _save(path, {"__0_0.distcp": "step 1", "__1_0.distcp": "step 1"})
    Path(staging_path(path)).mkdir()
    Path(staging_path(path), "__1_0.distcp").write_text("killed save of step 2")
    _save(path, {"__0_0.distcp": "step 3"})
    assert _contents(path) == {"__0_0.distcp": "step 3"}
    assert _hidden(tmp_path) == []


def test_a_rank_that_fails_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    _save(path, {"shard": "step 1"})
    with pytest.raises(OSError), staged_directory(path, rank=0, barrier=lambda: None) as staging:
        Path(staging, "shard").write_text("step 2, half")
        raise OSError("disk full")
    assert _contents(path) == {"shard": "step 1"}


@pytest.fixture
def without_exchange(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A filesystem without `RENAME_EXCHANGE` (NFS, Lustre): the commit takes two renames."""
    monkeypatch.setattr(sharded_save, "_exchange", lambda first, second: False)
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
    assert not path.exists() and _hidden(tmp_path) == [".last.ckpt.old", ".last.ckpt.partial"]
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
    assert _contents(path) == {"shard": "step 2"} and _hidden(tmp_path) == [".last.ckpt.old"]
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
    assert _contents(Path(staging_path(path))) == {"shard": "step 1"}  # the next save deletes it


def test_removing_a_checkpoint_directory_never_leaves_part_of_it_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "step=1.ckpt"
    _save(path, {"a": "1", "b": "1"})
    def killed(target: str) -> None:
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", killed)
        with pytest.raises(Killed):
            remove(path)
    assert not path.exists() and _hidden(tmp_path) == [".step=1.ckpt.removing"]
    recover_all(tmp_path)
    assert list(tmp_path.iterdir()) == []


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
    resume_to_the_end(tmp_path, reference, "zero1")


@pytest.mark.slow
# CI time: the commit is the same code for every strategy; the native suite kills it in a DCP save
@pytest.mark.xla_only
def test_zero1_job_killed_right_after_the_commit_has_the_new_checkpoint(tmp_path: Path, reference: Path) -> None:
    if not can_exchange(tmp_path):
        pytest.skip("this filesystem cannot exchange two directories (the unit tests cover its two renames)")
    assert kill_inside_a_save(tmp_path, reference, "zero1", "6:0:commit") == {"last.ckpt": 3, "step=3.ckpt": 3}
