"""Metric states that enter every graph as inputs, never as constants, so a step compiles once.

torch_xla keeps a 0-dim tensor holding 0 or +-1 that was moved to the device with `.to()` (a torchmetrics state, a
Lightning `_ResultMetric` sum, a module's step counter) as a graph constant, and a `reset()` clone of one is a
constant again. The first step that updates it compiles a graph with the constant baked in; every later step takes
the previous step's result as an input: a second compile of the whole step, in every loop, for nothing.

So in Neuron runs 0-dim tensors go to the device as device buffers (`lightning_trn.core.scalars.place_scalars`)
when a module or a logged result first moves there, each metric keeps host copies of its defaults, and
`Metric.reset` (hooked by `lightning_trn.hooks.registry`) uploads those instead of cloning on the device. States then
hold the values torchmetrics' own `reset` gives them, in buffers the steady-state graph already takes as inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_trn.core.scalars import NEURON_DEVICE_TYPES, host_defaults, metrics_of
from lightning_trn.runtime import DeviceRuntime, get_runtime


def _resettable(metric: Any) -> list[str]:
    """States of `metric` on a Neuron device whose default has a matching host copy."""
    host = host_defaults(metric)
    if not host:
        return []
    names = []
    for name, default in metric._defaults.items():
        copy, state = host.get(name), getattr(metric, name, None)
        if (
            isinstance(default, torch.Tensor)
            and copy is not None
            and isinstance(state, torch.Tensor)
            and state.device.type in NEURON_DEVICE_TYPES
            and copy.shape == default.shape
            and copy.dtype == default.dtype
        ):
            names.append(name)
    return names


def reset_from_host(reset: Any) -> Callable[[Any], None] | None:
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
        host = host_defaults(self)
        assert host is not None  # `_resettable` found names in it
        uploaded = get_runtime().to_device([host[name] for name in names], devices.pop())
        for name, tensor in zip(names, uploaded, strict=True):
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
                if tensors and all(
                    isinstance(t, torch.Tensor) and t.device.type in NEURON_DEVICE_TYPES for t in tensors
                ):
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
