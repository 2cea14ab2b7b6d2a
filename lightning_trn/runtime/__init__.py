"""The device runtime layer: the only part of lightning_trn that talks to torch_xla or the Neuron runtime.

Use `get_runtime()`; never import torch_xla elsewhere in the package.
"""

from __future__ import annotations

from functools import lru_cache

from lightning_trn.runtime.base import DeviceRuntime, RuntimeMetrics
from lightning_trn.runtime.discovery import NeuronUnavailableError, Platform, detect_platform, torch_xla_installed
from lightning_trn.runtime.xla import XlaRuntime


@lru_cache(maxsize=1)
def get_runtime() -> DeviceRuntime:
    """The process-wide runtime backend (torch_xla today)."""
    return XlaRuntime()


__all__ = [
    "DeviceRuntime",
    "NeuronUnavailableError",
    "Platform",
    "RuntimeMetrics",
    "XlaRuntime",
    "detect_platform",
    "get_runtime",
    "torch_xla_installed",
]
