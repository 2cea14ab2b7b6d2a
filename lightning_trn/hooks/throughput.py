"""Throughput and MFU on NeuronCores through Lightning's own `ThroughputMonitor` (Trainer and Fabric).

Lightning's `get_available_flops` knows CUDA GPUs and TPUs only (for an `xla` device it asks the TPU metadata
server), and `_plugin_to_compute_dtype` reads any precision plugin it does not know as float32. At
`import lightning_trn` both are wrapped, version-guarded, in `lightning.fabric.utilities.throughput` and in the
Trainer's callback module: a NeuronCore device gets its dense peak from `PEAK_FLOPS` below and a Neuron precision
plugin its compute dtype; every other device and plugin goes to Lightning's originals unchanged. Measuring adds no
host sync: `ThroughputMonitor` reads the host clock and the batch's shape, never a device value.

Under tensor parallelism the devices of a group work on one batch together, but the Trainer's `ThroughputMonitor`
counts every process as a replica (`world_size`): samples, tokens and FLOPs would be counted once per device of the
group, and MFU measured against one device's peak. Its `setup` is wrapped too, so each tensor-parallel group counts
once: the totals are over `world_size / tp` replicas, the `device/*` rates are per group, and MFU is the group's
FLOP/s over the group's peak (`tp` devices).

TorchTitan reports tokens/s and FLOP/s per device (its `tps` and `tflops`) with MFU; on Trainium a device (a process)
is a logical core of one or more physical NeuronCores, several to a chip. On a Neuron run whose chip is known the
monitor adds `chip/items_per_sec`, `core/items_per_sec`, `chip/flops_per_sec` and `core/flops_per_sec` (items are the
recipe's tokens): the per-replica rates spread over the replica's devices (a tensor-parallel group counted once), then
per physical core and per chip (`CORES_PER_CHIP`). `device/mfu` is already TorchTitan's MFU: a ratio, the same per
device, core or chip.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_trn.hooks.registry import lightning_version_tested
from lightning_trn.runtime import NeuronUnavailableError, get_runtime
from lightning_trn.runtime.discovery import LNC_DEVICE_CORES, logical_core_config

#: `LIGHTNING_TRN_CHIP=trn1|trn2|trn3`: the chip whose peak MFU is measured against where it cannot be read from the
#: host (a container without the Neuron sysfs), or, on XLA:CPU / the stand-in, to compare with a chip's peak
CHIP_ENV = "LIGHTNING_TRN_CHIP"

#: Dense peak FLOP/s of one *physical* NeuronCore by chip and compute dtype, from AWS's Neuron architecture pages
#: (docs/operations.md quotes them): NeuronCore-v2 (Trn1) 190 BF16 / 47.5 FP32 TFLOPS per 2-core chip;
#: NeuronCore-v3 (Trn2) 79 BF16 TFLOPS per core (the chip's 181 FP32 / 8 cores); NeuronCore-v4 (Trn3) 79 BF16 and
#: 20 FP32 TFLOPS per core. A logical core (Trn2/Trn3, `NEURON_LOGICAL_NC_CONFIG`, default 2) is that many cores.
PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "trn1": {torch.bfloat16: 95e12, torch.float16: 95e12, torch.float32: 23.75e12},
    "trn2": {torch.bfloat16: 79e12, torch.float16: 79e12, torch.float32: 181e12 / 8},
    "trn3": {torch.bfloat16: 79e12, torch.float16: 79e12, torch.float32: 20e12},
}


#: physical NeuronCores per chip, from the same pages: Trainium 2, Trainium2 8, Trainium3 8
CORES_PER_CHIP = {"trn1": 2, "trn2": 8, "trn3": 8}


def peak_flops(chip: str, dtype: torch.dtype, cores_per_device: int = 1) -> float | None:
    """Dense peak FLOP/s of one device (one process) on `chip` in `dtype`; `cores_per_device`: physical
    NeuronCores per logical core. None for a dtype the table lacks."""
    if chip not in PEAK_FLOPS:
        raise ValueError(f"Unknown Neuron chip {chip!r}: expected one of {', '.join(PEAK_FLOPS)}.")
    per_core = PEAK_FLOPS[chip].get(dtype)
    return None if per_core is None else per_core * cores_per_device


@functools.cache  # said once per process
def _say_no_peak(platform: str) -> None:
    rank_zero_warn(
        f"lightning_trn: no peak FLOP/s for {platform}, so ThroughputMonitor reports throughput without MFU. On a "
        f"Neuron host the chip is read from the driver's sysfs; set {CHIP_ENV}=trn1|trn2|trn3 to measure against a "
        "chip's peak anyway."
    )


def chip_and_cores() -> tuple[str, int] | None:
    """The chip this process runs on (`CHIP_ENV`, else the driver's) and its physical NeuronCores per process (per
    logical core), or None where the chip is unknown."""
    chip = os.environ.get(CHIP_ENV, "").strip().lower() or get_runtime().chip()
    if not chip:
        return None
    # Trn2/Trn3: the validated NEURON_LOGICAL_NC_CONFIG, else the runtime's default (2) for 8-core devices
    return chip, 1 if chip == "trn1" else logical_core_config(counts=[LNC_DEVICE_CORES])


def device_peak_flops(dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of this process's NeuronCore in `dtype`, or None (said once) where the chip is unknown."""
    found = chip_and_cores()
    if found is None:
        _say_no_peak(get_runtime().describe_platform())
        return None
    chip, cores = found
    return peak_flops(chip, dtype, cores)


def _is_neuron_device(device: torch.device) -> bool:
    """Whether `device` is lightning_trn's: the runtime's device type on a platform lightning_trn runs on. Other
    device types are answered without choosing a backend."""
    if device.type not in ("xla", "neuron"):
        return False
    try:
        runtime = get_runtime()
        runtime.detect_platform()  # raises where lightning_trn has no platform (not installed, no device)
    except (NeuronUnavailableError, ValueError):
        return False
    return device.type == runtime.device_type


def _available_flops(original: Callable[..., int | None]) -> Callable[..., int | None]:
    @functools.wraps(original)
    def get_available_flops(device: torch.device, dtype: torch.dtype | str) -> int | None:
        if not _is_neuron_device(device):
            return original(device, dtype)
        peak = device_peak_flops(dtype) if isinstance(dtype, torch.dtype) else None
        return None if peak is None else int(peak)

    return get_available_flops


def _compute_dtype(original: Callable[[Any], torch.dtype]) -> Callable[[Any], torch.dtype]:
    from lightning_trn.core.precision import NeuronPrecisionCore

    @functools.wraps(original)
    def plugin_to_compute_dtype(plugin: Any) -> torch.dtype:
        if isinstance(plugin, NeuronPrecisionCore):
            return plugin.compute_dtype
        return original(plugin)

    return plugin_to_compute_dtype


def tensor_parallel_size(pl_module: Any) -> int:
    """Devices per tensor-parallel group: the size of the `tensor_parallel` dimension of the module's device mesh (as
    Lightning's `ModelParallelStrategy` names it), 1 without one."""
    mesh = getattr(pl_module, "device_mesh", None)
    if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh["tensor_parallel"].size()


def per_chip_and_core(throughput: Any, devices_per_replica: int, cores_per_device: int, chip: str) -> None:
    """Add the `chip/` and `core/` rates to what `throughput.compute` returns (module docstring): a replica's
    `device/` rates over its `devices_per_replica` devices of `cores_per_device` physical cores each."""
    compute = throughput.compute
    separator = throughput.separator
    per_core = 1 / (devices_per_replica * cores_per_device)
    scales = {"core": per_core, "chip": per_core * CORES_PER_CHIP[chip]}

    @functools.wraps(compute)
    def with_chip_and_core(*args: Any, **kwargs: Any) -> dict[str, Any]:
        metrics = compute(*args, **kwargs)
        for rate in ("items_per_sec", "flops_per_sec"):
            replica = metrics.get(f"device{separator}{rate}")
            if replica is not None:
                metrics.update({f"{unit}{separator}{rate}": replica * scale for unit, scale in scales.items()})
        return metrics

    throughput.compute = with_chip_and_core


def _monitor_setup(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def setup(self: Any, trainer: Any, pl_module: Any, stage: str) -> None:
        before = dict(self._throughputs)
        original(self, trainer, pl_module, stage)
        tp = tensor_parallel_size(pl_module)
        found = chip_and_cores() if _is_neuron_device(trainer.strategy.root_device) else None
        for key, throughput in self._throughputs.items():
            if before.get(key) is throughput:  # made by an earlier setup: already counted per group
                continue
            if tp > 1:
                throughput.world_size = trainer.world_size // tp
                if throughput.available_flops:
                    throughput.available_flops *= tp
            if found is not None:
                per_chip_and_core(throughput, tp, found[1], found[0])

    return setup


#: (module, attribute, wrapper): the functions `ThroughputMonitor` calls, in Fabric's and the Trainer's modules, and
#: the Trainer's `ThroughputMonitor.setup`
_WRAPPED: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    ("lightning.fabric.utilities.throughput", "get_available_flops", _available_flops),
    ("lightning.fabric.utilities.throughput", "_plugin_to_compute_dtype", _compute_dtype),
    ("lightning.pytorch.callbacks.throughput_monitor", "get_available_flops", _available_flops),
    ("lightning.pytorch.callbacks.throughput_monitor", "_plugin_to_compute_dtype", _compute_dtype),
    ("lightning.pytorch.callbacks.throughput_monitor", "ThroughputMonitor.setup", _monitor_setup),
)


def install_throughput_hooks() -> None:
    """Wrap the functions in `_WRAPPED` (once; skipped where the Lightning version is untested or lacks one)."""
    import importlib

    if not lightning_version_tested():
        return
    for module_name, attribute, wrapper in _WRAPPED:
        owner: Any = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name, None)
        if original is None or getattr(original, "_lightning_trn", False):
            continue
        wrapped = wrapper(original)
        wrapped._lightning_trn = True
        setattr(owner, name, wrapped)
