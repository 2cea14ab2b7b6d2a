"""The built wheel in a fresh environment: the recipes install under `lightning_trn.recipes` and no top-level
`recipes` lands in site-packages (a generic name that would shadow a user's own module); the checkout's
`python -m recipes.<name>` aliases still run the same command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.xla_only

ROOT = Path(__file__).resolve().parents[1]


def _source_tree(dest: Path) -> Path:
    """The checkout's files that git tracks or would track (no virtual environments, builds or runs)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _fresh_env_with_wheel(tmp_path: Path) -> Path:
    """A new venv with only the built wheel installed; torch, lightning and the recipes' dependencies come from this
    environment's site-packages through a path entry, without its `.pth` hooks (the editable install's finder)."""
    source = _source_tree(tmp_path / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = (tmp_path / "dist").glob("lightning_trn-*.whl")
    venv = tmp_path / "venv"
    # without pip of its own (installing it is most of a venv's creation): this environment's pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow
def test_the_wheel_installs_the_recipes_under_the_package_and_no_top_level_recipes(tmp_path):
    python = _fresh_env_with_wheel(tmp_path)
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # one interpreter (each costs seconds cold): where the package and a top-level `recipes` come from, then the
    # command, as `python -m lightning_trn.recipes.llm --help` runs it: its config file and schema load (`--help`
    # lists every key)
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u, runpy, sys, lightning_trn.recipes as r\n"
            "print(r.__file__); print(u.find_spec('recipes'), flush=True)\n"
            "sys.argv = ['llm', '--help']\n"
            "runpy.run_module('lightning_trn.recipes.llm', run_name='__main__', alter_sys=True)",
        ],
        cwd=run_dir,
        env={**env, "PJRT_DEVICE": "CPU"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    package_file, recipes_spec, usage = probe.stdout.split("\n", 2)
    assert package_file.startswith(str(tmp_path / "venv")), package_file  # the wheel's copy, not the checkout
    assert recipes_spec == "None"
    record = next((python.parents[1] / "lib").glob("python*/site-packages/lightning_trn-*.dist-info/RECORD"))
    installed = [line.split(",")[0] for line in record.read_text().splitlines()]
    assert "lightning_trn/recipes/configs/llm.yaml" in installed
    assert not [name for name in installed if name.startswith("recipes/")]
    assert "model.num_kv_heads=2" in usage, usage[-2000:]


def test_the_checkout_alias_runs_the_packaged_recipe_command():
    outputs = [
        subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
        ).stdout
        for module in ("recipes.llm", "lightning_trn.recipes.llm")
    ]
    assert "model.num_kv_heads=2" in outputs[0] and outputs[0] == outputs[1]
