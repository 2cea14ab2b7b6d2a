"""Lightning's end-of-run moves to the host in one device-to-host transfer (docs/job-economy.md).

`Trainer._teardown` moves the model, the optimizer states, the loops' logged results and the logged metrics to the
CPU, one `.cpu()` per tensor: on XLA one transfer each (60 for the MLP recipe, whose own work needs 31 in the whole
job), and torchmetrics' device probe in `Metric._apply` (`torch.zeros(1, device=metric.device)`) compiles a graph of
its own. While a Neuron run tears down (hooked by `lightning_trn.hooks.registry`), every device tensor Lightning is
about to move is copied to the host in one batched transfer first, and `HostCopies` hands those copies to Lightning's
own `.cpu()` / `.to("cpu")` calls, so Lightning's code runs unchanged and ends with the same CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch.overrides import TorchFunctionMode

from lightning_trn.core.scalars import NEURON_DEVICE_TYPES, metrics_of
from lightning_trn.runtime import DeviceRuntime

_MOVES = (torch.Tensor.cpu, torch.Tensor.to)
#: keyword arguments of a `.to()` that keep it a plain copy to the host
_PLAIN_TO_KWARGS = {"non_blocking", "copy"}


def _is_cpu(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def _plain_move_to_host(func: Callable, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether `func(*args, **kwargs)` is `tensor.cpu()` or `tensor.to(<cpu>)` with nothing else changed."""
    if func is torch.Tensor.cpu:
        return len(args) == 1 and not kwargs
    rest = dict(kwargs)
    device = args[1] if len(args) == 2 else rest.pop("device", None)
    return len(args) <= 2 and _is_cpu(device) and set(rest) <= _PLAIN_TO_KWARGS and not rest.get("copy", False)


class HostCopies(TorchFunctionMode):
    """While active, `.cpu()` / `.to("cpu")` / `.item()` of one of `tensors` (or of a `detach()` of one) is served by
    its host copy, all fetched in one transfer (a later move of the same tensor gets a clone, so no two holders share
    one copy), and `torch.zeros` on a Neuron device gives an uploaded tensor whose host copy is known, instead of a
    graph constant."""

    def __init__(self, runtime: DeviceRuntime, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._runtime = runtime
        unique = list({id(t): t for t in tensors}.values())
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            id(t): (t, host) for t, host in zip(unique, runtime.to_host(unique), strict=True)
        }
        self._handed_out: set[int] = set()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        entry = self._copies.get(id(args[0])) if args else None
        if entry is not None and entry[0] is args[0]:
            host = entry[1]
            if func is torch.Tensor.detach:  # Lightning reads logged values through `detach()`
                detached = func(*args, **kwargs)
                self._copies[id(detached)] = (detached, host)
                return detached
            if func is torch.Tensor.item:
                return host.item()
            if func in _MOVES and _plain_move_to_host(func, args, kwargs):
                if id(host) in self._handed_out:
                    return host.clone()
                self._handed_out.add(id(host))
                return host
        device = kwargs.get("device")
        if (
            func is torch.zeros
            and isinstance(device, (str, torch.device))
            and torch.device(device).type in NEURON_DEVICE_TYPES
        ):
            host = func(*args, **{**kwargs, "device": "cpu"})
            tensor = self._runtime.to_device([host], torch.device(device))[0]
            self._copies[id(tensor)] = (tensor, host)
            return tensor
        return func(*args, **kwargs)


def _on_device(tensor: torch.Tensor, found: list[torch.Tensor]) -> torch.Tensor:
    if tensor.device.type in NEURON_DEVICE_TYPES:
        found.append(tensor)
    return tensor


def teardown_tensors(trainer: Any) -> list[torch.Tensor]:
    """The device tensors `Trainer._teardown` moves to the host: the module's parameters, gradients, buffers and
    metric states, the optimizers' states, the loops' logged results and the logged metrics."""
    found: list[torch.Tensor] = []
    module = trainer.lightning_module
    if module is not None:
        for tensor in (*module.parameters(), *module.buffers()):
            _on_device(tensor, found)
            if tensor.grad is not None:
                _on_device(tensor.grad, found)
        for metric in metrics_of(module):
            apply_to_collection(dict(metric.__dict__), torch.Tensor, _on_device, found)
    for optimizer in trainer.optimizers:
        apply_to_collection(optimizer.state, torch.Tensor, _on_device, found)
    loops = (
        trainer.fit_loop.epoch_loop,
        trainer.fit_loop.epoch_loop.val_loop,
        trainer.validate_loop,
        trainer.test_loop,
    )
    for results in (loop._results for loop in loops):
        for result_metric in results.values():
            apply_to_collection(dict(result_metric.__dict__), torch.Tensor, _on_device, found)
    connector = trainer._logger_connector
    for logged in (connector._logged_metrics, connector._progress_bar_metrics, connector._callback_metrics):
        apply_to_collection(logged, torch.Tensor, _on_device, found)
    return found


def teardown_in_one_transfer(teardown: Any) -> Callable[[Any], None] | None:
    """Hook replacing `Trainer._teardown`: Lightning's teardown, its moves to the host served by `HostCopies`."""
    if not callable(teardown):
        return None

    def _teardown(self: Any) -> None:
        runtime = getattr(self.strategy, "runtime", None)
        if runtime is None:
            return teardown(self)
        with HostCopies(runtime, teardown_tensors(self)):
            return teardown(self)

    return _teardown
