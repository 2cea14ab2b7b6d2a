"""The README's first command prints what the README shows: `PJRT_DEVICE=CPU python -m recipes.mlp` on a checkout ends
with the held-out line the README quotes, each number within the tolerance the README states beside it (XLA:CPU
compiles for the host's instruction set, so the last digits move from one CPU to another)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import child_env

pytestmark = [pytest.mark.xla_only, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RUN_TIMEOUT_S = 600


def _held_out(text: str) -> dict[str, float]:
    line = re.search(r"^\[mlp\] held-out test: (.+)$", text, re.MULTILINE)
    assert line, "no held-out line"
    return {key: float(value) for key, value in (item.split("=") for item in line.group(1).split(", "))}


def _stated_tolerances() -> dict[str, float]:
    """`test_acc` and `test_loss` each "within ±X" in the README's sentence after the sample output."""
    found = dict(re.findall(r"`(test_\w+)` within ±([0-9.]+)", README))
    assert set(found) == {"test_acc", "test_loss"}, found
    return {key: float(value) for key, value in found.items()}


def test_the_first_command_prints_the_readmes_held_out_line_within_its_stated_tolerance(tmp_path: Path) -> None:
    first = README.splitlines()[2]  # the fenced block's first line: the install-and-train command
    command = shlex.split(first.split("&&", 1)[1].split("#", 1)[0])
    assert command == ["PJRT_DEVICE=CPU", "python", "-m", "recipes.mlp"], first
    result = subprocess.run(
        [sys.executable, "-m", "recipes.mlp", f"out_dir={tmp_path / 'mlp'}"],
        cwd=ROOT,
        env=child_env(),  # PJRT_DEVICE=CPU, as the README's command sets it
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed, quoted = _held_out(result.stdout), _held_out(README)
    assert printed.keys() == quoted.keys() == {"test_acc", "test_loss"}
    for key, tolerance in _stated_tolerances().items():
        assert abs(printed[key] - quoted[key]) <= tolerance, (key, printed[key], quoted[key], tolerance)
