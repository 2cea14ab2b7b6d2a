"""In the XLA environment (torch 2.9) the native device's stand-in refuses to load, naming the fix."""

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.xla_only


def test_stand_in_on_an_unsupported_torch_names_the_fix() -> None:
    result = subprocess.run([sys.executable, "-c", "import lightning_trn.standin"], capture_output=True, text=True)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lightning_trn.standin._build.StandinError:")
    assert f"this environment has torch {torch.__version__}" in last
    assert "scripts/setup.sh" in last and "torch==2.13.0" in last
