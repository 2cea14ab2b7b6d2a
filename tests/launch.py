"""The environment tests start child jobs in: this one minus launcher variables (ranks, world size, port) that an
in-process launch earlier in the session may have left, so each child job sets its own."""

from __future__ import annotations

import os
import socket
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
