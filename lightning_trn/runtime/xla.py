"""torch_xla backend: Trainium/Inferentia through torch-neuronx, or XLA:CPU for development and CI.

torch_xla is imported lazily, inside the methods, so `import lightning_trn` works where it is not installed.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Optional

import torch

from lightning_trn.runtime.base import DeviceRuntime, RuntimeMetrics
from lightning_trn.runtime.discovery import CPU, NeuronUnavailableError, Platform, detect_platform, torch_xla_installed

log = logging.getLogger(__name__)

#: torch_xla counters named `aten::X` count ops run on the host. This one is `.item()` / `bool(tensor)`:
#: a host read of a device scalar, reported separately as a sync rather than as a missing lowering.
_SCALAR_READ_COUNTER = "aten::_local_scalar_dense"


def _import(module: str) -> ModuleType:
    """Import a torch_xla module, turning a missing install into the package's explanatory error."""
    if module in sys.modules:
        return sys.modules[module]
    if not torch_xla_installed():
        detect_platform()  # raises NeuronUnavailableError naming the fix
    import importlib

    return importlib.import_module(module)


class XlaRuntime(DeviceRuntime):
    """All calls into torch_xla go through here."""

    name = "xla"

    def __init__(self) -> None:
        self._platform: Optional[Platform] = None

    def is_installed(self) -> bool:
        return torch_xla_installed()

    def detect_platform(self) -> Platform:
        if self._platform is None:
            self._platform = detect_platform()
            if self._platform.kind == CPU:
                log.warning("lightning_trn: no NeuronCores found; running on XLA:CPU (PJRT_DEVICE=CPU).")
        return self._platform

    def device(self) -> torch.device:
        torch_xla = _import("torch_xla")
        return torch_xla.device()

    def sync(self, wait: bool = False) -> None:
        _import("torch_xla").sync(wait=wait)

    def prefetch(self, dataloader: Iterable, device: torch.device) -> Iterable:
        parallel_loader = _import("torch_xla.distributed.parallel_loader")
        return parallel_loader.MpDeviceLoader(dataloader, device)

    def memory_stats(self, device: torch.device) -> dict[str, Any]:
        xm = _import("torch_xla.core.xla_model")
        try:
            return dict(xm.get_memory_info(device))
        except RuntimeError:  # XLA:CPU: "GetAllocatorStats is not supported"
            return {}

    def metrics(self) -> RuntimeMetrics:
        met = _import("torch_xla.debug.metrics")

        def count(metric: str) -> int:
            data = met.metric_data(metric)
            return int(data[0]) if data else 0

        fallbacks = {}
        for name in met.counter_names():
            if name.startswith("aten::") and name != _SCALAR_READ_COUNTER:
                fallbacks[name] = int(met.counter_value(name) or 0)
        return RuntimeMetrics(
            compiles=count("CompileTime"),
            executions=count("ExecuteTime"),
            device_to_host=count("TransferFromDeviceTime"),
            host_to_device=count("TransferToDeviceTime"),
            scalar_reads=int(met.counter_value(_SCALAR_READ_COUNTER) or 0),
            cpu_fallbacks=fallbacks,
        )

    def autocast(self, dtype: torch.dtype) -> AbstractContextManager:
        _import("torch_xla")
        return torch.autocast("xla", dtype=dtype)

    def world_size(self) -> int:
        return int(_import("torch_xla.runtime").world_size())

    def supports_cross_process_collectives(self) -> bool:
        return self.detect_platform().kind != CPU
