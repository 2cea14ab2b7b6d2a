"""`NeuronCheckpointIO`: checkpoints that hold only CPU tensors and plain Python types.

A checkpoint written on Trainium must load on a GPU or CPU machine without torch_xla, and with
`torch.load(..., weights_only=True)`. So every tensor is moved to the host and config containers
(omegaconf) become plain dicts/lists before `torch.save`.

Local writes are atomic and durable: temp file in the target's directory, fsync, `os.replace`, fsync of the directory.
(Lightning's own `_atomic_save` stages the file in the system temp dir through fsspec; when that is another
filesystem, e.g. a tmpfs `/tmp`, the final move is a copy into the target, and a kill mid-copy truncates it.)
Remote paths (`s3://` ...) go through Lightning's fsspec writer.

Local checkpoint files are memory-mapped (`torch.load(mmap=True)`): a ZeRO-1 rank that resumes a full checkpoint reads
only its own slices of the optimizer state, not the whole file.

A sharded ZeRO-1 checkpoint is a directory (`lightning_trn.core.zero1`): loading it gives the checkpoint with the full
optimizer state, as a full checkpoint would, except under a ZeRO-1 strategy (`zero1_shard` set), where each rank gets
only its own chunks: from its own file alone at the saved world size, sliced from the memory-mapped files that hold
them at another. Loading a torch.distributed.checkpoint directory written by a sharded strategy
(`lightning_trn.core.distributed_checkpoint`) also gives the full checkpoint: a sharded run resumes on one device, the
CPU or a GPU.

The train loaders' resume positions (`DevicePrefetchLoader.state_dict`) are stored under their own top-level key
instead of Lightning's fit-loop state: a CPU/GPU run, whose plain DataLoader is not stateful, would otherwise refuse
the checkpoint ("0 stateful loaders, but found 1 states"). Loading through this class puts them back.
"""

from __future__ import annotations

import os
import uuid
import zipfile
from typing import Any, Callable, Optional

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_trn.core.distributed_checkpoint import is_distributed_checkpoint, load_consolidated
from lightning_trn.core.zero1 import SHARDED_MAIN_FILE, consolidate


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
    host = {id(t): copy for t, copy in zip(batched, runtime.to_host(batched))}
    return apply_to_collection(
        checkpoint, torch.Tensor,
        lambda t: host[id(t)] if id(t) in host else (t.detach().cpu() if t.device.type != "cpu" else t),
    )


#: top-level checkpoint key holding the train loaders' states, moved out of `loops.fit_loop.state_dict`
LOADER_STATES_KEY = "lightning_trn_train_loader_states"
_FIT_LOOP_PATH = ("loops", "fit_loop", "state_dict")
_LIGHTNING_LOADER_STATES = "combined_loader"


def stash_loader_states(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Copy of `checkpoint` with Lightning's train-loader states moved to `LOADER_STATES_KEY` (see module docstring)."""
    fit_loop_state = _nested(checkpoint, _FIT_LOOP_PATH)
    if not isinstance(fit_loop_state, dict) or _LIGHTNING_LOADER_STATES not in fit_loop_state:
        return checkpoint
    loops = dict(checkpoint["loops"])
    loops["fit_loop"] = dict(loops["fit_loop"])
    loops["fit_loop"]["state_dict"] = {k: v for k, v in fit_loop_state.items() if k != _LIGHTNING_LOADER_STATES}
    return {**checkpoint, "loops": loops, LOADER_STATES_KEY: fit_loop_state[_LIGHTNING_LOADER_STATES]}


def unstash_loader_states(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Put states saved by `stash_loader_states` back where Lightning's fit loop reads them (in place)."""
    states = checkpoint.pop(LOADER_STATES_KEY, None)
    fit_loop_state = _nested(checkpoint, _FIT_LOOP_PATH)
    if states is not None and isinstance(fit_loop_state, dict):
        fit_loop_state[_LIGHTNING_LOADER_STATES] = states
    return checkpoint


def _nested(mapping: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def atomic_local_save(checkpoint: dict[str, Any], path: _PATH) -> None:
    """`torch.save` to local `path` so that a reader (or a crash) sees the old file or the new one, never a part.

    The bytes go to a hidden `.<name>.<pid>.<random>.tmp` next to `path` (same filesystem, so the rename is atomic)
    and are fsynced before the rename. A process killed mid-write leaves that temp file behind; it never has the
    checkpoint suffix, so `ckpt_path="last"` and `ModelCheckpoint` ignore it.
    """
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:  # created with 0o666 & ~umask, like any new file
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    """Persist the rename itself (the directory entry); not possible on every OS/filesystem, so best effort."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class NeuronCheckpointIO(TorchCheckpointIO):
    """Saves portable (CPU-only) checkpoints atomically and loads with `weights_only=True` unless told otherwise.

    `weights_only=True` makes `torch.load` refuse pickled code (any global outside torch's allow-list), so a
    tampered checkpoint raises instead of running; pass `weights_only=False` only for checkpoints you trust.

    Attributes:
        zero1_shard: `(rank, world_size)` of a ZeRO-1 strategy's process (it sets it): sharded ZeRO-1 directories then
            load as that rank's chunks (`lightning_trn.core.zero1.consolidate`), not as full tensors.
    """

    zero1_shard: Optional[tuple[int, int]] = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
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
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        weights_only = True if weights_only is None else weights_only
        main = os.path.join(os.fspath(path), SHARDED_MAIN_FILE)
        if is_distributed_checkpoint(path):  # a sharded strategy's directory, loaded whole on one device
            checkpoint = load_consolidated(path)
        elif os.path.isdir(path) and os.path.isfile(main):
            checkpoint = self._load_file(main, map_location, weights_only)
            checkpoint = consolidate(
                checkpoint, os.fspath(path), lambda file: torch.load(file, map_location="cpu", weights_only=True,
                                                                     mmap=True),
                shard=self.zero1_shard,
            )
        else:
            checkpoint = self._load_file(path, map_location, weights_only)
        return unstash_loader_states(checkpoint)

    def _load_file(self, path: _PATH, map_location: Optional[Callable], weights_only: bool) -> dict[str, Any]:
        """A local zip-format file memory-mapped (its tensors read when used), anything else as Lightning loads it."""
        fs, local_path = url_to_fs(str(path))
        if isinstance(fs, LocalFileSystem) and os.path.isfile(local_path) and zipfile.is_zipfile(local_path):
            return torch.load(local_path, map_location=map_location, weights_only=weights_only, mmap=True)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
