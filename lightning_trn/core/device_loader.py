"""`DevicePrefetchLoader`: a DataLoader stand-in that delivers batches already on the device (the loops' loader
properties still show the user's loaders: `lightning_trn.hooks.loaders`)."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import RandomSampler

from lightning_trn.core.checkpoint.random_state import (
    generator_states,
    host_states,
    loader_generators,
    set_generator_states,
)
from lightning_trn.runtime import DeviceRuntime

log = logging.getLogger(__name__)

#: `state_dict()` key: batches of the current epoch handed to the training loop (including skipped ones)
BATCHES_YIELDED = "batches_yielded"
_OWN_ATTRIBUTES = (
    "_loader",
    "_device",
    "_runtime",
    "_deliveries",
    "_position",
    "_before_batch",
    "_yielded",
    "_skip",
    "_epoch_start",
    "_order_restored",
)


class DevicePrefetchLoader:
    """Iterates the wrapped DataLoader through the runtime's background prefetcher (`MpDeviceLoader` on XLA).

    Attribute reads (`dataset`, `sampler`, `batch_sampler`, `batch_size`, ...), public attribute writes and `len()`
    go to the wrapped loader, so Lightning's loops keep working (epoch setting on samplers, length checks, and
    `seed_everything(workers=True)` setting `worker_init_fn`, which must reach the real DataLoader).

    Resumable: a mid-epoch resume skips the batches the epoch already trained on, on the host, before anything is
    sent to the device. How many is the training loop's own count (`position`, given by the strategy for training
    loaders): it is right for every checkpoint, one written by `OnExceptionCheckpoint` after a failed batch (which
    the loader had already handed out) or by a CPU/GPU run (which holds no state of this loader). Without `position`
    it is what `load_state_dict()` restored. `state_dict()` holds how many batches of the current epoch reached the
    loop (batches still in the prefetch queue do not count); Lightning saves it because the class has both methods
    (`_Stateful`), and `NeuronCheckpointIO` files it under its own key.

    Prefetching starts at the first `next()`, not at `iter()`: Lightning creates the epoch's iterator before it
    calls `set_epoch` on the sampler, and an eager background loader would read the sampler's previous epoch.

    Every batch handed out is also appended to `deliveries` when given (a bounded deque the strategy owns), so the
    strategy can recognise a batch that is already on the device without walking its tensors. `before_batch`, when
    given, is called before each batch is handed out (Fabric's strategies cut the graph there).

    Random state (`lightning_trn.core.checkpoint.random_state`): when an epoch's iteration starts, the loader notes the
    host generators' and its own generators' states, so that a checkpoint taken mid-epoch can hold the states the epoch
    started from (`random_state`): a resumed run restores them (`restore_random_state`) and draws the same order, the
    same worker seeds and the same augmentation for the batches it skips and for the rest of the epoch.
    """

    def __init__(
        self,
        dataloader: Any,
        device: torch.device,
        runtime: DeviceRuntime,
        deliveries: deque | None = None,
        position: Callable[[], int] | None = None,
        before_batch: Callable[[], None] | None = None,
    ) -> None:
        self._loader = dataloader
        self._device = device
        self._runtime = runtime
        self._deliveries = deliveries
        self._position = position
        self._before_batch = before_batch
        self._yielded = 0
        self._skip = 0
        #: host and loader generator states at the start of the epoch being iterated (None: no epoch under way)
        self._epoch_start: dict[str, Any] | None = None
        #: the epoch's order was restored from a checkpoint (`restore_random_state`): no warning when skipping
        self._order_restored = False

    def __iter__(self) -> Iterator:
        return self._batches()

    def _batches(self) -> Iterator:
        self._epoch_start = {"host": host_states(), "generators": generator_states(loader_generators(self._loader))}
        skip = self._start_position()
        self._yielded = skip
        source = itertools.islice(self._loader, skip, None) if skip else self._loader
        deliveries, before_batch = self._deliveries, self._before_batch
        for batch in self._runtime.prefetch(source, self._device):
            if before_batch is not None:
                before_batch()
            self._yielded += 1
            if deliveries is not None:
                deliveries.append(batch)
            yield batch
        self._yielded = 0  # exhausted: a checkpoint taken now resumes at the start of the next epoch
        self._epoch_start = None

    def __len__(self) -> int:
        return len(self._loader)

    def state_dict(self) -> dict[str, int]:
        """Position in the current epoch: batches yielded to the loop (or still to skip after a restore)."""
        return {BATCHES_YIELDED: self._skip or self._yielded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next iteration resume the epoch where `state_dict` left it.

        A position at or past the end of the epoch (a checkpoint saved on the last batch) resumes at the start of
        the next epoch, as Lightning's loop does.
        """
        self._skip = int(state_dict.get(BATCHES_YIELDED, 0))

    @property
    def in_epoch(self) -> bool:
        """Whether an epoch's iteration has started and not run out."""
        return self._epoch_start is not None

    def random_state(self, mid_epoch: bool) -> dict[str, Any]:
        """What a resumed run needs to draw this loader's batches again: `mid_epoch`, the host and loader generator
        states at the start of the current epoch and the batches handed out since; otherwise the loader generators'
        states now (`host` None: the host generators as they are now)."""
        if mid_epoch and self._epoch_start is not None:
            return {**self._epoch_start, BATCHES_YIELDED: self._yielded}
        return {"host": None, "generators": generator_states(loader_generators(self._loader)), BATCHES_YIELDED: 0}

    def restore_random_state(self, state: dict[str, Any], skip: bool = False) -> bool:
        """Put back the loader generators' states from `random_state`; with `skip`, the next iteration also skips
        the batches handed out before (Fabric, which has no loop to count them). False when the generators do not
        match the saved ones (another loader): nothing is changed."""
        if not set_generator_states(loader_generators(self._loader), state["generators"]):
            return False
        self._order_restored = True
        if skip:
            self._skip = int(state[BATCHES_YIELDED])
        return True

    def _start_position(self) -> int:
        """Batches of this epoch to skip, decided at the first `next()` (the loop has restored its progress by then):
        the loop's own count when the strategy gave one, else what `load_state_dict` restored."""
        skip, self._skip = self._skip, 0
        order_restored, self._order_restored = self._order_restored, False
        if self._position is not None:
            skip = self._position()
        length = self._length()
        if length is not None and skip >= length:
            skip = 0
        if skip and not order_restored and self._shuffles_without_epoch_seed():
            log.warning(
                "lightning_trn: resuming mid-epoch by skipping %d batches, but the train loader shuffles with a "
                "`RandomSampler` and the checkpoint held no random state to restore its order: the rest of the epoch "
                "sees a different order than the interrupted one (see docs/fault-tolerance.md).",
                skip,
            )
        return skip

    def _length(self) -> int | None:
        try:
            return len(self._loader)
        except TypeError:  # iterable-style dataset without a length
            return None

    def _shuffles_without_epoch_seed(self) -> bool:
        batch_sampler = getattr(self._loader, "batch_sampler", None)
        samplers = (getattr(self._loader, "sampler", None), getattr(batch_sampler, "sampler", None))
        return any(isinstance(sampler, RandomSampler) for sampler in samplers)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._loader, name, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in _OWN_ATTRIBUTES:
            raise AttributeError(name)
        return getattr(self._loader, name)
