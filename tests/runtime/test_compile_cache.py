"""NeuronCompileCache on XLA:CPU: reuse across processes, per-flags namespaces, S3 sharing against a real S3 API
(a moto server on 127.0.0.1), and every failure mode degrading to a warning while training goes on."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import boto3
import pytest

from lightning_trn.pytorch.callbacks import NeuronCompileCache
from lightning_trn.pytorch.callbacks.compile_cache.archive import (
    archive_name,
    extract_archive,
    list_entries,
    pack_entries,
)
from tests.s3_server import SECRET, moto_s3

pytestmark = pytest.mark.xla_only

PROJECT_ROOT = Path(__file__).resolve().parents[2]
BUCKET = "compile-cache"

#: a short fit in a fresh process; prints the persistent-cache counters as JSON on a RESULT line
TRAIN_SCRIPT = r"""
import json, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
import lightning_trn
from lightning_trn.pytorch.callbacks import NeuronCompileCache, NeuronCompilerFlags
from lightning_trn.runtime import get_runtime

opts = json.loads(sys.argv[1])

class Model(BoringModel):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 32)), batch_size=8)
    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)

if opts.get("compile_first"):
    x = torch.ones(3, device=get_runtime().device()) * 2
    get_runtime().sync()
    print("early value", x.sum().item())
cache = NeuronCompileCache(opts["url"], local_dir=opts.get("local_dir"), endpoint_url=opts.get("endpoint"),
                           connect_timeout=1, max_attempts=1)
flags = NeuronCompilerFlags(optlevel=opts.get("optlevel", 2))
if opts.get("enable_early"):  # flags first: they name the cache namespace
    flags.apply()
    cache.enable()
trainer = Trainer(accelerator="neuron", max_steps=4, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[cache, flags])
trainer.fit(Model())
print("RESULT " + json.dumps({"cache": get_runtime().compile_cache_counters(), "dir": cache.cache_dir,
                              "global_step": trainer.global_step}))
"""


def run_training(tmp_path: Path, **opts: object) -> tuple[dict, str]:
    """Run TRAIN_SCRIPT in a fresh interpreter; returns its RESULT record and its stderr."""
    script = tmp_path / "train_script.py"
    script.write_text(TRAIN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "NEURON_"))}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=str(PROJECT_ROOT))
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(opts)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), proc.stderr


@pytest.fixture(scope="module")
def s3_endpoint():
    """A real S3 API (moto's server) on a free local port, with one empty bucket."""
    with moto_s3(BUCKET) as endpoint:
        yield endpoint


def s3_keys(endpoint: str, prefix: str) -> list[str]:
    listing = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return [item["Key"] for item in listing.get("Contents", [])]


def put_archive(endpoint: str, key: str, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=BUCKET, Key=key, Body=buffer.getvalue())


def file_member(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def link_member(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def test_s3_push_then_pull_into_fresh_dir_reuses_every_graph_and_other_flags_do_not(tmp_path, s3_endpoint):
    url = f"s3://{BUCKET}/team/run"
    first, _ = run_training(tmp_path, url=url, local_dir=str(tmp_path / "node-a"), endpoint=s3_endpoint)
    assert first["cache"]["misses"] > 0 and first["global_step"] == 4
    keys = s3_keys(s3_endpoint, "team/run/")
    assert len(keys) == 1 and keys[0].endswith(".tar.gz")
    written = list_entries(str(tmp_path / "node-a"))
    assert len(written) == first["cache"]["misses"]

    # another machine: empty local cache, pulls the archive, and the cache was enabled before the Trainer existed
    second, _ = run_training(
        tmp_path, url=url, local_dir=str(tmp_path / "node-b"), endpoint=s3_endpoint, enable_early=True
    )
    found = second["cache"]["hits"] + second["cache"]["unloadable"]
    assert second["cache"]["misses"] == 0
    assert found == first["cache"]["misses"]
    assert list_entries(str(tmp_path / "node-b")) == written  # nothing new compiled into the cache
    assert s3_keys(s3_endpoint, "team/run/") == keys  # and so nothing new pushed

    # other compiler flags: a separate namespace, nothing reused
    third, _ = run_training(tmp_path, url=url, local_dir=str(tmp_path / "node-b"), endpoint=s3_endpoint, optlevel=1)
    assert third["dir"] != second["dir"]
    assert third["cache"]["misses"] == first["cache"]["misses"]
    assert third["cache"]["hits"] + third["cache"]["unloadable"] == 0


def test_unreachable_bucket_and_late_cache_warn_and_training_goes_on(tmp_path, s3_endpoint):
    result, stderr = run_training(
        tmp_path,
        url=f"s3://{BUCKET}/x",
        local_dir=str(tmp_path / "cache"),
        endpoint="http://127.0.0.1:9",
        compile_first=True,
    )
    assert result["global_step"] == 4
    assert "could not list s3://compile-cache/x (EndpointConnectionError" in stderr
    assert "training goes on" in stderr and SECRET not in stderr
    assert "could not enable the compile cache" in stderr and "already compiled" in stderr
    assert result["dir"] is None
    assert list_entries(str(tmp_path / "cache")) == {}


def test_local_directory_cache_is_namespaced_by_compiler_flags(tmp_path, monkeypatch):
    cache = NeuronCompileCache(str(tmp_path / "cache"))
    monkeypatch.setenv("NEURON_CC_FLAGS", "-O1 --model-type transformer")
    one = cache.resolve_cache_dir()
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer --optlevel=1")
    assert cache.resolve_cache_dir() == one  # same flags, other spelling and order
    monkeypatch.setenv("NEURON_CC_FLAGS", "--optlevel=2 --model-type=transformer")
    assert cache.resolve_cache_dir() != one
    assert os.path.dirname(one) == str(tmp_path / "cache")


def test_missing_credentials_warn_without_leaking_secrets(tmp_path, s3_endpoint, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    cache = NeuronCompileCache(
        f"s3://{BUCKET}/p", local_dir=str(tmp_path / "c"), endpoint_url=s3_endpoint, connect_timeout=1, max_attempts=1
    )
    with pytest.warns(UserWarning, match="NoCredentialsError.*training goes on"):
        assert cache.pull() == 0


def test_bad_archives_are_refused_and_good_ones_still_pulled(tmp_path, s3_endpoint):
    prefix = "bad"
    put_archive(s3_endpoint, f"{prefix}/1-traversal.tar.gz", [(file_member("../evil"), b"x")])
    put_archive(s3_endpoint, f"{prefix}/2-symlink.tar.gz", [(link_member("link", "/etc/passwd"), b"")])
    put_archive(s3_endpoint, f"{prefix}/3-hardlink.tar.gz", [(link_member("hard", "../../x", tarfile.LNKTYPE), b"")])
    put_archive(s3_endpoint, f"{prefix}/4-absolute.tar.gz", [(file_member("/tmp/evil-abs"), b"x")])
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(
        Bucket=BUCKET, Key=f"{prefix}/5-corrupt.tar.gz", Body=b"\x1f\x8b this is not gzip"
    )
    put_archive(s3_endpoint, f"{prefix}/6-good.tar.gz", [(file_member("xla-cpu-flags-0/graph"), b"compiled")])

    local = tmp_path / "root" / "cache"
    cache = NeuronCompileCache(f"s3://{BUCKET}/{prefix}", local_dir=str(local), endpoint_url=s3_endpoint)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.pull() == 1
    messages = [str(w.message) for w in caught]
    skipped = [m for m in messages if "skipped archive" in m]
    assert len(skipped) == 5, messages
    assert any("UnsafeArchiveError" in m and "../evil" in m for m in skipped)
    assert any("UnsafeArchiveError" in m and "'link'" in m for m in skipped)
    assert any("5-corrupt" in m for m in skipped)
    assert not (tmp_path / "root" / "evil").exists() and not Path("/tmp/evil-abs").exists()
    assert list_entries(str(local)) == {"xla-cpu-flags-0/graph": 8}
    assert not any(SECRET in m for m in messages)


def test_pack_and_extract_round_trip_only_named_regular_files(tmp_path):
    source = tmp_path / "src"
    (source / "ns").mkdir(parents=True)
    (source / "ns" / "a").write_bytes(b"aaa")
    (source / "ns" / "b").write_bytes(b"bb")
    (source / "ns" / "link").symlink_to("/etc/passwd")
    assert list_entries(str(source)) == {"ns/a": 3, "ns/b": 2}
    archive = tmp_path / archive_name(["ns/a"])
    pack_entries(str(source), ["ns/a"], str(archive))
    assert extract_archive(str(archive), str(tmp_path / "dst")) == 1
    assert (tmp_path / "dst" / "ns" / "a").read_bytes() == b"aaa"
    assert archive_name(["ns/a", "ns/b"]) == archive_name(["ns/b", "ns/a"]) != archive_name(["ns/a"])


def test_messages_are_scrubbed_of_credentials(monkeypatch):
    from lightning_trn.pytorch.callbacks.compile_cache.s3_store import redact

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token-123")
    assert redact(f"signature for {SECRET} with session-token-123 failed") == "signature for *** with *** failed"


def test_on_neuron_the_compiler_cache_url_is_set_until_something_compiled(tmp_path, monkeypatch):
    """No Trainium here: the platform and the compile counter are faked at the runtime boundary."""
    from lightning_trn.runtime import RuntimeMetrics, get_runtime
    from lightning_trn.runtime.discovery import NEURON, Platform

    runtime = get_runtime()
    monkeypatch.setattr(runtime, "_platform", Platform(NEURON, 2, "faked"))
    monkeypatch.setattr(runtime, "metrics", lambda: RuntimeMetrics(compiles=0))
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--optlevel=1")
    cache = NeuronCompileCache(str(tmp_path / "neuron-cache"))
    assert cache.resolve_cache_dir() == str(tmp_path / "neuron-cache")  # Neuron's key holds the flags already
    assert cache.enable()
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == str(tmp_path / "neuron-cache")

    monkeypatch.setattr(runtime, "metrics", lambda: RuntimeMetrics(compiles=3))
    late = NeuronCompileCache(str(tmp_path / "other"))
    with pytest.warns(UserWarning, match="could not enable the compile cache.*already compiled"):
        assert not late.enable()
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == str(tmp_path / "neuron-cache")
