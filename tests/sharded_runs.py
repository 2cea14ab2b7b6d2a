"""Runs of tests/scripts/sharded_save_train.py for the sharded-checkpoint tests (tests/checkpoint/test_sharded_save.py
on ZeRO-1, tests/checkpoint/test_sharded_save_dcp.py on DCP), and the check of what a killed run left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_trn.core.checkpoint import sharded_save
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from tests import launch
from tests.launch import child_env, free_port

SCRIPT = Path(__file__).parent / "scripts" / "sharded_save_train.py"
RUN_TIMEOUT_S = 240
#: the worker's training steps (one checkpoint `step=<k>.ckpt` and one `last.ckpt` save per step)
STEPS = 5


def run_job(out: Path, kind: str, *args: str, killed: bool = False, script: Path = SCRIPT) -> Path:
    """Run the 2-rank job (`script`, by default the worker of the module docstring); return its checkpoint directory.
    `killed`: the job must end by its own SIGKILL (`tests.launch.run_job`)."""
    launch.run_job(
        script, out, "--out", str(out), "--kind", kind, *args, env=child_env(), killed=killed, timeout=RUN_TIMEOUT_S
    )
    return out / "ckpts"


def run_two_nodes(out: Path, kind: str, node_1_prefix: list[str]) -> list[tuple[int, str]]:
    """Run the job as two torchrun "nodes" on this machine, one rank each, node 1's launch after `node_1_prefix` (a
    command that runs the rest of its arguments, e.g. in a mount namespace of its own); each node's exit code and
    output."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    nodes = []
    for rank, prefix in enumerate(([], node_1_prefix)):
        command = [
            *prefix,
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={rank}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(SCRIPT),
            "--out",
            str(out),
            "--kind",
            kind,
            "--num-nodes",
            "2",
        ]
        nodes.append(
            subprocess.Popen(
                command,
                env=child_env(),
                cwd=out,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    try:
        outputs = [node.communicate(timeout=RUN_TIMEOUT_S)[0] for node in nodes]
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):  # kill its agent's workers, if any is left
                os.killpg(node.pid, signal.SIGKILL)
    return [(node.returncode, output) for node, output in zip(nodes, outputs, strict=True)]


def can_exchange(directory: Path) -> bool:
    """Whether `directory`'s filesystem swaps two directories in one step (the commit without a window)."""
    probe = [directory / ".exchange_a", directory / ".exchange_b"]
    for path in probe:
        path.mkdir(parents=True)
    try:
        return sharded_save._exchange(str(probe[0]), str(probe[1]))
    finally:
        for path in probe:
            path.rmdir()


def load(path: Path) -> dict[str, Any]:
    """A sharded checkpoint directory, consolidated (what a resume or `python -m lightning_trn.consolidate` reads)."""
    return NeuronCheckpointIO().load_checkpoint(path)


def _assert_equal(value: Any, expected: Any, where: str) -> None:
    if isinstance(expected, dict):
        assert isinstance(value, dict) and value.keys() == expected.keys(), where
        for key in expected:
            _assert_equal(value[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(value) == len(expected), where
        for index, (item, wanted) in enumerate(zip(value, expected, strict=True)):
            _assert_equal(item, wanted, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(value, expected), f"{where} differs from the uninterrupted run's at that step"
    else:
        assert value == expected, where


def assert_checkpoints_match_reference(ckpts: Path, reference: Path) -> dict[str, int]:
    """Every checkpoint the run left (each `*.ckpt`: what `ModelCheckpoint` and `ckpt_path="last"` can pick) loads,
    and its weights and optimizer state equal the uninterrupted run's at the step it claims, exactly: never a mix of
    two saves. Returns each checkpoint's step."""
    steps = {}
    for path in sorted(p for p in ckpts.iterdir() if p.name.endswith(".ckpt")):
        checkpoint = load(path)
        step = checkpoint["global_step"]
        expected = load(reference / f"step={step}.ckpt")
        for key in ("state_dict", "optimizer_states"):
            _assert_equal(checkpoint[key], expected[key], f"{path.name}: {key}")
        steps[path.name] = step
    return steps


def kill_inside_a_save(out: Path, reference: Path, kind: str, kill: str, *args: str) -> dict[str, int]:
    """Run the `kind` job (with the worker's `args`) until its SIGKILL at `kill` (`<save>:<rank>:<point>`, see the
    worker script); check what it left against the uninterrupted run (`assert_checkpoints_match_reference`); returns
    each checkpoint's step."""
    ckpts = run_job(out, kind, "--kill", kill, *args, killed=True)
    return assert_checkpoints_match_reference(ckpts, reference)


def resume_to_the_end(out: Path, reference: Path, kind: str, *args: str, from_step: int | None = None) -> None:
    """Restart a killed `kind` job with `ckpt_path="last"` (and the worker's `args`): it starts at `from_step` (if
    given: a resume, not a fresh start), reaches the last step, and every checkpoint equals the uninterrupted run's at
    its step."""
    ckpts = run_job(out, kind, "--resume", "last", *args)
    if from_step is not None:
        started = int((out / "start_step").read_text())
        assert started == from_step, f"the resumed run started at step {started}, not at its checkpoint's {from_step}"
    assert load(ckpts / "last.ckpt")["global_step"] == STEPS
    assert_checkpoints_match_reference(ckpts, reference)
