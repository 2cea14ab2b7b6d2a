"""`NeuronCheckpointIO`: checkpoints that hold only CPU tensors and plain Python types.

A checkpoint written on Trainium must load on a GPU or CPU machine without torch_xla, and with
`torch.load(..., weights_only=True)`. So every tensor is moved to the host and config containers
(omegaconf) become plain dicts/lists before `torch.save`; Lightning's atomic write (temp file + rename) is kept.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override


def to_portable(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Copy of `checkpoint` with device tensors moved to CPU and omegaconf containers turned into plain ones."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        checkpoint = apply_to_collection(checkpoint, (DictConfig, ListConfig), OmegaConf.to_container, resolve=True)
    except ImportError:
        pass
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().cpu() if t.device.type != "cpu" else t)


class NeuronCheckpointIO(TorchCheckpointIO):
    """Saves portable (CPU-only) checkpoints and loads with `weights_only=True` unless told otherwise."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        super().save_checkpoint(to_portable(checkpoint), path, storage_options=storage_options)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location=map_location, weights_only=True if weights_only is None else weights_only)
