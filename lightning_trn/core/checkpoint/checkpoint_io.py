"""`NeuronCheckpointIO`: checkpoints that hold only CPU tensors and plain Python types.

A checkpoint written on Trainium must load on a GPU or CPU machine without torch_xla, and with
`torch.load(..., weights_only=True)`. So every tensor is moved to the host and config containers
(omegaconf) become plain dicts/lists before `torch.save`.

Local writes are atomic and durable (`lightning_trn.core.checkpoint.checkpoint_file.atomic_local_save`). Remote paths
(`s3://` ...) go through Lightning's fsspec writer.

Local checkpoint files are memory-mapped (`torch.load(mmap=True)`): a ZeRO-1 rank that resumes a full checkpoint reads
only its own slices of the optimizer state, not the whole file.

A sharded ZeRO-1 checkpoint is a directory (`lightning_trn.core.parallel.zero1`): loading it gives the checkpoint with
the full optimizer state, as a full checkpoint would, except inside `reading_shard(rank, world_size)` (a ZeRO-1
strategy's load), where each rank gets only its own chunks: from its own file alone at the saved world size, sliced
from the memory-mapped files that hold them at another. Loading a torch.distributed.checkpoint directory written by a
sharded strategy (`lightning_trn.core.checkpoint.distributed_checkpoint`) also gives the full checkpoint: a sharded run
resumes on one device, the CPU or a GPU.

The train loaders' resume positions are stored under their own top-level key instead of Lightning's fit-loop state
(`lightning_trn.core.checkpoint.checkpoint_file.stash_loader_states`: a CPU/GPU run would otherwise refuse the
checkpoint). Loading through this class puts them back.
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_trn.core.checkpoint.checkpoint_file import atomic_local_save, stash_loader_states, unstash_loader_states
from lightning_trn.core.checkpoint.distributed_checkpoint import is_distributed_checkpoint, load_consolidated
from lightning_trn.core.parallel.zero1 import SHARDED_MAIN_FILE, consolidate


def to_portable(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Copy of `checkpoint` with device tensors moved to CPU, all in one batch (`DeviceRuntime.to_host`: one
    transfer per checkpoint on XLA, not one per tensor), and omegaconf containers turned into plain ones."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        checkpoint = apply_to_collection(checkpoint, (DictConfig, ListConfig), OmegaConf.to_container, resolve=True)
    except ImportError:
        pass
    on_device: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            on_device.append(tensor)
        return tensor

    apply_to_collection(checkpoint, torch.Tensor, collect)
    if not on_device:
        return checkpoint
    from lightning_trn.runtime import get_runtime

    runtime = get_runtime()
    batched = [t for t in on_device if t.device.type == runtime.device_type]
    host = {id(t): copy for t, copy in zip(batched, runtime.to_host(batched), strict=True)}
    return apply_to_collection(
        checkpoint,
        torch.Tensor,
        lambda t: host[id(t)] if id(t) in host else (t.detach().cpu() if t.device.type != "cpu" else t),
    )


class NeuronCheckpointIO(TorchCheckpointIO):
    """Saves portable (CPU-only) checkpoints atomically and loads with `weights_only=True` unless told otherwise.

    `weights_only=True` makes `torch.load` refuse pickled code (any global outside torch's allow-list), so a
    tampered checkpoint raises instead of running; pass `weights_only=False` only for checkpoints you trust.

    Args:
        async_save: have the strategy write the torch.distributed.checkpoint directories of the sharded strategies
            (model-parallel and FSDP, native backend) in the background (`lightning_trn.core.checkpoint.async_save`,
            run by the strategy's checkpointer): a save blocks training only while it copies the state to host memory.
            Off by default. Strategies that write one file (or ZeRO-1's directories) refuse it at setup.
    """

    def __init__(self, async_save: bool = False) -> None:
        super().__init__()
        self.async_save = async_save
        self._shard: tuple[int, int] | None = None

    @contextlib.contextmanager
    def reading_shard(self, rank: int, world_size: int) -> Iterator[None]:
        """Loads inside read sharded ZeRO-1 directories as the chunks of rank `rank` of `world_size`
        (`lightning_trn.core.parallel.zero1.consolidate`), not as full tensors. A ZeRO-1 strategy's load wraps
        Lightning's in it: Lightning passes the checkpoint IO the path alone."""
        previous, self._shard = self._shard, (rank, world_size)
        try:
            yield
        finally:
            self._shard = previous

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        checkpoint = stash_loader_states(to_portable(checkpoint))
        fs, local_path = url_to_fs(str(path))
        if storage_options is None and isinstance(fs, LocalFileSystem):
            atomic_local_save(checkpoint, local_path)
        else:  # remote storage, or storage_options (which TorchCheckpointIO rejects with its own error)
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        weights_only = True if weights_only is None else weights_only
        main = os.path.join(os.fspath(path), SHARDED_MAIN_FILE)
        if is_distributed_checkpoint(path):  # a sharded strategy's directory, loaded whole on one device
            checkpoint = load_consolidated(path)
        elif os.path.isdir(path) and os.path.isfile(main):
            checkpoint = self._load_file(main, map_location, weights_only)
            checkpoint = consolidate(
                checkpoint,
                os.fspath(path),
                lambda file: torch.load(file, map_location="cpu", weights_only=True, mmap=True),
                shard=self._shard,
            )
        else:
            checkpoint = self._load_file(path, map_location, weights_only)
        return unstash_loader_states(checkpoint)

    def _load_file(self, path: _PATH, map_location: Callable | None, weights_only: bool) -> dict[str, Any]:
        """A local zip-format file memory-mapped (its tensors read when used), anything else as Lightning loads it."""
        fs, local_path = url_to_fs(str(path))
        if isinstance(fs, LocalFileSystem) and os.path.isfile(local_path) and zipfile.is_zipfile(local_path):
            return torch.load(local_path, map_location=map_location, weights_only=weights_only, mmap=True)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
