"""`DevicePrefetchLoader`: a DataLoader stand-in that delivers batches already on the XLA device."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from lightning_trn.runtime import DeviceRuntime


class DevicePrefetchLoader:
    """Iterates the wrapped DataLoader through the runtime's background prefetcher (`MpDeviceLoader` on XLA).

    Attribute reads (`dataset`, `sampler`, `batch_sampler`, `batch_size`, ...) and `len()` go to the wrapped
    loader, so Lightning's loops (epoch setting on samplers, length checks) keep working.
    """

    def __init__(self, dataloader: Any, device: torch.device, runtime: DeviceRuntime) -> None:
        self._loader = dataloader
        self._device = device
        self._runtime = runtime

    @property
    def wrapped(self) -> Any:
        """The DataLoader being prefetched."""
        return self._loader

    def __iter__(self) -> Iterator:
        return iter(self._runtime.prefetch(self._loader, self._device))

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_loader", "_device", "_runtime"):
            raise AttributeError(name)
        return getattr(self._loader, name)
