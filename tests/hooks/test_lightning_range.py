"""The Lightning versions lightning_trn claims are the ones it is tested on, and the hooks refuse any other.

The hooks replace Lightning internals, so the package's `lightning` requirement and the hooks' guard
(`TESTED_LIGHTNING`) must name the same range, and the suite must run inside it.
"""

import tomllib
from pathlib import Path

import lightning
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from lightning_trn.hooks import registry

pytestmark = pytest.mark.both

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _lightning_requirement() -> Requirement:
    dependencies = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    (requirement,) = [Requirement(d) for d in dependencies if Requirement(d).name == "lightning"]
    return requirement


def test_requirement_is_the_guarded_range_and_the_suite_runs_inside_it():
    low, high = registry.TESTED_LIGHTNING
    assert _lightning_requirement().specifier == Requirement(f"lightning>={low},<{high}").specifier
    assert _lightning_requirement().specifier.contains(Version(lightning.__version__))
    assert registry.lightning_version_tested()


class _Owner:
    attribute = "original"


@pytest.mark.parametrize(("version", "tested"), [("2.6.6", True), ("2.6.5", False), ("2.5.0", False), ("2.7.0", False)])
def test_hooks_install_on_a_tested_version_only(monkeypatch, version, tested):
    monkeypatch.setattr(lightning, "__version__", version)
    assert registry.lightning_version_tested() is tested
    hook = registry.Hook(_Owner, "attribute", lambda original: f"hooked {original}")
    with registry.installed([hook]):
        assert _Owner.attribute == ("hooked original" if tested else "original")
    assert _Owner.attribute == "original"
