"""Which suite runs a test is decided by its module's marker alone (tests/conftest.py, docs/contributing.md): a module
without one fails collection, the other suite's modules are never imported, and a test marked for the other suite
inside a `both` module is deselected. Checked in a child pytest on modules written for the purpose, in each suite."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import child_env

pytestmark = pytest.mark.both

TESTS = Path(__file__).parent
THIS_SUITE, OTHER_SUITE = ("xla_only", "native_only")[:: 1 if importlib.util.find_spec("torch_xla") else -1]


def collect(directory: Path) -> subprocess.CompletedProcess:
    """`pytest --collect-only` of `directory` with this suite's conftest loaded as a plugin."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "conftest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "-c",
        str(TESTS.parent / "pyproject.toml"),
        "--rootdir",
        str(directory),
        str(directory),
    ]
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join((str(TESTS), env["PYTHONPATH"]))  # `-p conftest` imports it from there
    return subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=300)


def test_a_module_without_a_suite_marker_fails_collection(tmp_path: Path) -> None:
    (tmp_path / "test_unmarked.py").write_text("def test_anything():\n    pass\n")
    (tmp_path / "test_two_suites.py").write_text(
        "import pytest\n\npytestmark = [pytest.mark.both, pytest.mark.xla_only]\n\ndef test_anything():\n    pass\n"
    )
    result = collect(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "test_unmarked.py declares no suite marker: put exactly one at module level" in result.stdout
    assert "test_two_suites.py declares the suite markers both, xla_only" in result.stdout


def test_each_suite_collects_its_own_and_shared_modules_only(tmp_path: Path) -> None:
    (tmp_path / "test_shared.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.both\n\n"
        "def test_on_both():\n    pass\n\n"
        f"@pytest.mark.{THIS_SUITE}\ndef test_here():\n    pass\n\n"
        f"@pytest.mark.{OTHER_SUITE}\ndef test_there():\n    pass\n"
    )
    (tmp_path / "test_mine.py").write_text(
        f"import pytest\n\npytestmark = pytest.mark.{THIS_SUITE}\n\ndef test_mine():\n    pass\n"
    )
    # a module this environment cannot import: collecting it would be an error
    (tmp_path / "test_theirs.py").write_text(
        f"import pytest\nimport no_such_module\n\n"
        f"pytestmark = pytest.mark.{OTHER_SUITE}\n\ndef test_theirs():\n    pass\n"
    )
    result = collect(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    collected = {line for line in result.stdout.splitlines() if "::" in line}
    assert collected == {"test_mine.py::test_mine", "test_shared.py::test_on_both", "test_shared.py::test_here"}
    assert f"1 {OTHER_SUITE} test modules not collected" in result.stdout
    assert "3/4 tests collected (1 deselected)" in result.stdout
