"""The device runtime layer: the only part of lightning_trn that talks to torch_xla or the Neuron runtime.

Two backends sit behind one interface: `XlaRuntime` (torch_xla: torch-neuronx 2.9 on Trn1, or XLA:CPU) and
`NativeRuntime` (TorchNeuron's native `neuron` device on Trn2/Trn3, or the CPU stand-in). Use `get_runtime()`;
never import torch_xla elsewhere in the package.
"""

from __future__ import annotations

from functools import lru_cache

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_trn.runtime.base import DeviceRuntime, RuntimeMetrics
from lightning_trn.runtime.discovery import (
    NEURON,
    NeuronUnavailableError,
    Platform,
    detect_platform,
    torch_xla_installed,
)
from lightning_trn.runtime.native import NativeRuntime
from lightning_trn.runtime.selection import BACKEND_ENV, select_backend
from lightning_trn.runtime.xla import XlaRuntime

_requested_backend: str | None = None


@lru_cache(maxsize=1)
def get_runtime() -> DeviceRuntime:
    """The process-wide runtime backend, chosen once (`lightning_trn.runtime.selection`) and said in one log line."""
    name, why = select_backend(_requested_backend)
    rank_zero_info(f"lightning_trn: {name} backend ({why}).")
    return NativeRuntime() if name == "native" else XlaRuntime()


def use_backend(name: str | None) -> DeviceRuntime:
    """Ask for backend `name` ("xla" / "native"; None: decide from the environment) and return it."""
    global _requested_backend
    if name != _requested_backend:
        _requested_backend = name
        get_runtime.cache_clear()
    return get_runtime()


def neuron_hardware_present() -> bool:
    """Whether this process would train on real NeuronCores (what `accelerator="auto"` asks): False on XLA:CPU, on the
    stand-in and where no Neuron stack is usable. Logs nothing and starts no device, since every "auto" Trainer asks."""
    try:
        name, _ = select_backend(_requested_backend)
        if name == "native":
            return NativeRuntime().on_neuron()
        return detect_platform().kind == NEURON
    except (NeuronUnavailableError, ValueError):
        return False


__all__ = [
    "BACKEND_ENV",
    "DeviceRuntime",
    "NativeRuntime",
    "NeuronUnavailableError",
    "Platform",
    "RuntimeMetrics",
    "XlaRuntime",
    "detect_platform",
    "get_runtime",
    "neuron_hardware_present",
    "select_backend",
    "torch_xla_installed",
    "use_backend",
]
