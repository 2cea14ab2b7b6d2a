"""The loops' `setup_data` hook that keeps the device prefetchers out of `trainer.train_dataloader` and the other
loader properties (installed by `lightning_trn.hooks.registry` for Neuron runs only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities._pytree import tree_unflatten

from lightning_trn.core.device_loader import DevicePrefetchLoader


def setup_data_showing_user_loaders(original: Callable[[Any], None] | None) -> Callable[[Any], None] | None:
    """A loop's `setup_data` after which `trainer.train_dataloader`, `val_dataloaders`, `test_dataloaders` and
    `predict_dataloaders` return the DataLoaders as Lightning prepared them (the user's own, or Lightning's copy with a
    `DistributedSampler`), as in a CPU run, not the prefetchers iterating them.

    The loop's `CombinedLoader` iterates its `flattened` list (the prefetchers); its `iterables`, set from the same
    list, are read only by those four properties, so they get the wrapped loaders. None if the loop has no
    `setup_data` of its own (`original` None).
    """
    if original is None:
        return None

    def setup_data(loop: Any) -> None:
        original(loop)
        combined = loop._combined_loader
        if combined is not None and any(isinstance(dl, DevicePrefetchLoader) for dl in combined.flattened):
            loaders = [dl._loader if isinstance(dl, DevicePrefetchLoader) else dl for dl in combined.flattened]
            combined._iterables = tree_unflatten(loaders, combined._spec)

    return setup_data
