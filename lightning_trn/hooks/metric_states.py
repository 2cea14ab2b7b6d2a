"""Metric states that enter every graph as inputs, never as constants (issue 19).

torch_xla keeps a 0-dim tensor holding 0 or +-1 that was moved to the device with `.to()` (a torchmetrics state, a
Lightning `_ResultMetric` sum, a module's step counter) as a graph constant, and a `reset()` clone of one is a
constant again. The first step that updates it compiles a graph with the constant baked in; every later step takes
the previous step's result as an input: a second compile of the whole step, in every loop, for nothing.

So in Neuron runs 0-dim tensors go to the device as device buffers (`DeviceRuntime.to_device`) when a module or a
logged result first moves there, each metric keeps host copies of its defaults, and `Metric.reset` (hooked by
`lightning_trn.hooks.registry`) uploads those instead of cloning on the device. States then hold the values
torchmetrics' own `reset` gives them, in buffers the steady-state graph already takes as inputs.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch.nn import Module

from lightning_trn.runtime import DeviceRuntime, get_runtime

#: device types of the Neuron backends (torch_xla's, and TorchNeuron's native device)
NEURON_DEVICE_TYPES = ("xla", "neuron")
#: id(metric) -> host copies of its tensor defaults, taken before it moved to a Neuron device; dropped with the
#: metric. Not a metric attribute (Lightning's `_ResultMetric.to` moves every tensor in the instance's `__dict__`,
#: and pickles would carry them), nor a weak-key dictionary (a metric's hash changes with its states).
_HOST_DEFAULTS: dict[int, dict[str, torch.Tensor]] = {}


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


def _host_scalar(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dim() == 0 and tensor.device.type == "cpu"


def place_scalars(module: Module, device: torch.device, runtime: Optional[DeviceRuntime] = None) -> None:
    """Before `module` moves to `device`: put its 0-dim host tensors (parameters, buffers, metric states and
    defaults) there as device buffers, and remember each metric's host defaults for `reset`. `module.to(device)`
    then moves the rest as usual (and leaves these where they are)."""
    runtime = runtime or get_runtime()

    def upload(tensor: torch.Tensor) -> torch.Tensor:
        return runtime.to_device([tensor], device)[0]

    for submodule in module.modules():
        for store in (submodule._parameters, submodule._buffers):
            for name, tensor in store.items():
                if _host_scalar(tensor):
                    moved = upload(tensor)
                    is_parameter = isinstance(tensor, torch.nn.Parameter)
                    store[name] = torch.nn.Parameter(moved, tensor.requires_grad) if is_parameter else moved
    for metric in metrics_of(module):
        defaults = metric._defaults
        host = {name: d.detach().clone() for name, d in defaults.items() if isinstance(d, torch.Tensor)
                and d.device.type == "cpu"}
        if host:
            _remember_host_defaults(metric, host)
        for name, default in defaults.items():
            if _host_scalar(getattr(metric, name)):
                setattr(metric, name, upload(getattr(metric, name)))
            if _host_scalar(default):
                defaults[name] = upload(default)


def _resettable(metric: Any) -> list[str]:
    """States of `metric` on a Neuron device whose default has a matching host copy."""
    host = _HOST_DEFAULTS.get(id(metric))
    if not host:
        return []
    names = []
    for name, default in metric._defaults.items():
        copy, state = host.get(name), getattr(metric, name, None)
        if (isinstance(default, torch.Tensor) and copy is not None and isinstance(state, torch.Tensor)
                and state.device.type in NEURON_DEVICE_TYPES
                and copy.shape == default.shape and copy.dtype == default.dtype):
            names.append(name)
    return names


def reset_from_host(reset: Any) -> Optional[Callable[[Any], None]]:
    """Hook replacing `torchmetrics.Metric.reset`: after torchmetrics' reset, states on a Neuron device get the
    metric's host defaults uploaded as device buffers (one upload per state) instead of device clones."""
    if not callable(reset):
        return None

    def reset_uploading_defaults(self: Any) -> None:
        reset(self)
        names = _resettable(self)
        devices = {getattr(self, name).device for name in names}
        if len(devices) != 1:  # nothing to do, or states spread over devices: torchmetrics' clones stand
            return
        host = _HOST_DEFAULTS[id(self)]
        for name, tensor in zip(names, get_runtime().to_device([host[name] for name in names], devices.pop())):
            setattr(self, name, tensor)

    return reset_uploading_defaults


def _tensors_of(state: Any) -> list[Any]:
    """A metric state's tensors: the state itself, or the items of a list state (`dist_reduce_fx="cat"`)."""
    return state if isinstance(state, list) else [state]


def _epoch_states(results: Any) -> list[tuple[Any, str, Any]]:
    """(owner, state name, value) of every state on a Neuron device that Lightning's epoch-end values of `results`
    are computed from: the sums of logged tensors, and the states of logged metrics (with their child metrics)."""
    states = []
    for _, result_metric in results.valid_items():
        if not result_metric.meta.on_epoch or result_metric._computed is not None:
            continue
        owners = [result_metric] if result_metric.is_tensor else metrics_of(result_metric.value)
        for owner in owners:
            for name in owner._defaults:
                tensors = _tensors_of(getattr(owner, name))
                if tensors and all(isinstance(t, torch.Tensor) and t.device.type in NEURON_DEVICE_TYPES
                                   for t in tensors):
                    states.append((owner, name, getattr(owner, name)))
    return states


@contextmanager
def epoch_values_on_host(results: Any, runtime: DeviceRuntime) -> Iterator[None]:
    """While Lightning computes epoch-end values (means, `Metric.compute`): each state they come from is a host copy,
    all fetched in one transfer, so they are computed on the host instead of as small graphs that each compile and
    are read one by one. The device states are back afterwards, for Lightning's reset."""
    states = _epoch_states(results)
    flat = [t for _, _, value in states for t in _tensors_of(value)]
    host = iter(runtime.to_host(flat))
    for owner, name, value in states:
        setattr(owner, name, [next(host) for _ in value] if isinstance(value, list) else next(host))
    try:
        yield
    finally:
        for owner, name, value in states:
            setattr(owner, name, value)
