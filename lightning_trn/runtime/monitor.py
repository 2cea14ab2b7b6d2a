"""NeuronCore utilization and device memory from `neuron-monitor`, the Neuron SDK's metrics daemon.

`neuron-monitor -c <config>` prints one JSON document per period on stdout; for every process using NeuronCores,
`neuron_runtime_data[i].report` holds `neuroncore_counters.neuroncores_in_use.<core>.neuroncore_utilization` (percent)
and `memory_used.neuron_runtime_used_bytes.{neuron_device,host}` (Neuron docs: "neuron-monitor user guide"). One
stream is started per process (each reports its own pid's cores), on first use, and read by a background thread:
sampling never waits on it or on the device.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

#: the daemon's executable (on PATH on a Neuron host with `aws-neuronx-tools`)
MONITOR_EXECUTABLE = "neuron-monitor"
#: only the metric groups this module reads, once a second
MONITOR_CONFIG = {
    "period": "1s",
    "neuron_runtimes": [{"tag_filter": ".*", "metrics": [{"type": "neuroncore_counters"}, {"type": "memory_used"}]}],
}


def parse_report(document: dict[str, Any], pid: int) -> dict[str, float]:
    """Process `pid`'s figures in one neuron-monitor document: `neuroncore_<core>_utilization` (percent) for each
    core it uses, `device_memory_used_bytes`, `host_memory_used_bytes`. Empty when `pid` is not in it."""
    stats: dict[str, float] = {}
    for runtime in document.get("neuron_runtime_data") or []:
        if runtime.get("pid") != pid:
            continue
        report = runtime.get("report") or {}
        cores = (report.get("neuroncore_counters") or {}).get("neuroncores_in_use") or {}
        for core, counters in sorted(cores.items()):
            if "neuroncore_utilization" in counters:
                stats[f"neuroncore_{core}_utilization"] = float(counters["neuroncore_utilization"])
        used = (report.get("memory_used") or {}).get("neuron_runtime_used_bytes") or {}
        for key, name in (("neuron_device", "device_memory_used_bytes"), ("host", "host_memory_used_bytes")):
            if key in used:
                stats[name] = float(used[key])
    return stats


class MonitorStream:
    """A running `neuron-monitor` and the latest document it printed."""

    def __init__(self, command: Sequence[str]) -> None:
        self._latest: dict[str, Any] = {}
        self._process = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, name="lightning_trn-neuron-monitor", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                document = json.loads(line)
            except json.JSONDecodeError:  # a partial or diagnostic line: the next period brings a whole one
                continue
            if isinstance(document, dict):
                self._latest = document
        self._latest = {}  # neuron-monitor exited: no figures rather than frozen ones

    def sample(self, pid: int) -> dict[str, float]:
        return parse_report(self._latest, pid)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()


@functools.lru_cache(maxsize=1)  # one stream per process, looked for once
def _stream() -> MonitorStream | None:
    executable = shutil.which(MONITOR_EXECUTABLE)
    if executable is None:
        return None
    config_dir = tempfile.mkdtemp(prefix="lightning_trn-neuron-monitor-")
    atexit.register(shutil.rmtree, config_dir, ignore_errors=True)
    config = os.path.join(config_dir, "config.json")
    with open(config, "w") as f:
        json.dump(MONITOR_CONFIG, f)
    try:
        stream = MonitorStream([executable, "-c", config])
    except OSError as err:  # not executable, or no resources: device stats go on without it
        log.warning(
            "lightning_trn: could not start %s (%s); no NeuronCore utilization in the device stats.", executable, err
        )
        return None
    atexit.register(stream.close)
    return stream


def neuron_monitor_stats() -> dict[str, float]:
    """This process's latest figures from `neuron-monitor` (started on the first call); empty without it, or
    before its first period has passed."""
    stream = _stream()
    return {} if stream is None else stream.sample(os.getpid())
