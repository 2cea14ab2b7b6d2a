"""0-dim tensors placed on a Neuron device as device buffers, never graph constants, so a step compiles once.

torch_xla keeps a 0-dim tensor holding 0 or +-1 that was moved to the device with `.to()` (a torchmetrics state, a
Lightning `_ResultMetric` sum, a module's step counter) as a graph constant, and the first step that updates it
compiles a graph with the constant baked in, the next ones another. `place_scalars` uploads them as buffers before a
module moves (the strategies' moves, and the logging hook's `_ResultMetric.to`), and keeps each metric's host
defaults for `Metric.reset` (`lightning_trn.hooks.metric_states`).
"""

from __future__ import annotations

import weakref
from typing import Any, TypeGuard

import torch
from torch.nn import Module

from lightning_trn.runtime import DeviceRuntime, get_runtime

#: device types of the Neuron backends (torch_xla's, and TorchNeuron's native device)
NEURON_DEVICE_TYPES = ("xla", "neuron")
#: id(metric) -> host copies of its tensor defaults, taken before it moved to a Neuron device; dropped with the
#: metric. Not a metric attribute (Lightning's `_ResultMetric.to` moves every tensor in the instance's `__dict__`,
#: and pickles would carry them), nor a weak-key dictionary (a metric's hash changes with its states).
_HOST_DEFAULTS: dict[int, dict[str, torch.Tensor]] = {}


def host_defaults(metric: Any) -> dict[str, torch.Tensor] | None:
    """The host copies of `metric`'s tensor defaults that `place_scalars` kept (None: it never moved a metric)."""
    return _HOST_DEFAULTS.get(id(metric))


def _remember_host_defaults(metric: Module, host: dict[str, torch.Tensor]) -> None:
    if id(metric) not in _HOST_DEFAULTS:
        weakref.finalize(metric, _HOST_DEFAULTS.pop, id(metric), None)
    _HOST_DEFAULTS.setdefault(id(metric), {}).update(host)


def metrics_of(module: Module) -> list[Any]:
    """The torchmetrics metrics in `module` (itself included), child metrics too."""
    try:
        from torchmetrics import Metric
    except ImportError:  # no torchmetrics, no metric states
        return []
    return [m for m in module.modules() if isinstance(m, Metric)]


def _host_scalar(tensor: Any) -> TypeGuard[torch.Tensor]:
    return isinstance(tensor, torch.Tensor) and tensor.dim() == 0 and tensor.device.type == "cpu"


def place_scalars(module: Module, device: torch.device, runtime: DeviceRuntime | None = None) -> None:
    """Before `module` moves to `device`: put its 0-dim host tensors (parameters, buffers, metric states and
    defaults) there as device buffers, and remember each metric's host defaults for `reset`. `module.to(device)`
    then moves the rest as usual (and leaves these where they are)."""
    runtime = runtime or get_runtime()

    def upload(tensor: torch.Tensor) -> torch.Tensor:
        return runtime.to_device([tensor], device)[0]

    for submodule in module.modules():
        stores: tuple[dict[str, Any], ...] = (submodule._parameters, submodule._buffers)
        for store in stores:
            for name, tensor in store.items():
                if _host_scalar(tensor):
                    moved = upload(tensor)
                    is_parameter = isinstance(tensor, torch.nn.Parameter)
                    store[name] = torch.nn.Parameter(moved, tensor.requires_grad) if is_parameter else moved
    for metric in metrics_of(module):
        defaults = metric._defaults
        host = {
            name: d.detach().clone()
            for name, d in defaults.items()
            if isinstance(d, torch.Tensor) and d.device.type == "cpu"
        }
        if host:
            _remember_host_defaults(metric, host)
        for name, default in defaults.items():
            if _host_scalar(getattr(metric, name)):
                setattr(metric, name, upload(getattr(metric, name)))
            if _host_scalar(default):
                defaults[name] = upload(default)
