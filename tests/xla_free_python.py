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


def _xla_free_site(tmp_dir: Path) -> Path:
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


def run_without_torch_xla(code: str, tmp_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `code` in a child interpreter without torch_xla; the project root is importable and the cwd."""
    site = _xla_free_site(tmp_dir)
    prelude = f"import site, sys\nsite.addsitedir({str(site)!r})\nsys.path.insert(0, {str(PROJECT_ROOT)!r})\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "NEURON_"))}
    return subprocess.run(
        [sys.executable, "-S", "-c", prelude + textwrap.dedent(code)],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
