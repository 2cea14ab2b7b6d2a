"""A CPU stand-in for TorchNeuron's native `neuron` device: develop and test Trn2/Trn3 code without hardware.

`import lightning_trn.standin` (or `LIGHTNING_TRN_STANDIN=1` before `import lightning_trn`) compiles a small C++
PrivateUse1 extension once, names the device `neuron`, registers `torch.neuron`, autocast for the device and a
`neuron` process-group backend. Then `torch.randn(2, device="neuron")`, `torch.autocast("neuron")` and
`dist.init_process_group("neuron")` work on any Linux machine with torch 2.13 and a C++ compiler.

It is a development tool, never loaded on a real Neuron host. It differs from the real device: it runs every op
at once with exact CPU math and every dtype, where TorchNeuron compiles, runs asynchronously and has op-coverage
gaps. What it does prove: device placement, dtypes under autocast, device->host reads (counted, and refused in
`strict()` mode), which ops a real device would have to support (`fallback_counts()`), what an op without a device
kernel costs (`host_ops()`: its copies become counted transfers), and distributed plumbing.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from lightning_trn.runtime.base import autograd_lacks_device_worker
from lightning_trn.runtime.discovery import physical_core_count
from lightning_trn.standin._build import StandinError

#: Environment variable: how many `neuron` devices the stand-in offers (default 1).
DEVICES_ENV = "LIGHTNING_TRN_STANDIN_DEVICES"
#: Environment variable: comma-separated ops (`aten::median,aten::nonzero`) to run as CPU-fallback ops (`host_ops`).
HOST_OPS_ENV = "LIGHTNING_TRN_STANDIN_HOST_OPS"

_ext: ModuleType | None = None


def _refuse_on_neuron_host() -> None:
    backend = torch._C._get_privateuse1_backend_name()
    if backend != "privateuseone":
        raise StandinError(
            f"lightning_trn.standin cannot load: torch's custom device is already registered as {backend!r} "
            "(on a Neuron host TorchNeuron registers `neuron` itself). The stand-in is for machines without "
            "Trainium; unset LIGHTNING_TRN_STANDIN and use the real device."
        )
    if importlib.util.find_spec("torch_neuronx") is not None or physical_core_count() > 0:
        raise StandinError(
            "lightning_trn.standin refuses to load on a Neuron host (torch-neuronx is installed or the Neuron driver "
            "shows devices): it would shadow the real `neuron` device. Unset LIGHTNING_TRN_STANDIN and use "
            "TorchNeuron."
        )


def _device_count() -> int:
    value = os.environ.get(DEVICES_ENV, "1")
    try:
        count = int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= 64:
        raise StandinError(
            f"lightning_trn.standin: {DEVICES_ENV}={value!r} is not a device count. Set it to a whole number of "
            "devices from 1 to 64 (default 1), or unset it."
        )
    return count


def _check_op_names(names: Iterable[str]) -> list[str]:
    names = [name.strip() for name in names if name.strip()]
    bad = [name for name in names if not re.fullmatch(r"\w+::\w+", name)]
    if bad:
        raise StandinError(
            f"lightning_trn.standin: {bad} are not op names. Name ops as `namespace::name` without an overload, "
            f"e.g. `aten::median` (in {HOST_OPS_ENV}: comma-separated)."
        )
    return names


def _release_finished_backward_tasks() -> None:
    """At exit, make each device's autograd thread drop the last backward's task before Python finalizes.

    torch 2.13 stashes a Python object in the thread-local state that every backward captures
    (`torch.autograd.graph._engine_run_backward`). The device thread that ran the backward often drops the last
    reference after the caller has returned, taking the GIL; if Python is finalizing by then, it ends that thread
    inside a noexcept destructor and the process aborts ("terminate called without an active exception"). A backward
    per device run here without that stash is queued behind the last one, so once it returns the device threads
    hold nothing that needs Python.
    """
    from torch.autograd import Variable

    for index in range(torch.get_device_module("neuron").device_count()):
        leaf = torch.zeros((), device=torch.device("neuron", index), requires_grad=True)
        try:
            Variable._execution_engine.run_backward((leaf * 1,), (torch.ones_like(leaf),), False, False, (), True, True)
        except RuntimeError as err:  # autograd started before the stand-in: no device thread, nothing to release
            if not autograd_lacks_device_worker(err):
                raise
            return


def load() -> ModuleType:
    """Build (first time only) and install the stand-in; returns the `torch.neuron` module. Idempotent."""
    global _ext
    if _ext is not None:
        return torch.get_device_module("neuron")
    _refuse_on_neuron_host()
    count = _device_count()
    from lightning_trn.standin import _build, compile, device, distributed

    ext = _build.build()
    ext.set_device_count(count)
    ext.set_host_ops(_check_op_names(os.environ.get(HOST_OPS_ENV, "").split(",")))
    ext.register_hooks()
    torch.utils.rename_privateuse1_backend("neuron")
    device._ext = ext
    torch._register_device_module("neuron", device)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    distributed.register(ext)
    compile.register()
    atexit.register(_release_finished_backward_tasks)
    _ext = ext
    return torch.get_device_module("neuron")


def is_loaded() -> bool:
    """Whether this process runs the stand-in as its `neuron` device."""
    return _ext is not None


def _loaded() -> ModuleType:
    if _ext is None:
        raise StandinError("The neuron stand-in is not loaded: call lightning_trn.standin.load() first.")
    return _ext


def counters() -> dict[str, int]:
    """Device->host copies, host->device copies (`host_to_device_bytes`: the bytes copied from host tensors; host
    ops' results count as copies only), scalar reads (`.item()`) and host syncs since the last reset.

    Host syncs are the waits an asynchronous device would impose on the host: copies to the host that are not
    `non_blocking`, scalar reads and synchronize calls (`torch.neuron.synchronize()`, `torch.accelerator`'s, streams'
    and events'). The fallback's own copies are not counted: a real device would run those ops where the data is.
    """
    return _loaded().counters()


def fallback_counts() -> dict[str, int]:
    """Ops served by the CPU fallback since the last reset, by name (`aten::addmm.out`; structured ops arrive as
    their out= variant): the ops the stand-in runs on the host, to check against the ops TorchNeuron supports."""
    return dict(_loaded().fallback_counts())


def host_op_counts() -> dict[str, int]:
    """Calls of the ops made CPU-fallback ops (`host_ops`, `LIGHTNING_TRN_STANDIN_HOST_OPS`) since the last reset,
    by full name (`aten::median.dim_values`): what `get_runtime().metrics().cpu_fallbacks` reports on the stand-in."""
    return dict(_loaded().host_op_counts())


@contextmanager
def host_ops(names: Iterable[str]) -> Iterator[None]:
    """Inside the block, run the ops `names` (`aten::median`: every overload) as TorchNeuron runs ops it has no
    kernel for: on the host, with their argument and result copies counted as device->host / host->device transfers
    (refused in `strict()`) and each call counted in `host_op_counts()`."""
    ext = _loaded()
    previous = ext.set_host_ops(_check_op_names(names))
    try:
        yield
    finally:
        ext.set_host_ops(previous)


def reset_counters() -> None:
    _loaded().reset_counters()


@contextmanager
def strict() -> Iterator[None]:
    """Raise on any device->host read (`.item()`, `.cpu()`, printing, `if tensor:`) inside the block."""
    ext = _loaded()
    previous = ext.set_strict(True)
    try:
        yield
    finally:
        ext.set_strict(previous)


__all__ = [
    "StandinError",
    "counters",
    "fallback_counts",
    "host_op_counts",
    "host_ops",
    "is_loaded",
    "load",
    "reset_counters",
    "strict",
]

load()
