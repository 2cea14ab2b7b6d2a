"""Reading the torch.distributed.checkpoint (DCP) directories that sharded strategies write, on the CPU, without a
process group or a device: the whole checkpoint in Lightning's one-file format (`load_consolidated`, which
`NeuronCheckpointIO` uses to resume a sharded run on one device, the CPU or a GPU), or written to a file batch by batch
(`write_consolidated`, `python -m lightning_trn.consolidate`), also as a Hugging Face safetensors file. The metadata
is parsed once per directory, and tensor entries are read in batches (`BATCH_BYTES`), so a read opens each shard file
once per batch, not once per entry.

A directory holds `.metadata` (every entry's shape, dtype and where its chunks are), one `__<rank>_0.distcp` file
per rank, and `meta.pt` from rank 0 (Lightning's loops, callbacks and the ranks' random state). Entries are
flattened: `state_dict.<parameter>`, `optimizer_<i>.state.<parameter>.exp_avg`, `optimizer_<i>.param_groups...`;
optimizer states are keyed by parameter name (`get_optimizer_state_dict`), which the one-file format replaces by
the parameter's position, as `optimizer.state_dict()` does. Non-tensor entries load with `weights_only=True`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from typing_extensions import override

from lightning_trn.core.checkpoint.checkpoint_file import atomic_local_save, stash_loader_states

#: the file of the DCP directory that says what it holds
METADATA_FILE = ".metadata"
#: the rest of Lightning's checkpoint, written beside the shards by rank 0 (Trainer and Fabric)
LIGHTNING_META_FILE = "meta.pt"
#: how many bytes of tensor entries one read brings to the host at most (an entry larger than that is read alone):
#: each read opens every shard file it touches once, so few large batches instead of one read per entry, while the
#: host holds one batch
BATCH_BYTES = 512 * 2**20
_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")
#: safetensors' dtype names
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def is_distributed_checkpoint(path: Any) -> bool:
    """Whether `path` is a local DCP directory."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load of a flat state dict, with non-tensor entries unpickled by `weights_only=True` (DCP's own
    planner unpickles them with any class)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    @override
    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


class _MetadataOnceReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` parsed on the first request only. `dcp.load` asks its reader for
    the metadata on every call, and a sharded checkpoint's metadata lists every chunk of every entry (6.7 MB for
    Llama-3-8B's layout on 64 ranks), so one parse per load made reading a directory O(entries x metadata)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def _nbytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * md.properties.dtype.itemsize


class DistributedCheckpointReader:
    """One DCP directory, read on the host (no process group): its metadata parsed once, tensor entries read in
    batches of at most `BATCH_BYTES`."""

    def __init__(self, path: Any) -> None:
        self.path = os.fspath(path)
        self._storage = _MetadataOnceReader(self.path)
        self.metadata: Metadata = self._storage.read_metadata()
        entries = self.metadata.state_dict_metadata.items()
        self._tensors = {key: md for key, md in entries if isinstance(md, TensorStorageMetadata)}

    def tensors(self) -> dict[str, TensorStorageMetadata]:
        """Every tensor entry (flattened key) and its global shape and dtype (the reader's own dict: read only)."""
        return self._tensors

    def load(self, entries: dict[str, Any]) -> dict[str, Any]:
        """Fill `entries` (flattened key -> a CPU tensor of the entry's shape to copy into, or None for a non-tensor
        entry) from the directory; returns it. Reads only those entries' chunks, each shard file opened once."""
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            load(entries, storage_reader=self._storage, planner=_WeightsOnlyPlanner(), no_dist=True)
        return entries

    def read_tensors(
        self, keys: Iterable[str], allocate: Callable[[str, TensorStorageMetadata], torch.Tensor] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, whole tensor) for the tensor entries `keys`, in order, read a batch at a time: entries in order up to
        `BATCH_BYTES` together (a larger one alone), one load each, into `allocate(key, metadata)` or new CPU
        tensors. The host holds one batch, as long as the caller keeps nothing it was given."""
        batch: dict[str, Any] = {}
        size = 0
        for key in keys:
            md = self._tensors[key]
            nbytes = _nbytes(md)
            if batch and size + nbytes > BATCH_BYTES:
                yield from self.load(batch).items()
                batch, size = {}, 0
            batch[key] = torch.empty(md.size, dtype=md.properties.dtype) if allocate is None else allocate(key, md)
            size += nbytes
        if batch:
            yield from self.load(batch).items()

    def non_tensors(self) -> dict[str, Any]:
        """Every non-tensor entry (hyperparameters of the optimizers' groups, step counters saved as numbers), in one
        load."""
        keys = [key for key in self.metadata.state_dict_metadata if key not in self._tensors]
        return self.load(dict.fromkeys(keys)) if keys else {}

    def path_of(self, key: str) -> tuple:
        """Where flattened `key` sits in the saved (nested) state: DCP records it in the metadata."""
        mappings = self.metadata.planner_data or {}
        return tuple(mappings.get(key, (key,)))

    def lightning_meta(self) -> dict[str, Any]:
        """What rank 0 wrote beside the shards (`meta.pt`), or nothing."""
        file = os.path.join(self.path, LIGHTNING_META_FILE)
        return torch.load(file, map_location="cpu", weights_only=True) if os.path.isfile(file) else {}


def _set(root: dict[str, Any], path: tuple, value: Any) -> None:
    """Put `value` at `path` (dict keys and list positions) in `root`, making the containers on the way."""
    node: Any = root
    for key, following in itertools.pairwise(path):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = [] if isinstance(following, int) else {}
        elif key not in node:
            node[key] = [] if isinstance(following, int) else {}
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def _by_position(optimizer: dict[str, Any], model_names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (DCP) keyed by position instead, as `optimizer.state_dict()` is:
    positions count the parameters through the groups in order.

    A pipeline-parallel checkpoint holds each stage's parameters' state, but DCP kept one rank's `param_groups`,
    which name that rank's parameters only: with one group, the group is then every parameter with state, in the
    model's order (`model_names`, the checkpoint's `state_dict` keys)."""
    groups = optimizer.get("param_groups", [])
    listed_names = {name for group in groups for name in group["params"]}
    unlisted = [name for name in optimizer.get("state", {}) if name not in listed_names]
    if unlisted:
        if len(groups) != 1:
            raise ValueError(
                f"The optimizer state names {len(unlisted)} parameters its {len(groups)} param groups do not list (a "
                "pipeline-parallel checkpoint keeps one stage's groups): with several groups their positions are "
                "unknown. Load the directory with the strategy that wrote it, or with one param group."
            )
        order = {name: index for index, name in enumerate(model_names)}
        merged = sorted([*groups[0]["params"], *unlisted], key=lambda name: order.get(name, len(order)))
        groups = [{**groups[0], "params": merged}]
    names = [name for group in groups for name in group["params"]]
    position = {name: index for index, name in enumerate(names)}
    by_position = [{**group, "params": [position[name] for name in group["params"]]} for group in groups]
    state = {position[name]: value for name, value in optimizer.get("state", {}).items()}
    return {"state": state, "param_groups": by_position}


def _is_named_optimizer_state(value: Any) -> bool:
    groups = value.get("param_groups") if isinstance(value, dict) else None
    if not groups:
        return False
    return all(isinstance(name, str) for group in groups for name in group.get("params", []))


def _one_file_format(saved: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Lightning's one-file checkpoint from a DCP directory's state and `meta.pt`: the Trainer's `optimizer_<i>`
    entries become `optimizer_states`, every optimizer state is keyed by position."""
    checkpoint = {**meta}
    optimizers: dict[int, Any] = {}
    model_names = list(saved.get("state_dict", {}))
    for key, value in saved.items():
        match = _OPTIMIZER_KEY.fullmatch(key)
        value = _by_position(value, model_names) if _is_named_optimizer_state(value) else value
        if match and "state_dict" in saved:
            optimizers[int(match.group(1))] = value
        else:
            checkpoint[key] = value
    if optimizers:
        checkpoint["optimizer_states"] = [optimizers[index] for index in sorted(optimizers)]
    return checkpoint


def load_consolidated(path: Any) -> dict[str, Any]:
    """The whole checkpoint of DCP directory `path` in Lightning's one-file format, CPU tensors (what a
    `save_distributed_checkpoint=False` run would have written)."""
    reader = DistributedCheckpointReader(path)
    saved: dict[str, Any] = {}
    for key, value in reader.non_tensors().items():
        _set(saved, reader.path_of(key), value)
    for key, tensor in reader.read_tensors(reader.tensors()):
        _set(saved, reader.path_of(key), tensor)
    return _one_file_format(saved, reader.lightning_meta())


def write_consolidated(path: Any, output: Any) -> None:
    """Write DCP directory `path` as one checkpoint file (Lightning's format, `torch.load(weights_only=True)`), batch
    by batch: each tensor is read straight into a memory-mapped scratch file beside `output` (the host holds one chunk
    at a time; the page cache holds the rest and can write it out), then `torch.save` streams them into the file,
    which replaces `output` atomically."""
    reader = DistributedCheckpointReader(path)
    directory = os.path.dirname(os.path.abspath(os.fspath(output)))
    os.makedirs(directory, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".consolidate-", dir=directory)
    try:
        saved: dict[str, Any] = {}
        for key, value in reader.non_tensors().items():
            _set(saved, reader.path_of(key), value)
        files = {key: os.path.join(scratch, str(index)) for index, key in enumerate(reader.tensors())}

        def scratch_tensor(key: str, md: TensorStorageMetadata) -> torch.Tensor:
            size = math.prod(md.size)
            return torch.from_file(files[key], shared=True, size=size, dtype=md.properties.dtype).view(md.size)

        for key, tensor in reader.read_tensors(files, scratch_tensor):
            _set(saved, reader.path_of(key), tensor)
        # as every one-file checkpoint of lightning_trn: the train loaders' resume positions under their own key, so
        # a CPU/GPU run (plain, stateless DataLoaders) accepts the file
        # (`lightning_trn.core.checkpoint.checkpoint_file`)
        atomic_local_save(stash_loader_states(_one_file_format(saved, reader.lightning_meta())), output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def model_tensors(reader: DistributedCheckpointReader, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(flattened key, name) of the model's weights in the directory: the Trainer's `state_dict`, Fabric's `model`
    entry; the name without the entry's key and without `prefix`."""
    for key in reader.tensors():
        path = reader.path_of(key)
        if path[0] in ("state_dict", "model") and len(path) == 2:
            name = str(path[1])
            yield key, name[len(prefix) :] if prefix and name.startswith(prefix) else name


def write_safetensors(path: Any, output: Any, prefix: str = "") -> int:
    """Write the model weights of DCP directory `path` as a safetensors file (Hugging Face's format), names without
    `prefix` (e.g. "model." for a LightningModule holding the Hugging Face model as `self.model`): the header first
    (shapes and dtypes are in the metadata), then the tensors batch by batch (the host holds one batch). Returns how
    many tensors."""
    reader = DistributedCheckpointReader(path)
    tensors = reader.tensors()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    order = []
    offset = 0
    for key, name in model_tensors(reader, prefix):
        md = tensors[key]
        if md.properties.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: safetensors has no dtype for {md.properties.dtype}.")
        nbytes = _nbytes(md)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[md.properties.dtype],
            "shape": list(md.size),
            "data_offsets": [offset, offset + nbytes],
        }
        order.append(key)
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    tmp = f"{os.fspath(output)}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, tensor in reader.read_tensors(order):
            # an ndarray is a buffer (written without a copy); numpy's stubs do not declare `__buffer__`
            f.write(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # see above
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    return len(order)
