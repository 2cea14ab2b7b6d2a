"""The `neuron` backend of `torch.distributed` on the stand-in: `dist.init_process_group("neuron")` as on TorchNeuron.

The backend is C++ (`csrc/distributed.cpp`), so every caller reaches it the way it reaches NCCL: DDP's reducer,
functional collectives (`torch.distributed._functional_collectives`), DTensor and FSDP2. Each collective runs with
gloo on zero-copy host aliases of the device tensors and has finished when it returns (no overlap with compute).

The first group of a multi-process job checks what TorchNeuron's `init_process_group` checks (its source snapshot,
`torch_neuronx/distributed/backend.py`): the Neuron runtime must not have started (no device tensor yet), and
`NEURON_RT_VISIBLE_CORES` is set to `LOCAL_RANK` when unset.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

BACKEND = "neuron"
#: TorchNeuron's assertion message when a device tensor exists before the first `neuron` process group
RUNTIME_STARTED = "Neuron runtime should not be initialized before the init_process_group."


def _create(ext: Any) -> Callable[[dist.Store, int, int, timedelta], Any]:
    """The backend's constructor for `register_backend`: a `neuron` process group over `ext`'s C++ backend."""
    first = [True]

    def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
        if first[0] and size > 1:  # the default group (created first): the job's processes
            first[0] = False
            if ext.runtime_initialized():
                raise AssertionError(
                    f"{RUNTIME_STARTED} (neuron stand-in, as TorchNeuron: create the process group before the first "
                    "neuron tensor)"
                )
            if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
                os.environ.setdefault("NEURON_RT_VISIBLE_CORES", os.environ["LOCAL_RANK"])
        world_size = dist.get_world_size() if dist.is_initialized() else size  # the default group is being made
        return ext.neuron_backend(dist.ProcessGroupGloo(store, rank, size, timeout), world_size)

    return create


def register(ext: Any) -> None:
    """Register the `neuron` backend for the `neuron` device (once per process)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create(ext), devices=["neuron"])
