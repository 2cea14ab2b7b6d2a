"""Run Python code in a fresh interpreter where torch_xla is genuinely not installed.

Builds a site directory of links to every entry of this environment's site-packages except torch_xla
(package, `_XLAC` extension, dist-info) and starts `python -S` on it: the child sees the same torch, lightning
and project, as a GPU/CPU user without torch_xla would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
_EXCLUDED_PREFIXES = ("torch_xla", "_XLAC", "libtpu", "__editable__")
#: names the warm interpreter without torch_xla (`python -S` on this site, tests/conftest.py), when there is one
WARM_VARIABLE = "LIGHTNING_TRN_WARM_PYTHON_WITHOUT_XLA"


def xla_free_site(tmp_dir: Path) -> Path:
    site = tmp_dir / "site-packages-without-torch-xla"
    if site.exists():
        return site
    site.mkdir(parents=True)
    source = Path(sysconfig.get_paths()["purelib"])
    for entry in source.iterdir():
        if entry.name.startswith(_EXCLUDED_PREFIXES):
            continue
        (site / entry.name).symlink_to(entry)
    return site


def child_env() -> dict[str, str]:
    """This environment without the XLA and Neuron runtimes' variables, as a machine without torch_xla has it."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "NEURON_"))}


def run_without_torch_xla(code: str, tmp_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `code` in a child interpreter without torch_xla; the project root is importable and the cwd."""
    site = xla_free_site(tmp_dir)
    prelude = f"import site, sys\nsite.addsitedir({str(site)!r})\nsys.path.insert(0, {str(PROJECT_ROOT)!r})\n"
    warm = os.environ.get(WARM_VARIABLE)
    python = os.path.join(warm, "python") if warm else sys.executable  # a fork of the warm one, where it runs
    return subprocess.run(
        [python, "-S", "-c", prelude + textwrap.dedent(code)],
        cwd=PROJECT_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
