"""Test configuration: which suite runs a test, and the fixtures shared by both suites.

Two suites run `tests/`: the XLA suite (`python -m pytest`, torch 2.9 + torch_xla on XLA:CPU, `PJRT_DEVICE=CPU`) and
the native suite (`.venv-native/bin/python -m pytest`, torch 2.13 without torch_xla, on the stand-in `neuron` device
with two devices). Markers alone route tests to them: every test module declares `pytestmark` with exactly one of
`both`, `xla_only` or `native_only` (a list may add others, such as `slow`); a module without one fails collection.
The marker is read from the module's source, so a suite never imports the other suite's modules (an `xla_only`
module may import torch_xla at the top). Inside a `both` module a test may carry `xla_only` or `native_only` itself;
the other suite deselects it (shown as "deselected", so "skipped" counts only real skips).
"""

import ast
import fnmatch
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

XLA_SUITE = importlib.util.find_spec("torch_xla") is not None
SUITE_MARKERS = ("both", "xla_only", "native_only")
OTHER_SUITE = "native_only" if XLA_SUITE else "xla_only"
_NOT_COLLECTED = pytest.StashKey[set]()  # the other suite's modules seen, for the collection report

if not XLA_SUITE:  # the stand-in in this process and in the processes tests launch (LIGHTNING_TRN_STANDIN is inherited)
    os.environ.setdefault("LIGHTNING_TRN_STANDIN_DEVICES", "2")
    os.environ["LIGHTNING_TRN_STANDIN"] = "1"
    import lightning_trn.standin  # noqa: F401  builds (first time) and loads the stand-in


_WARM = pytest.StashKey[tuple]()


def pytest_configure(config: pytest.Config) -> None:
    """Children start from a warm interpreter (`tests/warm_python.py`) unless LIGHTNING_TRN_TEST_COLD is set: one
    server per suite, started by the first pytest (pytest-xdist's controller); its workers, and a pytest that a test
    starts, use the same server. The XLA suite starts a second one without torch_xla, for the children of
    `tests/xla_free_python.py`."""
    if os.environ.get("LIGHTNING_TRN_TEST_COLD"):
        return
    if os.environ.get("LIGHTNING_TRN_WARM_PYTHON"):  # a pytest-xdist worker, or a pytest a test started: use its server
        sys.executable = os.path.join(os.environ["LIGHTNING_TRN_WARM_PYTHON"], "python")
        return
    from tests import warm_python, xla_free_python

    directory = Path(tempfile.mkdtemp(prefix="warm-"))
    servers = [warm_python.start(directory)[0]]
    if XLA_SUITE:
        free = directory / "without-torch-xla"
        site = xla_free_python.xla_free_site(directory)
        servers.append(warm_python.start(free, flags=("-S",), site=site, env=xla_free_python.child_env())[0])
        os.environ[xla_free_python.WARM_VARIABLE] = str(free)
    config.stash[_WARM] = (servers, directory, sys.executable)
    os.environ["LIGHTNING_TRN_WARM_PYTHON"] = str(directory)
    sys.executable = str(directory / "python")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """How many children the warm interpreters forked, and which started cold and why (docs/contributing.md)."""
    if _WARM in config.stash:
        from tests import warm_python

        directory = config.stash[_WARM][1]
        terminalreporter.write_line(warm_python.summary(directory))
        if (directory / "without-torch-xla").exists():
            terminalreporter.write_line("without torch_xla: " + warm_python.summary(directory / "without-torch-xla"))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _WARM not in config.stash:
        return
    from tests import warm_python, xla_free_python

    servers, directory, real_python = config.stash[_WARM]
    sys.executable = real_python
    os.environ.pop("LIGHTNING_TRN_WARM_PYTHON", None)
    os.environ.pop(xla_free_python.WARM_VARIABLE, None)
    for server in servers:
        warm_python.stop(server)
    shutil.rmtree(directory, ignore_errors=True)


@functools.cache
def declared_suites(path: Path) -> tuple[str, ...]:
    """The suite markers named in a test module's `pytestmark`, read from its source without importing it."""
    for node in ast.parse(path.read_bytes(), filename=str(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "pytestmark" for target in node.targets):
            names = {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)}
            return tuple(sorted(names.intersection(SUITE_MARKERS)))
    return ()


def _is_test_module(path: Path, config: pytest.Config) -> bool:
    patterns = config.getini("python_files")
    return path.suffix == ".py" and any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns)


class OtherSuiteModule(pytest.Module):
    """A module of the other suite: collected empty and never imported (it may import what this environment lacks)."""

    def collect(self) -> list:
        return []


class UnroutedModule(pytest.Module):
    """A test module that names no suite (or several): collecting it is an error that says how to fix it."""

    def collect(self) -> list:
        found = declared_suites(self.path)
        raise self.CollectError(
            f"{self.path.name} declares {'the suite markers ' + ', '.join(found) if found else 'no suite marker'}: "
            "put exactly one at module level, e.g. `pytestmark = pytest.mark.both` (runs in the XLA and the native "
            "suite), `pytest.mark.xla_only` or `pytest.mark.native_only`; with others as a list, "
            "`pytestmark = [pytest.mark.both, pytest.mark.slow]`. See docs/contributing.md."
        )


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Routes a test module by its suite marker: the other suite's is left empty, one without a marker fails."""
    if not _is_test_module(module_path, parent.config):
        return None
    suites = declared_suites(module_path)
    if suites == (OTHER_SUITE,):
        parent.config.stash.setdefault(_NOT_COLLECTED, set()).add(module_path)
        return OtherSuiteModule.from_parent(parent, path=module_path)
    if len(suites) != 1:
        return UnroutedModule.from_parent(parent, path=module_path)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked for the other suite inside a `both` module are deselected; modules with a `slow` test run first.

    Under `scripts/test.sh` (`--dist loadfile --no-loadscope-reorder`) pytest-xdist hands out modules in this order:
    the long ones first, so the suite does not end on one of them with the other worker idle."""
    deselected = [item for item in items if item.get_closest_marker(OTHER_SUITE) is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.get_closest_marker(OTHER_SUITE) is None]
    slow_modules = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_modules)  # stable: each group keeps its order


def pytest_report_collectionfinish(config: pytest.Config) -> str:
    """Says which suite this is and how many of the other suite's modules it left out of the paths asked for."""
    asked = [Path(config.invocation_params.dir, arg.split("::")[0]).resolve() for arg in config.args]
    left_out = sum(
        any(path == root or root in path.parents for root in asked) for path in config.stash.get(_NOT_COLLECTED, set())
    )
    return f"{'XLA' if XLA_SUITE else 'native'} suite: {left_out} {OTHER_SUITE} test modules not collected"


#: variables a launch in this process sets in `os.environ` (Lightning's launcher and cluster environments, torch_xla's
#: Neuron mapping) and nothing takes back: left set, every later test's child jobs would inherit one rank's values,
#: the port included (two children then rendezvous on one port)
_LAUNCH_VARIABLE_PREFIXES = (
    "MASTER_",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
)
_LAUNCH_VARIABLE_PREFIXES += (
    "PJRT_LOCAL_",
    "NEURON_PJRT_",
    "NEURON_RT_VISIBLE_CORES",
    "NEURON_RT_ROOT_COMM_ID",
    "TORCHELASTIC_",
)


@pytest.fixture(autouse=True)
def _launch_variables_restored():
    """Each test starts with the launch variables the session started with."""
    before = {name: value for name, value in os.environ.items() if name.startswith(_LAUNCH_VARIABLE_PREFIXES)}
    yield
    for name in [name for name in os.environ if name.startswith(_LAUNCH_VARIABLE_PREFIXES)]:
        if name not in before:
            del os.environ[name]
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _fresh_platform_detection():
    """Platform detection is cached per runtime object; give every test its own so faked hosts don't leak."""
    from lightning_trn.runtime import get_runtime

    get_runtime.cache_clear()
    yield
    get_runtime.cache_clear()


@pytest.fixture
def neuron_run_hooks():
    """Lightning's internals hooked as during a Neuron run (`lightning_trn.hooks.registry`), for unit tests."""
    from lightning_trn.hooks import registry as lightning_hooks

    lightning_hooks.acquire()
    yield
    lightning_hooks.release()


@pytest.fixture
def fake_neuron_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A host that looks like a Neuron instance at the discovery boundary: sysfs devices with `core_count` files.

    Call the returned function with the cores per device, e.g. `fake_neuron_host([2, 2])` for two devices.
    """
    from lightning_trn.runtime import discovery

    def make(cores_per_device: list) -> Path:
        root = tmp_path / "neuron_device"
        for i, cores in enumerate(cores_per_device):
            (root / f"neuron{i}").mkdir(parents=True)
            (root / f"neuron{i}" / "core_count").write_text(f"{cores}\n")
        monkeypatch.setattr(discovery, "NEURON_SYSFS_ROOT", str(root))
        monkeypatch.setattr(discovery, "NEURON_DEV_GLOB", str(tmp_path / "dev" / "neuron[0-9]*"))
        monkeypatch.delenv("PJRT_DEVICE", raising=False)
        for var in ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_LOGICAL_NC_CONFIG"):
            monkeypatch.delenv(var, raising=False)
        return root

    return make


@pytest.fixture
def no_neuron_host(fake_neuron_host):
    """A host with torch_xla installed but no Neuron devices and no `PJRT_DEVICE`."""
    return fake_neuron_host([])


class RedrawClock:
    """Stands in for the progress bars' `time` module; `advance_per_batch(seconds)` is a callback that moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance_per_batch(self, seconds: float):
        from lightning.pytorch import Callback

        clock = self

        class AdvanceClock(Callback):
            def on_train_batch_start(self, *args) -> None:
                clock.now += seconds

        return AdvanceClock()


@pytest.fixture
def redraw_clock(monkeypatch: pytest.MonkeyPatch) -> RedrawClock:
    """A fake clock for the progress bars' redraw limit (`lightning_trn.pytorch.callbacks.progress_bar`)."""
    from lightning_trn.pytorch.callbacks import progress_bar

    clock = RedrawClock()
    monkeypatch.setattr(progress_bar, "time", clock)
    return clock
