"""Reading a block of a tensor out of a safetensors file: the part of a parameter one rank holds (a DTensor's local
shard), read alone through safetensors' slicing, so a rank reads its shard and not the whole tensor. Shared by
`load_pretrained` (Hugging Face folders) and seed checkpoints (`core.parallel.model_parallel.load_seed_checkpoint`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

#: names listed in an error before the rest are counted
SHOWN = 5


def local_block(shape: torch.Size, like: Tensor) -> tuple[slice, ...]:
    """The block of a tensor of global `shape` that `like` holds on this rank, one slice per dimension: a DTensor's
    local shard is the block `compute_local_shape_and_global_offset` gives (the blocks DCP saves and loads),
    anything else holds all of it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(like, DTensor):
        return tuple(slice(0, size) for size in shape)
    local_shape, offset = compute_local_shape_and_global_offset(shape, like.device_mesh, like.placements)
    return tuple(slice(start, start + size) for size, start in zip(local_shape, offset, strict=True))


def read_into(tensor: Tensor, file: Path, key: str) -> None:
    """Copy into this rank's part of `tensor` (a DTensor's local shard, all of any other tensor) its block of tensor
    `key` in the safetensors `file`, of the same global shape: only that block is read (`read_block`). Call it under
    `torch.no_grad()` for a parameter."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    local.copy_(read_block(file, key, local_block(tensor.shape, tensor)))


def read_block(file: Path, key: str, block: tuple[slice, ...]) -> Tensor:
    """The `block` of tensor `key` in the safetensors `file`, read alone: the file is mapped for this read only, so
    no more of it stays resident than the block."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as handle:
        return handle.get_slice(key)[block] if block else handle.get_tensor(key)


def weight_files(path: Path) -> dict[str, Path]:
    """Each tensor name of the folder's weights and the file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {key: path / file for key, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    raise FileNotFoundError(
        f"{str(path)!r} has neither model.safetensors nor model.safetensors.index.json: save the model with "
        "`save_pretrained(path, safe_serialization=True)`."
    )


def file_shapes(files: dict[str, Path]) -> dict[str, list[int]]:
    """The shape of every tensor, from the files' headers (nothing else is read)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as handle:
            keys = handle.keys()  # a list: the handle itself is not iterable
            shapes.update({key: handle.get_slice(key).get_shape() for key in keys if files.get(key) == file})
    return shapes


def listed(items: list[str]) -> str:
    return ", ".join(items[:SHOWN]) + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")
