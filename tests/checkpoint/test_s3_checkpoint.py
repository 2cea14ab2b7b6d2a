"""Sharded checkpoints in S3 (`lightning_trn.core.checkpoint.s3_checkpoint`) against a real S3 API, moto's server on
127.0.0.1.

In-process: the commit object makes a save visible, a failed save commits nothing and is deleted by the next sweep,
"last" picks committed checkpoints only, a removal deletes the commit object first, a save the hooks did not send to
S3 is never committed, and the strategies whose sharded checkpoints have no S3 writer (ZeRO-1, asynchronous saves)
refuse `s3://`. Then one 2-rank job on the stand-in (tests/scripts/s3_checkpoint_train.py): `strategy="fsdp"` with
`ModelCheckpoint(dirpath="s3://...")`, `trainer.save_checkpoint("s3://...")`, Fabric's save and load, a resume with
`ckpt_path="last"`, and a SIGKILL in the middle of an upload."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from lightning.fabric.strategies import model_parallel as fabric_model_parallel

from lightning_trn.core.checkpoint import s3_checkpoint
from lightning_trn.core.checkpoint.checkpointer import Checkpointer, CheckpointLayout
from lightning_trn.core.checkpoint.s3_checkpoint import COMMIT_OBJECT
from lightning_trn.core.parallel.process_group import OneProcess
from lightning_trn.hooks.registry import S3_CHECKPOINT_HOOKS, installed
from tests.s3_server import moto_s3
from tests.sharded_runs import run_job

pytestmark = pytest.mark.native_only

BUCKET = "sharded-checkpoints"
SCRIPT = Path(__file__).parents[1] / "scripts" / "s3_checkpoint_train.py"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """The S3 client of the test, on one moto server for the module."""
    with moto_s3(BUCKET) as endpoint:
        s3_checkpoint._client_for.cache_clear()  # an earlier module's server
        yield boto3.client("s3", endpoint_url=endpoint)
    s3_checkpoint._client_for.cache_clear()


def keys(s3: Any, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def save(url: str, value: float, step: int, fail: bool = False) -> None:
    """What Lightning's sharded save does on one rank, into `url`: DCP files, then `meta.pt`; `fail`: raise after."""
    with installed(S3_CHECKPOINT_HOOKS), s3_checkpoint.staged_upload(url, 0, lambda o: o, lambda: None) as shadow:
        fabric_model_parallel._distributed_checkpoint_save({"w": torch.full((64,), value)}, Path(shadow))
        torch.save({"step": step}, Path(shadow) / "meta.pt")
        if fail:
            raise RuntimeError("the save died here")


def load(url: str) -> tuple[float, int]:
    """What Lightning's sharded load does: the tensor's value and the step in `meta.pt`."""
    state = {"w": torch.zeros(64)}
    with installed(S3_CHECKPOINT_HOOKS), s3_checkpoint.committed_source(url, lambda o: o, lambda: None) as shadow:
        fabric_model_parallel._distributed_checkpoint_load(state, Path(shadow))
        step = torch.load(Path(shadow) / "meta.pt", weights_only=True)["step"]
    assert torch.equal(state["w"], torch.full((64,), state["w"][0].item()))
    return state["w"][0].item(), step


def test_commit_object_makes_a_save_visible_and_what_a_failed_save_left_is_swept(s3: Any) -> None:
    directory = f"s3://{BUCKET}/unit"
    last, newer = f"{directory}/last.ckpt", f"{directory}/last-v1.ckpt"
    save(last, 1.0, 1)
    save(last, 2.0, 2)  # replaces the first version: one version and the commit object left
    s3_checkpoint.wait_for_deletions()  # the previous version is deleted in the background
    committed = s3_checkpoint.committed_version(last)
    assert keys(s3, "unit/last.ckpt/") == sorted(
        ["unit/last.ckpt/" + COMMIT_OBJECT]
        + [f"unit/last.ckpt/{committed}/{n}" for n in (".metadata", "__0_0.distcp", "meta.pt")]
    )
    with pytest.raises(RuntimeError, match="died"):
        save(last, 3.0, 3, fail=True)
    with pytest.raises(RuntimeError, match="died"):
        save(newer, 4.0, 4, fail=True)  # a new name that never got its commit object
    partial = [key for key in keys(s3, "unit/") if committed not in key and not key.endswith(COMMIT_OBJECT)]
    # DCP's files complete in both, but no `meta.pt` and no commit object; the writer's lease stays
    assert sorted(key.rsplit("/", 1)[1] for key in partial) == [
        ".lightning_trn-lease",
        ".lightning_trn-lease",
        ".metadata",
        ".metadata",
        "__0_0.distcp",
        "__0_0.distcp",
    ]

    assert load(last) == (2.0, 2)
    assert s3_checkpoint.newest_committed([directory]) == last  # not the newer, uncommitted last-v1.ckpt
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        load(newer)

    s3_checkpoint.sweep(directory)
    assert not [key for key in keys(s3, "unit/") if committed not in key and not key.endswith(COMMIT_OBJECT)]
    assert load(last) == (2.0, 2)

    s3_checkpoint.remove(last)
    s3_checkpoint.wait_for_deletions()
    assert keys(s3, "unit/") == []


def test_a_save_the_hooks_did_not_send_to_s3_is_not_committed(s3: Any) -> None:
    url = f"s3://{BUCKET}/unhooked/last.ckpt"
    with (
        pytest.raises(RuntimeError, match="did not go through S3"),
        s3_checkpoint.staged_upload(url, 0, lambda o: o, lambda: None) as shadow,
    ):
        fabric_model_parallel._distributed_checkpoint_save({"w": torch.ones(4)}, Path(shadow))
    # no commit object: only the writer's lease on the version, which marks it for the next sweep
    (lease,) = keys(s3, "unhooked/")
    assert lease.endswith("/" + s3_checkpoint.LEASE_OBJECT)
    s3_checkpoint.sweep(f"s3://{BUCKET}/unhooked")
    assert keys(s3, "unhooked/") == []


def test_sharded_checkpoints_without_an_s3_writer_refuse_s3() -> None:
    """ZeRO-1's sharded directories (the XLA backend's sharded checkpoints) and asynchronous DCP saves: a paragraph,
    at setup (the strategy's probe of its checkpoint directories) and at a save."""
    checkpointer = Checkpointer(OneProcess())
    with pytest.raises(ValueError, match=r"ZeRO-1 directories .*\(FSx for Lustre, EFS\)"):
        checkpointer.check_directory(f"s3://{BUCKET}/zero1", 0, 2, CheckpointLayout.ZERO1)
    checkpointer.check_directory(f"s3://{BUCKET}/z", 0, 2, CheckpointLayout.FILE)
    assert "asynchronous saves" in str(s3_checkpoint.refusal("s3://b/x", writes_dcp=True, async_save=True))
    assert s3_checkpoint.refusal("s3://b/x", writes_dcp=True, async_save=False) is None


def test_a_one_file_strategy_refuses_a_sharded_checkpoint_in_s3_with_a_paragraph(s3: Any) -> None:
    """`trainer.validate(ckpt_path="s3://.../last.ckpt")` on one device read the prefix as one file: a bare
    `EOFError` (found by a docs-only trial)."""
    url = f"s3://{BUCKET}/one-device/last.ckpt"
    save(url, 1.0, 1)
    with pytest.raises(ValueError, match=r"sharded checkpoint in S3 .* `strategy='fsdp'`"):
        Checkpointer(OneProcess()).load_source(url, CheckpointLayout.FILE)
    Checkpointer(OneProcess()).load_source(f"s3://{BUCKET}/one-device/model.ckpt", CheckpointLayout.FILE)  # a file


def _meta(s3: Any, name: str) -> dict[str, Any]:
    commit = json.loads(s3.get_object(Bucket=BUCKET, Key=f"job/{name}/{COMMIT_OBJECT}")["Body"].read())
    data = s3.get_object(Bucket=BUCKET, Key=f"job/{name}/{commit['version']}/meta.pt")["Body"].read()
    return torch.load(io.BytesIO(data), weights_only=True)


@pytest.mark.slow
def test_fsdp_job_saves_resumes_last_and_survives_a_kill_during_an_upload(tmp_path: Path, s3: Any) -> None:
    run_job(tmp_path, "dcp", "--url", f"s3://{BUCKET}/job", killed=True, script=SCRIPT)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in ranks:
        # the resume read last.ckpt of step 3 from S3: its step, and each rank's shards as the first fit ended
        assert record["first_end"][0] == 3 and record["resumed_start"] == record["first_end"]
        # Fabric's load put back the saved shards (a step after the save changed them) and the step
        assert record["fabric_stepped"] != record["fabric_saved"]
        assert record["fabric_loaded"] == [1, record["fabric_saved"]]
    assert ranks[0]["first_end"] != ranks[1]["first_end"]  # each rank's own shards

    # killed during the upload of step=5.ckpt (the step's first name; last.ckpt is linked to it once committed):
    # last.ckpt and ModelCheckpoint's top-1 are still step 4's, complete; trainer.save_checkpoint's and Fabric's are
    # there
    assert _meta(s3, "last.ckpt")["global_step"] == 4
    assert _meta(s3, "step=4.ckpt")["global_step"] == 4
    assert _meta(s3, "manual.ckpt")["global_step"] == 3
    assert _meta(s3, "fabric.ckpt")["step"] == 1
    assert s3_checkpoint.committed_version(f"s3://{BUCKET}/job/step=5.ckpt") is None
    # rank 1's shard of the killed save, each rank's random state, its writer's lease
    partial = keys(s3, "job/step=5.ckpt/")
    assert sorted(key.rsplit("/", 1)[1] for key in partial) == [
        s3_checkpoint.LEASE_OBJECT,
        "__1_0.distcp",
        "random-state-rank0.pt",
        "random-state-rank1.pt",
    ]
    assert s3_checkpoint.newest_committed([f"s3://{BUCKET}/job"]) == f"s3://{BUCKET}/job/last.ckpt"

    # what a resume's rank 0 runs first: the killed save's objects go (its writer's process is gone), and so does
    # whatever a background deletion had not finished
    s3_checkpoint.sweep(f"s3://{BUCKET}/job")
    assert keys(s3, "job/step=5.ckpt/") == [] and keys(s3, "job/step=3.ckpt/") == []
    assert _meta(s3, "last.ckpt")["global_step"] == 4
