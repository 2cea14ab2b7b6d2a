"""`NeuronStrategyCore`: the device logic every Neuron strategy shares, the Trainer's (`NeuronStrategyMixin`) and
Fabric's (`lightning_trn.fabric`) alike: the runtime, portable checkpoints with the run's random state, moving a
module without untying its weights, and the device prefetcher."""

from __future__ import annotations

import logging
import os
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.utilities import find_shared_parameters, set_shared_parameters
from torch.nn import Module

from lightning_trn.core.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.device_loader import BATCHES_YIELDED, DevicePrefetchLoader
from lightning_trn.core.random_state import (
    RANDOM_STATE_VERSION, base_device_seed, host_states, not_exact_notice, rank_entry, set_host_states, step_seed,
)
from lightning_trn.core.sharded_save import staged_directory
from lightning_trn.hooks.metric_states import place_scalars
from lightning_trn.runtime import DeviceRuntime, get_runtime

#: how many of the latest batches from the device prefetchers `delivered` recognises (Lightning's fetcher reads one
#: batch ahead, so the batch being transferred is the last or the second-to-last one delivered)
_RECENT_DELIVERIES = 4

log = logging.getLogger(__name__)

#: which submodules to checkpoint: a set of module classes, or a policy of torch's (`ModuleWrapPolicy`, a callable)
CheckpointingPolicy = Union[set[type[Module]], Callable[..., bool], Any]


class NeuronStrategyCore:
    """Mixed into the Trainer's and Fabric's Neuron strategies, before Lightning's strategy class.

    Args:
        activation_checkpointing_policy: checkpoint these submodules (e.g. `{Block}`), as Lightning's FSDPStrategy's
            argument of that name does (docs/memory.md).
    """

    _checkpoint_io: Optional[CheckpointIO]
    #: the name and description the strategy is registered under (the Trainer's and Fabric's registries alike)
    strategy_name: str
    strategy_description: str

    def __init__(
        self, *args: Any, activation_checkpointing_policy: Optional[CheckpointingPolicy] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._activation_checkpointing_policy = activation_checkpointing_policy
        #: the module the policy was applied to (once: the FSDP strategy applies it before sharding)
        self._checkpointed: Optional[Module] = None
        #: the latest batches this strategy's prefetchers handed out (already on the device)
        self._deliveries: deque = deque(maxlen=_RECENT_DELIVERIES)
        #: the run's base device seed; training batch i draws from `step_seed(_device_seed, i)`
        self._device_seed = 0

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

    def _apply_activation_checkpointing(self, module: Module) -> None:
        """Wrap the submodules `activation_checkpointing_policy` selects in torch's `checkpoint_wrapper`, with the
        helpers of Lightning's FSDPStrategy (so the policy means the same; a model already holding checkpoint
        wrappers is left alone, with a warning). State-dict keys do not change."""
        if self._activation_checkpointing_policy is None or module is self._checkpointed:
            return
        from lightning.fabric.strategies.fsdp import _activation_checkpointing_kwargs, _setup_activation_checkpointing

        kwargs = _activation_checkpointing_kwargs(None, self._activation_checkpointing_policy)
        _setup_activation_checkpointing(module, kwargs)
        self._checkpointed = module

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
        seed, as Lightning seeds every rank's host RNG the same. It is also the base of the per-batch seeds."""
        seed = os.environ.get("PL_GLOBAL_SEED")
        self._device_seed = base_device_seed(seed)
        if seed is not None:
            self.runtime.manual_seed(self._device_seed)

    def _seed_batch(self, batch_index: int) -> None:
        """Seed the device RNG for training batch `batch_index` of the run (`lightning_trn.core.random_state`)."""
        self.runtime.manual_seed(step_seed(self._device_seed, batch_index))

    def _neuron_precision(self) -> Any:
        """The strategy's precision plugin (the Trainer calls it `precision_plugin`, Fabric `precision`)."""
        raise NotImplementedError

    def _split_checkpoint(self, checkpoint: dict[str, Any], path: Any) -> tuple[dict[str, Any], Any]:
        """Called on every rank before rank 0 writes `checkpoint` to `path`: what rank 0 writes where (sharded
        ZeRO-1 checkpoints write each rank's part here)."""
        return checkpoint, path

    def _saves_sharded(self) -> bool:
        """Whether checkpoints are directories every rank writes part of."""
        return False

    def _save_destination(self, path: Any) -> AbstractContextManager[Any]:
        """Where this rank saves a checkpoint for `path`: `path` itself; for a sharded checkpoint a staging directory
        that replaces `path` atomically once every rank is done (`lightning_trn.core.sharded_save`)."""
        if self._saves_sharded():
            return staged_directory(path, self.global_rank, self.barrier)  # type: ignore[attr-defined]
        return nullcontext(path)

    def _after_update(self, optimizer: Any) -> None:
        """Hook after the optimizer's update, before the step's graph cut (ZeRO-1 gathers the parameters)."""

    def _gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (data-parallel strategies gather over the host group)."""
        return [obj]

    def _random_state_to_save(
        self, loaders: list[DevicePrefetchLoader], mid_epoch: Optional[bool], **extra: Any
    ) -> dict[str, Any]:
        """The checkpoint's `RANDOM_STATE_KEY` value: every rank's random state (called on every rank).

        `mid_epoch`: whether the run resumes inside the training loaders' current epoch (None: each loader says
        whether its iteration is under way). The host states are those of the first loader's epoch start then, the
        states now otherwise."""
        states = [loader.random_state(loader.in_epoch if mid_epoch is None else mid_epoch) for loader in loaders]
        host = next((state["host"] for state in states if state["host"] is not None), None)
        entry = {
            "host": host if host is not None else host_states(),
            "loaders": [{"generators": s["generators"], BATCHES_YIELDED: s[BATCHES_YIELDED]} for s in states],
            "device_seed": self._device_seed,
            **extra,
        }
        return {"version": RANDOM_STATE_VERSION, "ranks": self._gather_objects(entry)}

    def _restore_random_state(
        self, saved: Any, loaders: list[DevicePrefetchLoader], skip: bool = False
    ) -> Optional[dict[str, Any]]:
        """Put back this rank's random state from a checkpoint's `RANDOM_STATE_KEY` value (`saved`, None if absent);
        returns the rank's entry, or None after logging once why the resume is not exact."""
        entry, reason = rank_entry(saved, self.global_rank, self.world_size)  # type: ignore[attr-defined]
        if entry is not None and len(entry["loaders"]) != len(loaders):
            entry, reason = None, (
                f"the checkpoint holds the random state of {len(entry['loaders'])} training loader(s) and this run "
                f"has {len(loaders)}"
            )
        if entry is not None:
            restored = [loader.restore_random_state(state, skip) for loader, state in zip(loaders, entry["loaders"])]
            if not all(restored):
                entry, reason = None, "a training loader's generators differ from those of the checkpoint's loader"
        if entry is None:
            if self.global_rank == 0:  # type: ignore[attr-defined]
                log.warning(not_exact_notice(reason))
            return None
        set_host_states(entry["host"])
        self._device_seed = int(entry["device_seed"])
        return entry


class SingleDeviceCore:
    """Mixed into the Trainer's and Fabric's single-device Neuron strategies: one process, device 0 of the runtime's
    type (`xla:0`, or `neuron:0` natively)."""

    strategy_name = "neuron_single"
    strategy_description = "Single NeuronCore / XLA:CPU (lightning_trn)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, device=torch.device(get_runtime().device_type, 0), **kwargs)
