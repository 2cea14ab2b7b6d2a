"""The `neuron` backend of `torch.distributed` on the stand-in: `dist.init_process_group("neuron")` as on TorchNeuron.

The backend is C++ (`csrc/distributed.cpp`), so every caller reaches it the way it reaches NCCL: DDP's reducer,
functional collectives (`torch.distributed._functional_collectives`), DTensor and FSDP2. Each collective runs with
gloo on zero-copy host aliases of the device tensors and has finished when it returns (no overlap with compute).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

BACKEND = "neuron"


def _create(ext: Any):
    def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
        return ext.neuron_backend(dist.ProcessGroupGloo(store, rank, size, timeout))

    return create


def register(ext: Any) -> None:
    """Register the `neuron` backend for the `neuron` device (once per process)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create(ext), devices=["neuron"])
