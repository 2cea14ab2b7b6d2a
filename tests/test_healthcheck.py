"""The health check (docs/operations.md): `python -m lightning_trn.healthcheck` on 1 and 2 processes (self-launched and
under torchrun), a rank made to return a wrong result or to hang at the device boundary
(`tests/scripts/faulty_healthcheck.py`), and the `NeuronHealthCheck` callback stopping `fit` before its first step."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import child_env
from lightning.pytorch import Trainer
from models import RegressionModel, regression_loader
from test_ddp_training import _torchrun

from lightning_trn import NeuronHealthCheck
from lightning_trn.healthcheck import EXIT_HUNG, HealthCheckError
from lightning_trn.healthcheck.__main__ import _launch_defaults

pytestmark = pytest.mark.both

FAULTY = Path(__file__).parent / "scripts" / "faulty_healthcheck.py"
#: a 2-process check (interpreters starting, a few small graphs compiled) ends well within this
TIMEOUT_S = 150


def _check(tmp_path: Path, *command: str, timeout: float = 20, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "report.json"
    args = [*command, "--size-mb", "1", "--iters", "2", "--timeout", str(timeout), "--json", str(report)]
    result = subprocess.run(args, env=child_env(**env), cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    return result, json.loads(report.read_text()) if report.exists() else {}


def test_one_process_passes_and_reports_versions(tmp_path: Path):
    result, report = _check(tmp_path, sys.executable, "-m", "lightning_trn.healthcheck")
    assert result.returncode == 0, result.stderr[-3000:]
    assert report["world_size"] == 1 and report["collectives"] == {}
    (rank,) = report["ranks"]
    assert rank["ok"] and rank["rank"] == 0 and rank["figures"]["host->device GB/s"] > 0
    assert report["versions"]["torch"] == importlib.metadata.version("torch")
    assert "all checks passed" in result.stdout and "collectives: skipped (1 process)" in result.stdout


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_two_processes_pass_with_collective_figures(tmp_path: Path, launcher: str):
    if launcher == "python":
        command = [sys.executable, "-m", "lightning_trn.healthcheck", "--devices", "2"]
    else:
        command = [*_torchrun(nproc=2), "-m", "lightning_trn.healthcheck"]
    result, report = _check(tmp_path, *command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert report["world_size"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1] and all(r["ok"] for r in report["ranks"])
    assert report["collectives"]["all-reduce bus GB/s"] > 0


def test_a_rank_with_a_wrong_result_is_named_and_the_job_fails(tmp_path: Path):
    result, report = _check(tmp_path, sys.executable, str(FAULTY), "--devices", "2", FAULT="wrong", FAULT_RANK="1")
    assert result.returncode != 0 and report == {}  # 1, or SIGKILL from Lightning's launcher once rank 1 exited
    assert "health check failed the device op on 1 of 2 rank(s): rank 1 (host " in result.stderr, result.stderr[-3000:]
    assert "rank 0 (host" not in result.stderr


def test_a_hung_rank_is_named_after_the_timeout_and_nothing_hangs(tmp_path: Path):
    """Rank 0 names rank 1 after the timeout; rank 1, stuck in its device call, ends itself after twice that (the
    run returning at all, within `TIMEOUT_S`, is the "nothing hangs")."""
    result, _ = _check(tmp_path, sys.executable, str(FAULTY), "--devices", "2", timeout=5, FAULT="hang", FAULT_RANK="1")
    assert result.returncode != 0, result.stderr[-3000:]
    assert "[rank 0] lightning_trn health check: rank 1 (host " in result.stderr, result.stderr[-3000:]
    assert "did not finish the device op within 5 s" in result.stderr
    assert "within 10 s on rank 1 (host " in result.stderr and "rank 1 (host " in result.stderr
    assert f"Ending this process (exit code {EXIT_HUNG})" in result.stderr


def test_launch_defaults_follow_torchrun_and_slurm():
    assert _launch_defaults({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}) == ("4", 2)
    assert _launch_defaults({"SLURM_NTASKS_PER_NODE": "32(x2)", "SLURM_NNODES": "2"}) == ("32", 2)
    assert _launch_defaults({}) == ("auto", 1)


class Counted(RegressionModel):
    steps = 0

    def training_step(self, batch, batch_idx):
        Counted.steps += 1
        return super().training_step(batch, batch_idx)


def _fit_with_health_check(tmp_path: Path) -> tuple[Trainer, NeuronHealthCheck]:
    check = NeuronHealthCheck(size_mb=1)
    trainer = Trainer(
        accelerator="neuron",
        devices=1,
        max_steps=2,
        callbacks=[check],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    Counted.steps = 0
    trainer.fit(Counted(), regression_loader(n=64))
    return trainer, check


def test_callback_checks_before_training(tmp_path: Path):
    trainer, check = _fit_with_health_check(tmp_path)
    assert check.report is not None and check.report.ranks[0].ok and trainer.global_step == 2


def test_callback_stops_fit_before_the_first_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    matmul = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: matmul(a, b) + (a.device.type != "cpu"))
    with pytest.raises(HealthCheckError, match=r"failed the device op on 1 of 1 rank\(s\): rank 0 \(host .*\)"):
        _fit_with_health_check(tmp_path)
    assert Counted.steps == 0


def test_versions_and_core_names_come_from_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from lightning_trn.runtime import discovery, get_runtime

    driver, library = tmp_path / "version", tmp_path / "libnrt.so.2.28.19.0"
    driver.write_text("2.24.7.0\n")
    library.write_text("")
    (tmp_path / "libnrt.so.1").symlink_to(library)
    monkeypatch.setattr(discovery, "DRIVER_VERSION_FILE", str(driver))
    monkeypatch.setattr(discovery, "RUNTIME_LIBRARY", str(tmp_path / "libnrt.so.1"))
    versions = get_runtime().versions()
    assert versions["neuron driver"] == "2.24.7.0" and versions["neuron runtime"] == "libnrt.so.2.28.19.0"
    assert versions["lightning"] == importlib.metadata.version("lightning")

    runtime = get_runtime()
    assert runtime.core_label(runtime.device()) == f"{runtime.device()} on {runtime.cpu_platform}"
    monkeypatch.setattr(type(runtime), "on_neuron", lambda self: True)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "5")
    assert runtime.core_label(torch.device(runtime.device_type, 0)).startswith("NeuronCore 5 (")


def test_ranks_with_different_software_are_named():
    from lightning_trn.healthcheck import RankReport, _check_versions

    same = {"torch": "2.9.0", "neuron driver": "2.24.7.0"}
    ranks = [
        RankReport(0, "a", "core 0", versions=same),
        RankReport(1, "a", "core 1", versions=dict(same)),
        RankReport(2, "b", "core 0", versions={**same, "neuron driver": "2.22.1.0"}),
    ]
    _check_versions(ranks[:2])
    with pytest.raises(
        HealthCheckError,
        match=r"rank 2 \(host b, core 0\): neuron driver 2\.22\.1\.0 \(rank 0: "
        r"2\.24\.7\.0\)",
    ):
        _check_versions(ranks)
