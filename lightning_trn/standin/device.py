"""The `torch.neuron` device module of the stand-in: what PyTorch and Lightning look up by device name.

Mirrors the parts of `torch.cuda` that generic code reaches through `torch.get_device_module("neuron")`:
device selection, seeding, memory statistics, and stream/event stubs (the stand-in is synchronous).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

DeviceLike = int | str | torch.device | None

_ext: Any = None  # the compiled extension, set by `lightning_trn.standin.load`


def _index(device: DeviceLike) -> int:
    """The device index `device` names (the current device when it names none)."""
    if device is None:
        return _ext.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "neuron":
        raise ValueError(f"Expected a neuron device, got {device}.")
    return _ext.current_device() if device.index is None else device.index


def is_available() -> bool:
    return _ext is not None and _ext.device_count() > 0


def is_initialized() -> bool:
    return _ext is not None


def _lazy_init() -> None:
    """Nothing to initialise lazily: the stand-in is ready once loaded."""


def _is_in_bad_fork() -> bool:
    """Whether this process was forked after the parent used the device: then it may not (use 'spawn')."""
    return _ext.in_bad_fork()


def device_count() -> int:
    """Devices the stand-in offers (`LIGHTNING_TRN_STANDIN_DEVICES`, default 1)."""
    return _ext.device_count()


def current_device() -> int:
    return _ext.current_device()


def set_device(device: DeviceLike) -> None:
    _ext.set_device(_index(device))


def get_device_name(device: DeviceLike = None) -> str:
    return f"neuron stand-in (host memory, CPU kernels) #{_index(device)}"


class device:
    """Context manager that makes `device` current and restores the previous one (used by `torch.load`)."""

    def __init__(self, device: DeviceLike) -> None:
        self.idx = _index(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = _ext.current_device()
        _ext.set_device(self.idx)

    def __exit__(self, *exc: object) -> None:
        _ext.set_device(self.prev_idx)


def synchronize(device: DeviceLike = None) -> None:
    """Wait for the device: the stand-in runs every op before returning, so there is nothing to wait for, but the
    wait is counted as the host sync it would be on an asynchronous device (`counters()["host_syncs"]`)."""
    _index(device)
    _ext.synchronize()


# --- random numbers: each device has its own generator, which device ops draw from.
def default_generator(device: DeviceLike = None) -> torch.Generator:
    return _ext.default_generator(_index(device))


def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator().seed()


def seed_all() -> None:
    seed = default_generator(0).seed()
    for i in range(1, device_count()):
        default_generator(i).manual_seed(seed)


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device: DeviceLike = None) -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: DeviceLike = None) -> None:
    default_generator(device).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


# --- mixed precision
def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes `torch.autocast("neuron", dtype=...)` accepts."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# --- memory: the allocator is a c10::DeviceAllocator, so torch.accelerator's memory API reads it.
def memory_stats(device: DeviceLike = None) -> dict[str, Any]:
    return torch.accelerator.memory_stats(_index(device))


def memory_allocated(device: DeviceLike = None) -> int:
    return torch.accelerator.memory_allocated(_index(device))


def max_memory_allocated(device: DeviceLike = None) -> int:
    return torch.accelerator.max_memory_allocated(_index(device))


def memory_reserved(device: DeviceLike = None) -> int:
    return torch.accelerator.memory_reserved(_index(device))


def max_memory_reserved(device: DeviceLike = None) -> int:
    return torch.accelerator.max_memory_reserved(_index(device))


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    torch.accelerator.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device: DeviceLike = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_index(device))


def empty_cache() -> None:
    """Nothing is cached: freed device memory goes straight back to the host."""


# --- streams and events: one synchronous stream per device; events record host time.
def Stream(device: DeviceLike = None, priority: int = 0) -> torch.Stream:
    """A stream on the stand-in (all work on a device runs in order, at once); capitalised like `torch.cuda.Stream`,
    whose interface device modules share."""
    return torch.Stream(device=torch.device("neuron", _index(device)), priority=priority)


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:
    """An event on the stand-in (capitalised like `torch.cuda.Event`); `elapsed_time` measures host time between two
    records."""
    return torch.Event(
        torch.device("neuron"), enable_timing=enable_timing, blocking=blocking, interprocess=interprocess
    )


def current_stream(device: DeviceLike = None) -> torch.Stream:
    return torch.accelerator.current_stream(_index(device))


default_stream = current_stream


def set_stream(stream: torch.Stream) -> None:
    """Streams are all the same on the stand-in: nothing to switch."""


@contextmanager
def stream(stream: torch.Stream | None) -> Iterator[None]:
    yield
