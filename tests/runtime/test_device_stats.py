"""Device stats (docs/operations.md): `DeviceStatsMonitor` on a Neuron run logs the runtime's memory figures and, on a
Neuron host, `neuron-monitor`'s NeuronCore utilization and device memory (here a fake `neuron-monitor` on PATH, the
process boundary); where the platform offers none (XLA:CPU) it says so once."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import DeviceStatsMonitor
from models import RegressionModel, regression_loader

from lightning_trn.runtime import base, get_runtime, monitor

pytestmark = pytest.mark.both


#: the document of the Neuron docs' "neuron-monitor user guide", cut to the fields read, for process `pid`
def _document(pid: int) -> dict:
    return {
        "neuron_runtime_data": [
            {
                "pid": pid,
                "neuron_runtime_tag": "367",
                "report": {
                    "neuroncore_counters": {
                        "period": 1.0,
                        "neuroncores_in_use": {
                            "0": {"neuroncore_utilization": 42.01, "flops": 1234567891011},
                            "1": {"neuroncore_utilization": 7.5},
                        },
                    },
                    "memory_used": {
                        "period": 1.0,
                        "neuron_runtime_used_bytes": {"host": 6997643264, "neuron_device": 12519788544},
                    },
                },
            }
        ]
    }


def test_a_documents_figures_for_this_process_only():
    assert monitor.parse_report(_document(123), 123) == {
        "neuroncore_0_utilization": 42.01,
        "neuroncore_1_utilization": 7.5,
        "device_memory_used_bytes": 12519788544.0,
        "host_memory_used_bytes": 6997643264.0,
    }
    assert monitor.parse_report(_document(123), 456) == {}
    assert monitor.parse_report({}, 123) == {}


FAKE_MONITOR = """#!{python}
import json, os, sys, time
with open({argv_file!r}, "w") as f:
    json.dump({{"argv": sys.argv, "config": json.load(open(sys.argv[sys.argv.index("-c") + 1]))}}, f)
document = {document}
document["neuron_runtime_data"][0]["pid"] = os.getppid()
while True:
    print("diagnostic line that is not JSON", flush=True)
    print(json.dumps(document), flush=True)
    time.sleep(0.1)
"""


@pytest.fixture
def fake_neuron_monitor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`neuron-monitor` on PATH printing the document above for its parent process; a fresh stream per test."""
    argv_file = tmp_path / "argv.json"
    script = tmp_path / "bin" / "neuron-monitor"
    script.parent.mkdir()
    script.write_text(
        FAKE_MONITOR.format(python=sys.executable, argv_file=str(argv_file), document=json.dumps(_document(0)))
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monitor._stream.cache_clear()
    yield argv_file
    if monitor._stream.cache_info().currsize and (stream := monitor._stream()) is not None:
        stream.close()
    monitor._stream.cache_clear()


def test_neuron_host_stats_come_from_neuron_monitor(fake_neuron_monitor: Path, monkeypatch: pytest.MonkeyPatch):
    runtime = get_runtime()
    monkeypatch.setattr(type(runtime), "on_neuron", lambda self: True)
    monkeypatch.setattr(type(runtime), "memory_stats", lambda self, device: {"bytes_used": 1.0})
    deadline = time.monotonic() + 30
    while "neuroncore_0_utilization" not in (stats := runtime.device_stats(runtime.device())):
        assert time.monotonic() < deadline, "no document from the fake neuron-monitor"
        time.sleep(0.05)
    assert stats == {
        "bytes_used": 1.0,
        "neuroncore_0_utilization": 42.01,
        "neuroncore_1_utilization": 7.5,
        "device_memory_used_bytes": 12519788544.0,
        "host_memory_used_bytes": 6997643264.0,
    }
    config = json.loads(fake_neuron_monitor.read_text())["config"]
    assert config == monitor.MONITOR_CONFIG


@pytest.mark.xla_only
def test_xla_cpu_says_once_that_it_has_no_device_stats(tmp_path: Path):
    base._say_no_device_stats.cache_clear()
    trainer = Trainer(
        accelerator="neuron",
        devices=1,
        max_steps=6,
        log_every_n_steps=2,
        callbacks=[DeviceStatsMonitor()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match="XLA:CPU offers no device statistics") as warned:
        trainer.fit(RegressionModel(), regression_loader(n=96))
    assert sum("offers no device statistics" in str(w.message) for w in warned) == 1
    assert trainer.global_step == 6
