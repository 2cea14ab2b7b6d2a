"""`NeuronStrategyCore`: the device logic every Neuron strategy shares, the Trainer's (`NeuronStrategyMixin`) and
Fabric's (`lightning_trn.fabric`) alike: the runtime, portable checkpoints, moving a module without untying its
weights, and the device prefetcher."""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.utilities import find_shared_parameters, set_shared_parameters
from torch.nn import Module

from lightning_trn.core.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.device_loader import DevicePrefetchLoader
from lightning_trn.hooks.metric_states import place_scalars
from lightning_trn.runtime import DeviceRuntime, get_runtime

#: how many of the latest batches from the device prefetchers `delivered` recognises (Lightning's fetcher reads one
#: batch ahead, so the batch being transferred is the last or the second-to-last one delivered)
_RECENT_DELIVERIES = 4


class NeuronStrategyCore:
    """Mixed into the Trainer's and Fabric's Neuron strategies, before Lightning's strategy class."""

    _checkpoint_io: Optional[CheckpointIO]
    #: the name and description the strategy is registered under (the Trainer's and Fabric's registries alike)
    strategy_name: str
    strategy_description: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the latest batches this strategy's prefetchers handed out (already on the device)
        self._deliveries: deque = deque(maxlen=_RECENT_DELIVERIES)

    @property
    def runtime(self) -> DeviceRuntime:
        """The device runtime every device call goes through."""
        return get_runtime()

    @property
    def root_device(self) -> torch.device:
        """This process's NeuronCore: `xla:0` on XLA (each process sees only its own), natively `neuron:<local rank>`.
        """
        return self.runtime.device()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description)

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = NeuronCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    def _check_accelerator(self) -> None:
        from lightning_trn.accelerator import NeuronAccelerator

        accelerator = getattr(self, "accelerator", None)
        if not isinstance(accelerator, NeuronAccelerator):
            raise ValueError(
                f"{type(self).__name__} runs on NeuronCores or XLA:CPU only: use it with `accelerator='neuron'`, "
                f"found accelerator {type(accelerator).__name__}."
            )

    def setup_environment(self) -> None:
        self._check_accelerator()
        super().setup_environment()  # type: ignore[misc]

    def _move_keeping_ties(self, module: Module) -> None:
        """Move `module` to the device, keeping tied weights tied (moving between the host and the device creates new
        Parameters, one per module that holds a shared one), its 0-dim tensors as device buffers, not graph
        constants (`lightning_trn.hooks.metric_states`)."""
        shared = find_shared_parameters(module)
        place_scalars(module, self.root_device, self.runtime)  # type: ignore[attr-defined]
        module.to(self.root_device)  # type: ignore[attr-defined]
        set_shared_parameters(module, shared)

    def _prefetching(
        self, dataloader: object, position: Optional[Callable[[], int]] = None,
        before_batch: Optional[Callable[[], None]] = None,
    ) -> DevicePrefetchLoader:
        """`dataloader` with its batches copied to the device in the background while the previous step runs."""
        if isinstance(dataloader, DevicePrefetchLoader):
            return dataloader
        return DevicePrefetchLoader(
            dataloader, self.root_device, self.runtime, self._deliveries,  # type: ignore[attr-defined]
            position=position, before_batch=before_batch,
        )

    def _delivered(self, batch: Any) -> bool:
        """Whether `batch` is one of the latest the prefetchers handed out, so already on the device as it is."""
        return any(batch is delivered for delivered in self._deliveries)

    def _seed_device(self) -> None:
        """Make `seed_everything(s)` reach the device RNG (dropout, stochastic rounding): every rank gets the same
        seed, as Lightning seeds every rank's host RNG the same."""
        seed = os.environ.get("PL_GLOBAL_SEED")
        if seed is not None:
            self.runtime.manual_seed(int(seed))


class SingleDeviceCore:
    """Mixed into the Trainer's and Fabric's single-device Neuron strategies: one process, device 0 of the runtime's
    type (`xla:0`, or `neuron:0` natively)."""

    strategy_name = "neuron_single"
    strategy_description = "Single NeuronCore / XLA:CPU (lightning_trn)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, device=torch.device(get_runtime().device_type, 0), **kwargs)
