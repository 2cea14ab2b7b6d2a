"""A recipe run as users run it, `python -m lightning_trn.recipes.<name> key=value ...` in a child process, on either
backend (the caller's environment picks it), and what the finished run left: its last checkpoint, its logged
evaluation metrics and its printed held-out line. Shared by the strategy and restart tests of both suites."""

from __future__ import annotations

import contextlib
import csv
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from tests.tolerance import assert_losses_match, assert_weights_match, losses_error, weights_error

#: a 32-wide LLM on 32-token blocks, 6 steps: seconds of training, most of a run is imports (and compiling, on XLA)
TINY_LLM = (
    "data.seq_len=32",
    "data.vocab_size=512",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.warmup_steps=2",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=6",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
)
#: 20 steps, a checkpoint every 5: a kill after the first checkpoint lands mid-epoch with steps to spare
RESUMABLE_STEPS = 20
RESUMABLE = (f"trainer.limit_train_batches={RESUMABLE_STEPS}", "ckpt_every_n_steps=5")
RUN_TIMEOUT_S = 300


def start(recipe: str, out: Path, *overrides: str, env: dict[str, str], **kwargs: Any) -> subprocess.Popen:
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", f"lightning_trn.recipes.{recipe}", f"out_dir={out}", *overrides]
    return subprocess.Popen(
        command, env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )


def finish(proc: subprocess.Popen, out: Path, metrics: tuple[str, ...] = ("val_loss", "test_loss")) -> dict:
    """The finished run's last checkpoint, its logged `metrics` and its held-out line."""
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    line = next(line for line in stdout.splitlines() if "held-out test" in line)
    return {**left_behind(out, metrics), "line": line, "stderr": stderr}


def left_behind(out: Path, metrics: tuple[str, ...] = ("val_loss", "test_loss")) -> dict:
    """What a finished run in `out` left: its last checkpoint (`ckpt`) and its logged `metrics`."""
    with open(out / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {
        # a file, or a sharded strategy's directory consolidated
        "ckpt": NeuronCheckpointIO().load_checkpoint(out / "checkpoints" / "last.ckpt"),
        "metrics": {key: [float(row[key]) for row in rows if row.get(key)] for key in metrics},
    }


def run(recipe: str, out: Path, *overrides: str, env: dict[str, str], **kwargs: Any) -> dict:
    return finish(start(recipe, out, *overrides, env=env), out, **kwargs)


#: the float64 twin of a one-device recipe run that reads the data without a `DistributedSampler` (tests/tolerance.py):
#: Lightning's own `64-true` on the CPU (the neuron accelerator takes 32-true, bf16-mixed and bf16-true only); the
#: overrides come last, so they win
FLOAT64_ON_CPU = ("trainer.accelerator=cpu", "trainer.devices=1", "trainer.precision=64-true")
#: the same for a one-device run under a strategy that injects Lightning's shuffling `DistributedSampler`
#: (`neuron_ddp`, `model_parallel`): DDP on one CPU device injects the same one
FLOAT64 = (*FLOAT64_ON_CPU, "trainer.strategy=ddp")


def assert_ends_alike(run_: dict, reference: dict, reference64: dict, trained_below: float | None = 6.2) -> None:
    """Same steps and LR schedule, weights and evaluation losses within the tolerance tests/tolerance.py derives from
    the reference's own float32 error (`reference64`: its FLOAT64 twin), and a reference trained to a validation
    loss under `trained_below` (equality with an untrained model would say nothing)."""
    assert run_["ckpt"]["global_step"] == reference["ckpt"]["global_step"] == reference64["ckpt"]["global_step"]
    assert run_["ckpt"]["lr_schedulers"] == reference["ckpt"]["lr_schedulers"]
    weights, exact = reference["ckpt"]["state_dict"], reference64["ckpt"]["state_dict"]
    assert_weights_match(run_["ckpt"]["state_dict"], weights, weights_error(weights, exact))
    for key, values in reference["metrics"].items():
        assert len(run_["metrics"][key]) == len(values) == 1, (key, run_["metrics"])
    # one number per split is one sample of the reference's error (it can be 0 by chance): E is the largest over
    # the splits' losses; a perplexity is its loss's exponential, so it is compared as its logarithm, in loss units
    losses = [key for key in reference["metrics"] if key.endswith("_loss")]
    error = max(losses_error(reference["metrics"][key], reference64["metrics"][key]) for key in losses)
    for key, values in reference["metrics"].items():
        ours = run_["metrics"][key]
        if key.endswith("_ppl"):
            ours, values = [math.log(value) for value in ours], [math.log(value) for value in values]
        assert_losses_match(ours, values, error, what=key)
    if trained_below is not None:
        assert reference["metrics"]["val_loss"][0] < trained_below


def kill_after_first_checkpoint(recipe: str, out: Path, *overrides: str, env: dict[str, str]) -> Path:
    """Start the job, SIGKILL its process group as soon as `last.ckpt` exists, and return that mid-epoch checkpoint
    (fails the test if the job ended first or the checkpoint is not mid-epoch)."""
    ckpt = out / "checkpoints" / "last.ckpt"
    proc = start(recipe, out, *overrides, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if proc.returncode != -signal.SIGKILL:
        pytest.fail(f"the run ended before the kill (exit {proc.returncode}): nothing was tested")
    stopped = NeuronCheckpointIO().load_checkpoint(ckpt)  # a file, or a sharded strategy's directory
    assert stopped["epoch"] == 0 and 0 < stopped["global_step"] < RESUMABLE_STEPS, (
        "not mid-epoch",
        stopped["global_step"],
    )
    return ckpt


def assert_ends_identically(resumed: dict, expected: dict) -> None:
    """Bitwise the uninterrupted job's end: held-out line, logged metrics, weights, optimizer and LR-scheduler
    state; and the restart did not warn that it could not resume exactly."""
    assert "not exact" not in resumed["stderr"]
    assert (resumed["line"], resumed["metrics"]) == (expected["line"], expected["metrics"])
    saved, reference = resumed["ckpt"], expected["ckpt"]
    assert saved["global_step"] == reference["global_step"]
    assert saved["lr_schedulers"] == reference["lr_schedulers"]
    for name, value in reference["state_dict"].items():
        assert torch.equal(saved["state_dict"][name], value), name
    for index, state in reference["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            assert torch.equal(saved["optimizer_states"][0]["state"][index][key], value), (index, key)


def export_checkpoint(recipe: str, checkpoint: Path, out: Path, env: dict[str, str]) -> None:
    """`python -m lightning_trn.recipes.<recipe> export ckpt=... out=...`, which must succeed."""
    command = [sys.executable, "-m", f"lightning_trn.recipes.{recipe}", "export", f"ckpt={checkpoint}", f"out={out}"]
    export = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr[-2000:]


def run_without_standin(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -c code args` in a process where the stand-in is never loaded: what a GPU/CPU user of a checkpoint or
    an export has."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_TRN_STANDIN")}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
