"""Checkpoints cross backends: one written on XLA (torch-neuronx 2.9 / Trn1, here XLA:CPU) resumes on the native
backend (TorchNeuron / Trn2, here the stand-in) and the other way round, and a native one resumes with
`Trainer(accelerator="cpu")` in a process without the stand-in. Each resumed run must end with the weights and step
of an uninterrupted run (SGD with momentum: a lost optimizer state shows).

Run by the XLA suite; the native side is the interpreter of `.venv-native/` (`scripts/setup.sh` makes it), or
`LIGHTNING_TRN_NATIVE_PYTHON`. Without it the tests skip, unless `LIGHTNING_TRN_REQUIRE_NATIVE=1` (`scripts/test.sh`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.xla_only

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = PROJECT_ROOT / "tests" / "scripts" / "resume_train.py"
NATIVE_PYTHON = Path(os.environ.get("LIGHTNING_TRN_NATIVE_PYTHON", PROJECT_ROOT / ".venv-native" / "bin" / "python"))
#: XLA:CPU and eager CPU kernels may sum in different orders: an ulp of a gradient (<= ~30: 2e-6) moves a weight by
#: lr (0.05) x that a step, which momentum 0.9 carries ~29x over the 8 steps: ~3e-6, under this
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def native_python() -> Path:
    if not NATIVE_PYTHON.exists():
        if os.environ.get("LIGHTNING_TRN_REQUIRE_NATIVE") == "1":
            pytest.fail(f"No native environment at {NATIVE_PYTHON}: run `bash scripts/setup.sh`.")
        pytest.skip(f"no native environment at {NATIVE_PYTHON} (`bash scripts/setup.sh` makes it)")
    return NATIVE_PYTHON


def _train(python: Path | str, accelerator: str, epochs: int, save: Path, resume: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_TRN_STANDIN", "PL_"))}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=str(PROJECT_ROOT))
    if Path(python) != Path(sys.executable) and accelerator == "neuron":
        env["LIGHTNING_TRN_STANDIN"] = "1"  # the native interpreter's neuron device
    command = [str(python), str(SCRIPT), "--accelerator", accelerator, "--epochs", str(epochs), "--save", str(save)]
    if resume is not None:  # other initial weights: only a restore of weights and momentum gives the reference run
        command += ["--resume", str(resume), "--seed", "1"]
    run = subprocess.run(command, env=env, cwd=save.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two epochs (8 steps) in one go, on XLA."""
    return _train(sys.executable, "neuron", 2, tmp_path_factory.mktemp("whole") / "whole.ckpt")


def _assert_same_run(result: dict, reference: dict, backend: str) -> None:
    assert result["backend"] == backend
    assert result["global_step"] == reference["global_step"] == 8
    for name, value in reference["weights"].items():
        torch.testing.assert_close(
            torch.tensor(result["weights"][name]), torch.tensor(value), atol=TOLERANCE, rtol=0, msg=name
        )


def _cpu_only(checkpoint: Path) -> bool:
    state = torch.load(checkpoint, weights_only=True)
    tensors = list(state["state_dict"].values())
    tensors += [v for s in state["optimizer_states"][0]["state"].values() for v in s.values() if torch.is_tensor(v)]
    return all(t.device.type == "cpu" for t in tensors)


@pytest.mark.slow
def test_xla_checkpoint_resumes_on_the_native_backend(tmp_path: Path, native_python: Path, uninterrupted) -> None:
    half = _train(sys.executable, "neuron", 1, tmp_path / "xla.ckpt")
    assert (half["backend"], half["global_step"]) == ("xla", 4)
    assert _cpu_only(tmp_path / "xla.ckpt")
    resumed = _train(native_python, "neuron", 2, tmp_path / "native.ckpt", resume=tmp_path / "xla.ckpt")
    _assert_same_run(resumed, uninterrupted, "native")


@pytest.mark.slow
def test_native_checkpoint_resumes_on_xla_and_on_the_cpu(tmp_path: Path, native_python: Path, uninterrupted) -> None:
    half = _train(native_python, "neuron", 1, tmp_path / "native.ckpt")
    assert (half["backend"], half["global_step"]) == ("native", 4)
    assert _cpu_only(tmp_path / "native.ckpt")  # loaded here, in a process that has no neuron device
    _assert_same_run(
        _train(sys.executable, "neuron", 2, tmp_path / "xla.ckpt", resume=tmp_path / "native.ckpt"),
        uninterrupted,
        "xla",
    )
    _assert_same_run(
        _train(sys.executable, "cpu", 2, tmp_path / "cpu.ckpt", resume=tmp_path / "native.ckpt"), uninterrupted, "cpu"
    )
