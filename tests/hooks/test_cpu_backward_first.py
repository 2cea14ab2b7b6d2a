"""A CPU backward pass before the first Neuron fit in the same process: autograd then has no
worker thread for the Neuron device, which PyTorch reports as an INTERNAL ASSERT in the first step. The accelerator
detects it at device setup and says what happened and how to avoid it; starting the device first avoids it. Run by
both suites, in fresh processes (autograd's device workers start once per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.both

TESTS = Path(__file__).parents[1]
SCRIPT = TESTS / "scripts" / "cpu_backward_first.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


def test_cpu_backward_before_the_device_is_a_clear_error():
    result = _run()
    assert result.returncode != 0
    assert "INTERNAL ASSERT" not in result.stderr.splitlines()[-1]
    assert "a backward pass ran in this process before the Neuron device was started" in result.stderr
    assert "in a separate process" in result.stderr


@pytest.mark.slow
def test_starting_the_device_first_avoids_it():
    result = _run("--start-device-first")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2 steps" in result.stdout
