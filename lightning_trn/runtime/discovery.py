"""Find out, without importing torch_xla or starting a runtime, which device platform this process will use.

Everything here reads the environment and the file system only, so it is cheap and safe to call from the
launching process before worker processes claim NeuronCores.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

#: Where the Neuron driver exposes one directory per Neuron device (Neuron sysfs user guide).
NEURON_SYSFS_ROOT = "/sys/devices/virtual/neuron_device"
#: Device nodes the Neuron driver creates, one per Neuron device.
NEURON_DEV_GLOB = "/dev/neuron[0-9]*"
#: NeuronCores per Neuron device when sysfs does not say (Trainium1 / Inferentia2).
DEFAULT_CORES_PER_DEVICE = 2
#: how many physical NeuronCores make one logical core (Trainium2/3; the Neuron runtime reads it)
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
#: its default on Trainium2/3 (a trn2.48xlarge shows 64 of its 128 physical cores)
DEFAULT_LNC = 2
#: physical cores per Trainium2/3 device (NeuronCore-v3/v4); Trainium1 and Inferentia2 devices have 2
LNC_DEVICE_CORES = 8

NEURON = "NEURON"
CPU = "CPU"

#: the first device's chip name (Neuron driver sysfs: "Trainium1", "Trainium2", "Trainium3", "Inferentia2")
CHIP_NAME_FILE = os.path.join(NEURON_SYSFS_ROOT, "neuron0", "info", "architecture", "device_name")
#: the loaded Neuron driver's version (the kernel's module sysfs)
DRIVER_VERSION_FILE = "/sys/module/neuron/version"
#: the Neuron runtime library (`aws-neuronx-runtime-lib`)
RUNTIME_LIBRARY = "/opt/aws/neuron/lib/libnrt.so.1"
#: Python packages whose versions a health check reports, when installed
VERSIONED_PACKAGES = ("torch", "torch-xla", "torch-neuronx", "libneuronxla", "neuronx-cc", "lightning", "lightning-trn")


class NeuronUnavailableError(RuntimeError):
    """Raised when `accelerator="neuron"` is requested but no usable device platform is present."""


@dataclass(frozen=True)
class Platform:
    """The device platform a process will run on and how many devices it may use."""

    kind: str  # NEURON or CPU
    device_count: int
    reason: str  # where the count came from, for messages
    #: how a user makes more devices visible, for messages
    widen: str = "widen NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES"


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


def _device_core_counts() -> list[int]:
    """Each Neuron device's sysfs `core_count` (physical NeuronCores), else 2 per device node."""
    counts = []
    for device_dir in sorted(glob.glob(os.path.join(NEURON_SYSFS_ROOT, "neuron[0-9]*"))):
        try:
            with open(os.path.join(device_dir, "core_count")) as f:
                counts.append(int(f.read().strip()))
        except (OSError, ValueError):
            counts.append(DEFAULT_CORES_PER_DEVICE)
    return counts or [DEFAULT_CORES_PER_DEVICE] * len(glob.glob(NEURON_DEV_GLOB))


def physical_core_count() -> int:
    """NeuronCores on this host: the sum of each device's sysfs `core_count`, else devices x 2."""
    return sum(_device_core_counts())


def logical_core_config(env: Mapping[str, str] | None = None, counts: list[int] | None = None) -> int:
    """Physical NeuronCores per logical core on Trainium2/3 devices: `NEURON_LOGICAL_NC_CONFIG`, else the runtime's
    default of 2 there. Trainium1 and Inferentia2 have no logical grouping (1). `counts`: `_device_core_counts()`."""
    env = os.environ if env is None else env
    value = env.get(LNC_ENV, "").strip()
    if not value:
        counts = _device_core_counts() if counts is None else counts
        return DEFAULT_LNC if any(c >= LNC_DEVICE_CORES for c in counts) else 1
    if value not in ("1", "2"):
        raise ValueError(
            f"Invalid {LNC_ENV}={value!r}: the Neuron runtime accepts 1 or 2 (physical cores per logical NeuronCore)."
        )
    return int(value)


def visible_core_count(env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Logical NeuronCores this job may use, honouring `NEURON_RT_VISIBLE_CORES` (logical core ids) then
    `NEURON_RT_NUM_CORES`. A Trainium2/3 device (8 physical cores in sysfs) counts 8 / `logical_core_config()`;
    devices with fewer cores (Trainium1, Inferentia2) count as they are."""
    env = os.environ if env is None else env
    counts = _device_core_counts()
    lnc = logical_core_config(env, counts)
    logical = sum(c // lnc if c >= LNC_DEVICE_CORES else c for c in counts)
    visible = env.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if visible and logical:
        return len(parse_core_range(visible)), f"NEURON_RT_VISIBLE_CORES={visible}"
    num = env.get("NEURON_RT_NUM_CORES", "").strip()
    if num and num != "0" and logical:
        return min(int(num), logical), f"NEURON_RT_NUM_CORES={num}"
    physical = sum(counts)
    if logical == physical:
        return logical, f"{logical} NeuronCores found under {NEURON_SYSFS_ROOT}"
    return logical, f"{logical} logical NeuronCores ({physical} physical under {NEURON_SYSFS_ROOT}, {LNC_ENV}={lnc})"


def detect_platform(env: Mapping[str, str] | None = None) -> Platform:
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
        return Platform(
            CPU,
            os.cpu_count() or 1,
            "PJRT_DEVICE=CPU (XLA:CPU, one device per process)",
            "on XLA:CPU run at most one process per CPU core",
        )
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


def neuron_chip() -> str | None:
    """This host's Trainium generation ("trn1", "trn2", "trn3") from the driver's sysfs; None when there is none."""
    try:
        with open(CHIP_NAME_FILE) as f:
            name = f.read().strip().lower()
    except OSError:
        return None
    match = re.fullmatch(r"trainium(\d+)", name)
    return f"trn{match.group(1)}" if match else None


def software_versions() -> dict[str, str]:
    """Versions of the installed Neuron and PyTorch pieces: Python packages, the driver and the runtime library."""
    versions = {}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        with open(DRIVER_VERSION_FILE) as f:
            versions["neuron driver"] = f.read().strip()
    except OSError:
        versions["neuron driver"] = "not loaded"
    library = os.path.realpath(RUNTIME_LIBRARY)
    versions["neuron runtime"] = os.path.basename(library) if os.path.exists(library) else "not installed"
    return versions
