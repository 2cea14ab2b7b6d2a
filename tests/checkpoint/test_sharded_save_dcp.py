"""Atomic torch.distributed.checkpoint saves: a 2-rank FSDP job (`strategy="fsdp"` on the stand-in's `neuron`
devices, DCP directories, `ModelCheckpoint(save_last=True, every_n_train_steps=1)`) killed with SIGKILL inside a
save leaves only checkpoints that load and equal the uninterrupted run's at the step they claim, and resumes exactly.
The protocol itself: `lightning_trn.core.checkpoint.sharded_save`, tested in tests/checkpoint/test_sharded_save.py with
ZeRO-1.

The same job on two "nodes" whose checkpoint directories are not one filesystem is refused before its first step
(`lightning_trn.core.checkpoint.shared_storage`; the probe's logic: tests/checkpoint/test_shared_storage.py)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.sharded_runs import can_exchange, kill_inside_a_save, resume_to_the_end, run_job, run_two_nodes

pytestmark = pytest.mark.native_only


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job, every step's checkpoint kept."""
    return run_job(tmp_path_factory.mktemp("reference"), "dcp", "--keep-all")


@pytest.mark.slow
def test_killed_after_rank_1s_shards_keeps_the_previous_checkpoint_and_resumes_exactly(
    tmp_path: Path, reference: Path
) -> None:
    """`last.ckpt` saved alone (no top-k file it could be linked to), save 3 (step 3): rank 1 wrote its
    `__1_0.distcp`, rank 0 (which writes `.metadata` last) had not written yet. Written in place, `last.ckpt` would
    load without an error as step 2 with rank 1's shards of step 3."""
    assert kill_inside_a_save(tmp_path, reference, "dcp", "3:1:wrote", "--last-only") == {"last.ckpt": 2}
    resume_to_the_end(tmp_path, reference, "dcp")


@pytest.mark.slow
def test_killed_after_rank_0s_shards_of_a_new_checkpoint_keeps_the_older_one(tmp_path: Path, reference: Path) -> None:
    """Save 5 (`step=3.ckpt`, a new name): rank 0 wrote its shards, rank 1 had not. `step=3.ckpt` does not appear;
    `step=2.ckpt` was not deleted yet (ModelCheckpoint deletes it after the new one is saved)."""
    assert kill_inside_a_save(tmp_path, reference, "dcp", "5:0:wrote") == {"last.ckpt": 2, "step=2.ckpt": 2}


@pytest.mark.slow
def test_killed_right_after_the_commit_has_the_new_checkpoint(tmp_path: Path, reference: Path) -> None:
    if not can_exchange(tmp_path):
        pytest.skip(
            "this filesystem cannot exchange two directories (tests/checkpoint/test_sharded_save.py covers its renames)"
        )
    assert kill_inside_a_save(tmp_path, reference, "dcp", "6:0:commit") == {"last.ckpt": 3, "step=3.ckpt": 3}


def _on_a_tmpfs_of_its_own(mountpoint: Path) -> list[str]:
    """A command prefix that runs its arguments in a mount namespace of their own, a tmpfs over `mountpoint`: a disk
    local to that "node" where the other sees the real directory."""
    return [
        "unshare",
        "-m",
        "sh",
        "-c",
        'mount --make-rprivate / && mount -t tmpfs none "$0" && exec "$@"',
        str(mountpoint),
    ]


@pytest.mark.slow
def test_node_local_checkpoint_directories_are_refused_before_the_first_step(tmp_path: Path) -> None:
    """Node 1's `ckpts/` is a tmpfs of its own. Without the probe both nodes trained and "saved", and node 0's
    `last.ckpt` held `__0_0.distcp` and `meta.pt` without rank 1's shard. Now every rank fails in the setup step
    `probe_checkpoint_dirs`, saying which rank saw whose probe file, and nothing is written."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    prefix = _on_a_tmpfs_of_its_own(ckpts)
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs in a mount namespace of its own here (`unshare -m` and `mount` need root)")
    host = socket.gethostname()
    seen = f"Rank 0 (host {host}) saw only the files of rank 0; rank 1 (host {host}) saw only the files of rank 1."
    for code, output in run_two_nodes(tmp_path, "dcp", prefix):
        assert code != 0, output[-3000:]
        assert "UnsharedDirectoryError" in output and seen in output, output[-3000:]
        assert "_probe_checkpoint_dirs" in output  # raised in the setup step, before the first training step
    assert list(ckpts.iterdir()) == []  # no checkpoint, no staging directory, no probe file left
