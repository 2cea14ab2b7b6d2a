"""The environment tests start child jobs in: this one minus launcher variables (ranks, world size, port) that an
in-process launch earlier in the session may have left, so each child job sets its own; and `run_job`, a job run to
its end or to its own SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """`os.environ` without launcher and `PL_` variables, on XLA:CPU, with the project importable, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARIABLES and not k.startswith(("TORCHELASTIC", "PL_"))
    }
    env.update(PJRT_DEVICE="CPU", MASTER_ADDR="127.0.0.1", PYTHONPATH=str(PROJECT_ROOT), **extra)
    return env


def free_port() -> int:
    """A TCP port nothing listens on now, for a launch's `--master_port`."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(script: Path, out: Path, *args: str, env: dict[str, str], killed: bool = False, timeout: float) -> str:
    """Run `python script ARGS` in `out` (the script launches its other ranks) and return its output, stdout and
    stderr together; fail the test unless it exits 0 or, `killed`, by its own SIGKILL (else the kill point was never
    reached and nothing was tested).

    A job that kills itself kills its process group (`killpg`), so it runs in a session of its own; the warm
    interpreter's fork takes its other ranks' forks with it (tests/warm_python.py), as `proc.kill()` does for any
    other job."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        env=env,
        cwd=out,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=killed,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if killed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the other ranks, if any is left
        else:
            proc.kill()
    expected = -signal.SIGKILL if killed else 0
    assert proc.returncode == expected, f"exit {proc.returncode}, expected {expected}:\n{output[-3000:]}"
    return output
