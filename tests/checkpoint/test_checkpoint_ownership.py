"""Checkpoints no other process can break (docs/fault-tolerance.md, "Who may change what"): lightning_trn acts only on
what it created, and never on a live writer's work; one write per checkpoint event; asynchronous failures stop every
rank; S3 deletions batched and off the save's critical path.

Each race is run with two processes: the test's own (the writer, held at the racy moment) and a second Python
process acting on the same directory or prefix (a resume's recovery, an evaluation job's `trainer.validate`)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.strategies import model_parallel as fabric_model_parallel
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_trn.core.checkpoint import async_save, leases, s3_checkpoint, sharded_save
from lightning_trn.core.checkpoint.async_save import AsyncCheckpointer
from lightning_trn.core.checkpoint.distributed_checkpoint import load_consolidated
from lightning_trn.core.checkpoint.random_state import RANDOM_STATE_KEY, rank_file_name
from lightning_trn.hooks.registry import S3_CHECKPOINT_HOOKS, installed
from tests.launch import child_env, free_port, run_job
from tests.s3_server import moto_s3

pytestmark = pytest.mark.native_only

SCRIPTS = Path(__file__).parents[1] / "scripts"
BUCKET = "ownership"
#: names a user's own files often have, and names that look like lightning_trn's leftovers of old
LOOK_ALIKES = {
    ".notes.old/keep.txt": "a user's notes",
    ".env.old": "SECRET=1",
    ".x.old": "x",
    "y.removing": "y",
    ".z.partial/part": "z",
    ".last.ckpt.old/__0_0.distcp": "a user's copy",
    ".last.ckpt.partial": "a user's file",
    ".step=1.ckpt.removing": "a user's file",
    "data/commit.json": '{"version": "00000000000000000001-0badc0de"}',
    "data/00000000000000000001-0badc0de/rows.bin": "rows",
}


def _fill(directory: Path) -> dict[str, str]:
    for name, text in LOOK_ALIKES.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    return _digests(directory, LOOK_ALIKES)


def _digests(directory: Path, names: Any) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in names}


def _our_entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if leases.OWNER_TAG in p.name)


# ownership: a user's files, in a checkpoint folder and in the working directory under SLURM


@pytest.fixture(scope="module")
def neighbours(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict[str, Any]]:
    """tests/scripts/checkpoint_neighbours.py in a working directory and a checkpoint folder full of look-alikes."""
    out = tmp_path_factory.mktemp("neighbours")
    (out / "ckpts").mkdir()
    before = {f"ckpts/{k}": v for k, v in _fill(out / "ckpts").items()} | _fill(out)
    run_job(SCRIPTS / "checkpoint_neighbours.py", out, "--out", str(out), env=child_env(), timeout=600)
    return out, before, json.loads((out / "record.json").read_text())


def test_a_users_files_beside_the_checkpoints_are_never_renamed_or_deleted(
    neighbours: tuple[Path, dict[str, str], dict[str, Any]],
) -> None:
    """Two fits into a `ModelCheckpoint` folder (a resume with `ckpt_path="last"`, saves, top-k removals) and two
    under SLURM in the working directory (`ckpt_path=None` recovers `default_root_dir`): every look-alike is there,
    byte for byte (before: `.notes.old` became `notes`, `.env.old` became `env`)."""
    out, before, record = neighbours
    assert _digests(out, before) == before
    assert record["async"][1] == 3  # the resume found last.ckpt of step 3
    assert _our_entries(out / "ckpts") == [] and _our_entries(out) == []  # and it left nothing of its own


def test_one_write_per_checkpoint_event_however_many_names(neighbours: tuple[Path, dict[str, str], Any]) -> None:
    """`ModelCheckpoint(save_top_k=1, save_last=True)` saves `step=N.ckpt` and `last.ckpt` at every step: the
    shards are written once (one DCP write per step, synchronous and asynchronous), `last.ckpt` holds the same files
    (hard links) and its own `meta.pt`."""
    out, _, record = neighbours
    assert record["sync"] == [3, 0] and record["async"] == [1, 3]  # writes, start step
    last, top = out / "ckpts" / "last.ckpt", out / "ckpts" / "step=4.ckpt"
    assert sorted(p.name for p in out.joinpath("ckpts").iterdir() if p.name.endswith(".ckpt")) == [
        "last.ckpt",
        "step=4.ckpt",
    ]
    for shard in top.glob("__*.distcp"):
        assert (last / shard.name).stat().st_ino == shard.stat().st_ino
    assert load_consolidated(last)["global_step"] == 4
    assert (last / "meta.pt").stat().st_ino != (top / "meta.pt").stat().st_ino  # each name's own meta.pt
    # each rank's random state in its own file; `meta.pt`, which every rank reads, holds a header only
    meta = torch.load(last / "meta.pt", weights_only=True)
    assert meta[RANDOM_STATE_KEY] == {"version": 2, "world_size": 1} and (last / rank_file_name(0)).is_file()
    # and no device tensor: the best-loss callback's score was saved as `neuron:0` (a resume on rank 1 compared it
    # with its own device's; a process without the device could not load `meta.pt`)
    tensors: list[torch.Tensor] = []
    apply_to_collection(meta, torch.Tensor, tensors.append)
    assert tensors and {tensor.device.type for tensor in tensors} == {"cpu"}


# concurrency on a filesystem without RENAME_EXCHANGE (Lustre, EFS): a resume in another process while a writer is
# between its two renames


def _python(code: str, cwd: Path) -> subprocess.Popen[str]:
    env = child_env()
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _save_file(path: Path, text: str) -> None:
    with sharded_save.staged_directory(path, 0, lambda: None, lambda o: o) as staging:
        Path(staging, "shard").write_text(text)


def test_another_processs_resume_waits_for_a_live_writer_between_its_two_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This process commits `last.ckpt` with two renames and is held between them: no `last.ckpt`, the previous one
    aside. A second process runs a training resume's recovery there (`recover_local`, rank 0): it must not put the
    aside copy back under the live writer (the writer's second rename then failed with ENOTEMPTY and the save was
    lost); it waits, and returns once the writer's commit is done."""
    path = tmp_path / "last.ckpt"
    _save_file(path, "step 1")
    between, go = threading.Event(), threading.Event()
    rename = os.rename

    def held(source: str, target: str) -> None:
        rename(source, target)
        if target.endswith(sharded_save.ASIDE_SUFFIX):
            between.set()
            assert go.wait(timeout=120)

    monkeypatch.setattr(sharded_save, "_exchange", lambda first, second: False)  # Lustre, EFS: EINVAL
    monkeypatch.setattr(os, "rename", held)
    writer = threading.Thread(target=_save_file, args=(path, "step 2"))
    writer.start()
    assert between.wait(timeout=60)
    started = tmp_path.parent / f"{tmp_path.name}-started"
    resume = _python(
        "import pathlib, time\n"
        "from lightning_trn.core.checkpoint.sharded_save import recover_all, recover_local\n"
        f"recover_all({str(tmp_path)!r})\n"  # one pass done before the test looks
        f"pathlib.Path({str(started)!r}).write_text('x')\n"
        f"recover_local([{str(tmp_path)!r}], 0, None, timeout_s=120)\n"
        "print('recovered')",
        tmp_path,
    )
    try:
        for _ in range(600):
            if started.exists() or resume.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert started.exists(), resume.communicate()[0]
        with pytest.raises(subprocess.TimeoutExpired):
            resume.wait(timeout=1)  # still waiting: the writer is alive
        assert not path.exists() and len(list(tmp_path.glob(".last.ckpt.*.old"))) == 1
    finally:
        go.set()
        writer.join(timeout=60)
    output, _ = resume.communicate(timeout=120)
    assert resume.returncode == 0 and "recovered" in output, output
    assert (path / "shard").read_text() == "step 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_dead_writers_interrupted_commit_is_put_back_by_another_process(tmp_path: Path) -> None:
    """The same state left by a process that is gone (its lease names a PID of this host that no longer runs):
    another process's recovery puts the previous checkpoint back at once."""
    path = tmp_path / "last.ckpt"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    record = leases.LeaseRecord("e" * 16, leases._host_key(), int(dead.stdout), "1", 0.0)
    (tmp_path / f".{leases.OWNER_TAG}-lease-{'e' * 16}").write_bytes(record.encode())
    aside = Path(sharded_save.aside_path(path, "e" * 16))
    aside.mkdir()
    (aside / "shard").write_text("step 1")
    resume = _python(
        "from lightning_trn.core.checkpoint.sharded_save import recover_local\n"
        f"recover_local([{str(tmp_path)!r}], 0, None)",
        tmp_path,
    )
    output, _ = resume.communicate(timeout=120)
    assert resume.returncode == 0, output
    assert (path / "shard").read_text() == "step 1" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


# S3: an evaluation job's load, and another job's resume, while a save is being uploaded


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    import boto3

    with moto_s3(BUCKET) as endpoint:
        s3_checkpoint._client_for.cache_clear()
        s3_checkpoint._batch_client_for.cache_clear()
        yield boto3.client("s3", endpoint_url=endpoint)
    s3_checkpoint._client_for.cache_clear()
    s3_checkpoint._batch_client_for.cache_clear()


def _keys(s3: Any, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def _upload(url: str, value: float) -> None:
    with installed(S3_CHECKPOINT_HOOKS), s3_checkpoint.staged_upload(url, 0, lambda o: o, lambda: None) as shadow:
        fabric_model_parallel._distributed_checkpoint_save({"w": torch.full((8,), value)}, Path(shadow))
        torch.save({"step": int(value)}, Path(shadow) / "meta.pt")


def _read(url: str) -> float:
    state = {"w": torch.zeros(8)}
    with installed(S3_CHECKPOINT_HOOKS), s3_checkpoint.committed_source(url, lambda o: o, lambda: None) as shadow:
        fabric_model_parallel._distributed_checkpoint_load(state, Path(shadow))
    return state["w"][0].item()


def test_a_user_prefix_and_a_stray_commit_object_in_s3_are_never_touched(s3: Any) -> None:
    directory = f"s3://{BUCKET}/users"
    user = {
        "users/notes/commit.json": b'{"version": 3}',
        "users/data/commit.json": b"not json",
        "users/data/00000000000000000001-0badc0de/rows.bin": b"rows",
        "users/last.ckpt.old": b"a user's object",
    }
    for key, data in user.items():
        s3.put_object(Bucket=BUCKET, Key=key, Body=data)
    _upload(f"{directory}/last.ckpt", 1.0)
    _upload(f"{directory}/last.ckpt", 2.0)
    s3_checkpoint.sweep(directory)
    s3_checkpoint.remove(f"{directory}/last.ckpt")
    s3_checkpoint.wait_for_deletions()
    assert s3_checkpoint.newest_committed([directory]) is None
    assert {key: s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() for key in user} == user
    assert _keys(s3, "users/") == sorted(user)


def test_a_writers_own_sweep_never_deletes_the_version_it_is_writing(s3: Any) -> None:
    """A save starts with a sweep of its checkpoint, in the background, while it writes its new version: this
    process's lease there is held, so that version is not taken for one of its own abandoned ones."""
    url = f"s3://{BUCKET}/own/last.ckpt"
    _upload(url, 1.0)
    with installed(S3_CHECKPOINT_HOOKS), s3_checkpoint.staged_upload(url, 0, lambda o: o, lambda: None) as shadow:
        fabric_model_parallel._distributed_checkpoint_save({"w": torch.full((8,), 2.0)}, Path(shadow))
        torch.save({"step": 2}, Path(shadow) / "meta.pt")
        s3_checkpoint.wait_for_deletions()
        s3_checkpoint.discard_uncommitted(url)
    assert _read(url) == 2.0


_JOB = """
import lightning.pytorch as pl, torch
from lightning.pytorch.callbacks import ModelCheckpoint
import lightning_trn
from tests.scripts.sharded_save_train import Net, dataset
class Evaluated(Net):
    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)
def trainer(**kwargs):
    return pl.Trainer(accelerator="neuron", devices=1, strategy="fsdp", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)
data = torch.utils.data.DataLoader(dataset(), batch_size=8)
"""
_FIT = (
    _JOB
    + """
trainer(max_steps=2, callbacks=[ModelCheckpoint(dirpath={directory!r}, save_last=True)]).fit(Evaluated(), data)
"""
)
_EVALUATE = (
    _JOB
    + """
trainer().validate(Evaluated(), data, ckpt_path={url!r})
print("evaluated")
"""
)
_SWEEP = """
from lightning_trn.core.checkpoint import s3_checkpoint
s3_checkpoint.sweep({directory!r})  # what another job's training resume runs first
print("swept")
"""


def _dead_lease() -> bytes:
    """The lease record of a writer on this host whose process is gone."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return leases.LeaseRecord("e" * 16, leases._host_key(), int(gone.stdout), "1", 0.0).encode()


def _run(code: str, cwd: Path, says: str) -> None:
    process = _python(code, cwd)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0 and says in output, output[-3000:]


@pytest.mark.slow
def test_an_evaluation_job_and_another_resume_never_delete_a_save_being_uploaded(s3: Any, tmp_path: Path) -> None:
    """A Trainer job's `last.ckpt` (1-device FSDP) in S3, beside the version of a save whose writer died; this
    process uploads the next version and is held before the commit object. A second process runs
    `trainer.validate(ckpt_path=last.ckpt)`: it only reads (the dead writer's version is still there); a third runs a
    training resume's sweep: it deletes the dead writer's version and leaves the live one. Once this process commits
    its version, it loads (before: the evaluation's sweep deleted it, the commit then named a gutted version and
    discarded the previous one)."""
    directory = f"s3://{BUCKET}/job"
    url = f"{directory}/last.ckpt"
    _run(_FIT.format(directory=directory), tmp_path, "")
    committed = s3_checkpoint.committed_version(url)
    assert committed is not None
    dead = f"job/last.ckpt/{s3_checkpoint.new_version()}"
    with installed(S3_CHECKPOINT_HOOKS), s3_checkpoint.staged_upload(url, 0, lambda o: o, lambda: None) as shadow:
        s3_checkpoint.wait_for_deletions()  # this save's own sweep of its checkpoint, which would take the dead one
        s3.put_object(Bucket=BUCKET, Key=f"{dead}/{s3_checkpoint.LEASE_OBJECT}", Body=_dead_lease())
        s3.put_object(Bucket=BUCKET, Key=f"{dead}/__0_0.distcp", Body=b"a killed save's shard")
        fabric_model_parallel._distributed_checkpoint_save({"w": torch.full((8,), 7.0)}, Path(shadow))
        torch.save({"step": 7}, Path(shadow) / "meta.pt")
        _run(_EVALUATE.format(url=url), tmp_path, "evaluated")
        assert len(_keys(s3, f"{dead}/")) == 2  # the evaluation changed nothing
        _run(_SWEEP.format(directory=directory), tmp_path, "swept")
        assert _keys(s3, f"{dead}/") == []  # a dead writer's version goes
        assert s3_checkpoint.committed_version(url) == committed
    assert _read(url) == 7.0


_LEASE_HOLDER = """
import sys, time
from lightning_trn.core.checkpoint import leases, sharded_save
leases._host_key = lambda: "another-host:another-boot"  # a writer on another node of the cluster
leases.RENEW_S = 0.2
with sharded_save._lease({directory!r}):
    print("holding", leases.writer().id, flush=True)
    time.sleep(600)
"""


def test_a_writer_on_another_host_is_live_while_its_heartbeat_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second process holds a lease as a writer on another node (its host key differs: its PID means nothing
    here), renewing it every 0.2 s. Its entries stay live while its heartbeat runs, longer than the expiry; once it
    is killed, they count as gone after `EXPIRY_S` (1 s here)."""
    monkeypatch.setattr(leases, "EXPIRY_S", 1.0)
    holder = _python(_LEASE_HOLDER.format(directory=str(tmp_path)), tmp_path)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line.startswith("holding"), line + holder.stdout.read()
        writer = line.split()[1]
        threading.Event().wait(2.5)  # past the expiry: only renewals keep it live
        assert not sharded_save._writer_gone(str(tmp_path), writer)
    finally:
        holder.kill()
        holder.communicate(timeout=60)
    threading.Event().wait(1.5)
    assert sharded_save._writer_gone(str(tmp_path), writer)


# asynchronous saves


def test_the_background_writes_group_has_the_strategys_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `new_group(backend="gloo")`, the 30-minute default, whatever the strategy's `timeout`."""
    made: list[dict[str, Any]] = []
    new_group = dist.new_group
    monkeypatch.setattr(
        async_save.dist, "new_group", lambda *args, **kwargs: made.append(kwargs) or new_group(*args, **kwargs)
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        saver = AsyncCheckpointer(timeout=timedelta(seconds=42))
        with sharded_save.staged_directory(tmp_path / "c.ckpt", 0, lambda: None, lambda o: o, saver.defer) as staging:
            saver.save({"w": torch.ones(2)}, staging)
        saver.wait()
    finally:
        dist.destroy_process_group()
    assert made == [{"backend": "gloo", "timeout": timedelta(seconds=42)}]


@pytest.mark.slow
def test_a_commit_that_fails_on_rank_0_stops_every_rank_with_its_error(tmp_path: Path) -> None:
    """2-rank asynchronous FSDP saves (Fabric); rank 0's commit fails (a rename refused). Both ranks raise the
    error at the next save, naming rank 0's failure; before, rank 1 waited in that save's barrier until the
    process group's timeout."""
    run_job(SCRIPTS / "async_save_failure.py", tmp_path, "--out", str(tmp_path), env=child_env(), timeout=300)
    for rank in (0, 1):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert said.startswith("WriteFailedError") and "rank 0: PermissionError" in said, said


# S3 deletions: batched, after the save has returned


def test_s3_deletions_are_batched_and_off_the_saves_critical_path(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{BUCKET}/batched/last.ckpt"
    _upload(url, 1.0)
    s3_checkpoint.wait_for_deletions()
    first = s3_checkpoint.committed_version(url)
    requests: list[int] = []
    delete_keys = s3_checkpoint.delete_keys
    monkeypatch.setattr(
        s3_checkpoint, "delete_keys", lambda bucket, keys: requests.append(len(keys)) or delete_keys(bucket, keys)
    )
    single: list[str] = []
    delete = s3_checkpoint._delete
    monkeypatch.setattr(s3_checkpoint, "_delete", lambda bucket, key: single.append(key) or delete(bucket, key))
    hold = threading.Event()
    s3_checkpoint._background.submit(hold.wait, 60)  # the background deleter is busy
    try:
        _upload(url, 2.0)  # returns although the previous version's deletion has not run
        assert [key for key in _keys(s3, "batched/") if first in key]
        assert _read(url) == 2.0
    finally:
        hold.set()
    s3_checkpoint.wait_for_deletions()
    assert not [key for key in _keys(s3, "batched/") if first in key]
    assert requests == [3]  # the previous version's `.metadata`, shard and `meta.pt`: one DeleteObjects
    assert len(single) == 1 and single[0].endswith(s3_checkpoint.LEASE_OBJECT)  # the save's own lease, released


def test_a_writer_counts_as_live_until_proven_gone() -> None:
    """On this host by its process (gone at once when its PID no longer runs the process that wrote the record); on
    another host by the record's age against `EXPIRY_S`; a file that is no lease record of ours is none."""
    me = leases.writer().record()
    assert leases.is_live(me)
    assert not leases.is_live(leases.LeaseRecord(me.writer, me.host, me.pid, "0", me.renewed))  # PID reused
    other = leases.LeaseRecord("f" * 16, "another-host:boot", 1, "1", 1_000.0)
    assert leases.is_live(other, now=1_000.0 + leases.EXPIRY_S - 1)
    assert not leases.is_live(other, now=1_000.0 + leases.EXPIRY_S + 1)
    assert leases.LeaseRecord.decode(me.encode()) == me
    assert leases.LeaseRecord.decode(b'{"writer": "x"}') is None and leases.LeaseRecord.decode(b"SECRET=1") is None
