"""Find out, without importing torch_xla or starting a runtime, which device platform this process will use.

Everything here reads the environment and the file system only, so it is cheap and safe to call from the
launching process before worker processes claim NeuronCores.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Optional

#: Where the Neuron driver exposes one directory per Neuron device (Neuron sysfs user guide).
NEURON_SYSFS_ROOT = "/sys/devices/virtual/neuron_device"
#: Device nodes the Neuron driver creates, one per Neuron device.
NEURON_DEV_GLOB = "/dev/neuron[0-9]*"
#: NeuronCores per Neuron device when sysfs does not say (Trainium1 / Inferentia2).
DEFAULT_CORES_PER_DEVICE = 2

NEURON = "NEURON"
CPU = "CPU"


class NeuronUnavailableError(RuntimeError):
    """Raised when `accelerator="neuron"` is requested but no usable device platform is present."""


@dataclass(frozen=True)
class Platform:
    """The device platform a process will run on and how many devices it may use."""

    kind: str  # NEURON or CPU
    device_count: int
    reason: str  # where the count came from, for messages


def torch_xla_installed() -> bool:
    """Whether `torch_xla` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):
        return False


def parse_core_range(spec: str) -> list[int]:
    """Parse `NEURON_RT_VISIBLE_CORES` syntax (`"0-3"`, `"0,2,5"`, `"0-1,4"`) into core indices."""
    cores: list[int] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise ValueError(f"Invalid NEURON_RT_VISIBLE_CORES value {spec!r}: expected e.g. '0-3' or '0,1,4'.")
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) is not None else start
        if end < start:
            raise ValueError(f"Invalid NEURON_RT_VISIBLE_CORES range {part!r} in {spec!r}: end is before start.")
        cores.extend(range(start, end + 1))
    return sorted(set(cores))


def physical_core_count() -> int:
    """NeuronCores on this host: the sum of each device's sysfs `core_count`, else devices x 2."""
    total = 0
    for device_dir in sorted(glob.glob(os.path.join(NEURON_SYSFS_ROOT, "neuron[0-9]*"))):
        try:
            with open(os.path.join(device_dir, "core_count")) as f:
                total += int(f.read().strip())
        except (OSError, ValueError):
            total += DEFAULT_CORES_PER_DEVICE
    if total:
        return total
    return len(glob.glob(NEURON_DEV_GLOB)) * DEFAULT_CORES_PER_DEVICE


def visible_core_count(env: Optional[dict[str, str]] = None) -> tuple[int, str]:
    """NeuronCores this job may use, honouring `NEURON_RT_VISIBLE_CORES` then `NEURON_RT_NUM_CORES`."""
    env = os.environ if env is None else env
    physical = physical_core_count()
    visible = env.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if visible and physical:
        return len(parse_core_range(visible)), f"NEURON_RT_VISIBLE_CORES={visible}"
    num = env.get("NEURON_RT_NUM_CORES", "").strip()
    if num and num != "0" and physical:
        return min(int(num), physical), f"NEURON_RT_NUM_CORES={num}"
    return physical, f"{physical} NeuronCores found under {NEURON_SYSFS_ROOT}"


def detect_platform(env: Optional[dict[str, str]] = None) -> Platform:
    """Decide the platform: real NeuronCores, or XLA:CPU when the user asked for it with `PJRT_DEVICE=CPU`.

    Raises:
        NeuronUnavailableError: torch_xla is missing, or there are neither NeuronCores nor `PJRT_DEVICE=CPU`.
    """
    env = os.environ if env is None else env
    if not torch_xla_installed():
        raise NeuronUnavailableError(
            "`accelerator='neuron'` needs torch_xla, which is not installed in this Python environment. "
            "On a Trainium/Inferentia host install the Neuron SDK's `torch-neuronx` (it brings torch-xla); "
            "to develop on a CPU-only machine install `lightning-trn[xla-cpu]` and run with `PJRT_DEVICE=CPU`. "
            "Checkpoints written by lightning_trn load without torch_xla: use `Trainer(accelerator='cpu')` or 'gpu'."
        )
    pjrt = env.get("PJRT_DEVICE", "").strip().upper()
    if pjrt == CPU:
        return Platform(CPU, os.cpu_count() or 1, "PJRT_DEVICE=CPU (XLA:CPU, one device per process)")
    if pjrt and pjrt != NEURON:
        raise NeuronUnavailableError(
            f"`accelerator='neuron'` runs on NeuronCores or XLA:CPU, but PJRT_DEVICE={env['PJRT_DEVICE']!r} selects "
            "another XLA platform. Unset PJRT_DEVICE on a Neuron host, set PJRT_DEVICE=CPU to run on XLA:CPU, or use "
            "Lightning's own `accelerator='tpu'` for TPUs."
        )
    cores, reason = visible_core_count(env)
    if cores:
        return Platform(NEURON, cores, reason)
    raise NeuronUnavailableError(
        f"`accelerator='neuron'` found no NeuronCores: looked for Neuron devices under "
        f"{NEURON_SYSFS_ROOT} and {NEURON_DEV_GLOB} "
        "(is this a trn1/trn2/inf2 instance with the Neuron driver loaded?). To run the same code on this machine's "
        "CPU through XLA, set the environment variable PJRT_DEVICE=CPU (e.g. `PJRT_DEVICE=CPU python train.py`)."
    )
