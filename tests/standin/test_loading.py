"""Loading the stand-in: the opt-in switch, the build cache, and one-paragraph errors when it cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.native_only

PRINT_TENSOR = "import torch, lightning_trn.standin; print(torch.randn(2, device='neuron'))"


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)


def assert_one_paragraph_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lightning_trn.standin._build.StandinError: lightning_trn.standin")
    for needle in needles:
        assert needle in last
    return last


def test_import_gives_a_neuron_tensor() -> None:
    result = run(PRINT_TENSOR)
    assert result.returncode == 0, result.stderr
    assert "device='neuron:0'" in result.stdout


def test_lightning_trn_loads_it_only_when_asked() -> None:
    code = "import torch, lightning_trn; print(torch._C._get_privateuse1_backend_name())"
    assert run(code, LIGHTNING_TRN_STANDIN="1").stdout.strip() == "neuron"
    assert run(code, LIGHTNING_TRN_STANDIN="0").stdout.strip() == "privateuseone"


def test_a_cached_build_needs_no_compiler() -> None:
    result = run(PRINT_TENSOR, CXX="/nonexistent/c++", PATH="/nonexistent")
    assert result.returncode == 0, result.stderr


def test_missing_compiler_names_the_fix(tmp_path: Path) -> None:
    result = run(PRINT_TENSOR, LIGHTNING_TRN_STANDIN_CACHE=str(tmp_path), CXX="/nonexistent/c++")
    assert_one_paragraph_error(result, "no C++ compiler", "apt-get install g++")


def test_missing_ninja_names_the_fix(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # a PATH with a compiler and no ninja
    bin_dir.mkdir()
    (bin_dir / "c++").symlink_to(shutil.which("c++"))
    result = run(PRINT_TENSOR, LIGHTNING_TRN_STANDIN_CACHE=str(tmp_path / "cache"), PATH=str(bin_dir))
    assert_one_paragraph_error(result, "ninja", "pip install ninja")


def test_a_failing_compile_ends_in_its_message_not_a_bare_traceback(tmp_path: Path) -> None:
    compiler = tmp_path / "broken-c++"
    compiler.write_text(  # answers torch's version probe, fails every compile
        "#!/bin/sh\n"
        "case \"$*\" in *' -c '*) echo 'standin.cpp:1:1: error: this compiler is broken' >&2; exit 1;; esac\n"
        f'exec {shutil.which("c++")} "$@"\n'
    )
    compiler.chmod(0o755)
    result = run(PRINT_TENSOR, LIGHTNING_TRN_STANDIN_CACHE=str(tmp_path / "cache"), CXX=str(compiler))
    assert result.returncode != 0
    assert "StandinError: lightning_trn.standin could not compile its C++ extension" in result.stderr
    assert "this compiler is broken" in result.stderr.split("StandinError:")[-1]


def test_it_refuses_to_load_on_a_neuron_host(tmp_path: Path) -> None:
    (tmp_path / "torch_neuronx").mkdir()  # the Neuron host, faked at the boundary the stand-in checks
    (tmp_path / "torch_neuronx" / "__init__.py").write_text("")
    result = run(PRINT_TENSOR, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert_one_paragraph_error(result, "refuses to load on a Neuron host", "Unset LIGHTNING_TRN_STANDIN")


def test_it_refuses_when_torch_already_has_a_custom_device() -> None:
    # what TorchNeuron's autoload leaves behind: torch's PrivateUse1 device already renamed
    code = "import torch; torch.utils.rename_privateuse1_backend('neuron'); " + PRINT_TENSOR
    assert_one_paragraph_error(run(code), "already registered as 'neuron'", "unset LIGHTNING_TRN_STANDIN")


@pytest.mark.parametrize("value", ["0", "abc", "65"])
def test_bad_device_count(value: str) -> None:
    result = run(PRINT_TENSOR, LIGHTNING_TRN_STANDIN_DEVICES=value)
    assert_one_paragraph_error(result, f"LIGHTNING_TRN_STANDIN_DEVICES={value!r}", "1 to 64")


def test_host_ops_from_the_environment() -> None:
    code = (
        "import torch, lightning_trn.standin as s; x = torch.ones(3, device='neuron'); torch.relu(x); x + x; "
        "print(s.host_op_counts())"
    )
    result = run(code, LIGHTNING_TRN_STANDIN_HOST_OPS="aten::relu, aten::median")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{'aten::relu': 1}"
    assert_one_paragraph_error(run(code, LIGHTNING_TRN_STANDIN_HOST_OPS="relu"), "['relu'] are not op names")
