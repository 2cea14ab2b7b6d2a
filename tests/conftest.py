"""Test configuration: everything runs on XLA:CPU (`PJRT_DEVICE=CPU`), as the README's test command does.

The native environment (`.venv-native/`, torch 2.13, no torch_xla) runs `tests/standin/` and the shared test files
that `scripts/test.sh` names, on the stand-in `neuron` device with two devices; `tests/standin/` is not collected
in the XLA environment.
"""

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

XLA_SUITE = importlib.util.find_spec("torch_xla") is not None

if XLA_SUITE:
    collect_ignore = ["standin"]
else:  # the stand-in in this process and in the processes tests launch (LIGHTNING_TRN_STANDIN is inherited)
    os.environ.setdefault("LIGHTNING_TRN_STANDIN_DEVICES", "2")
    os.environ["LIGHTNING_TRN_STANDIN"] = "1"
    import lightning_trn.standin  # noqa: F401  builds (first time) and loads the stand-in


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the files both suites run, `xla_only` / `native_only` tests run in their own suite only."""
    other = "native_only" if XLA_SUITE else "xla_only"
    skip = pytest.mark.skip(reason=f"{other}: {'XLA' if XLA_SUITE else 'native'} suite")
    for item in items:
        if item.get_closest_marker(other) is not None:
            item.add_marker(skip)


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
