"""The bytes a process reads from safetensors files, counted at `safetensors.safe_open`: every tensor (`get_tensor`)
and slice (`get_slice(key)[block]`) read, headers free. lightning_trn opens the files through `safetensors.safe_open`
when it reads (pretrained weights, seed checkpoints), so replacing that attribute sees every read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import safetensors
import torch


class ReadCount:
    """The bytes read since the counting started."""

    def __init__(self) -> None:
        self.bytes = 0

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += tensor.nbytes
        return tensor


class _CountingFile:
    def __init__(self, count: ReadCount, opened: Any) -> None:
        self.count, self.file = count, opened

    def __enter__(self) -> _CountingFile:
        self.file.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.file.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.count.add(self.file.get_tensor(key))

    def get_slice(self, key: str) -> _CountingSlice:
        return _CountingSlice(self.count, self.file.get_slice(key))


class _CountingSlice:
    def __init__(self, count: ReadCount, part: Any) -> None:
        self.count, self.part = count, part

    def get_shape(self) -> list[int]:
        return self.part.get_shape()

    def __getitem__(self, block: object) -> torch.Tensor:
        return self.count.add(self.part[block])


@contextmanager
def counting_reads() -> Iterator[ReadCount]:
    """Count what is read through `safetensors.safe_open` inside the block."""
    count, safe_open = ReadCount(), safetensors.safe_open
    safetensors.safe_open = lambda *args, **kwargs: _CountingFile(count, safe_open(*args, **kwargs))
    try:
        yield count
    finally:
        safetensors.safe_open = safe_open
