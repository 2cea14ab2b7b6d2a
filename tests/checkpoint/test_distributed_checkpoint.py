"""Reading torch.distributed.checkpoint directories on the host (`lightning_trn.core.checkpoint.distributed_checkpoint`)
at the scale of a 64-rank save: `.metadata` parsed once per directory, tensor entries read in batches of bounded size.

The checkpoints are those of `benchmarks/dcp_read.py`: Llama-3-8B's parameter names and AdamW state in an FSDP2
save's layout (every sharded entry in one chunk per rank), with DCP's own metadata, sizes divided by 64. Every chunk
holds the number of the rank that saved it. Both suites run this file (torch 2.9 and torch 2.13); the 64-rank
consolidation runs in the native one. How long the 8B layout takes is `python -m benchmarks.dcp_read`'s to say.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

import lightning_trn.core.checkpoint.distributed_checkpoint as dc
from benchmarks.dcp_read import llama_shapes, write_fsdp_checkpoint
from lightning_trn.core.checkpoint.distributed_checkpoint import (
    DistributedCheckpointReader,
    load_consolidated,
    write_consolidated,
    write_safetensors,
)

pytestmark = pytest.mark.both

SCALE = 64
#: the small checkpoint's ranks (the consolidation test's has 64)
RANKS = 8


def _checkpoint(path: Path, layers: int, ranks: int) -> tuple[Path, dict[str, tuple[int, ...]]]:
    shapes = llama_shapes(layers, SCALE, ranks)
    write_fsdp_checkpoint(path, shapes, ranks)
    return path, shapes


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """96 entries (84 tensors) on 8 ranks."""
    return _checkpoint(tmp_path_factory.mktemp("dcp") / "last.ckpt", layers=2, ranks=RANKS)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


def _striped(shape: tuple[int, ...], ranks: int = RANKS) -> torch.Tensor:
    """A consolidated entry: rank r's block of rows holds r."""
    rows = torch.arange(ranks, dtype=torch.float32).repeat_interleave(shape[0] // ranks)
    return rows.view(-1, *[1] * (len(shape) - 1)).expand(shape)


def _assert_consolidated(checkpoint: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    assert list(checkpoint["state_dict"]) == list(shapes)
    for name, shape in shapes.items():
        torch.testing.assert_close(checkpoint["state_dict"][name], _striped(shape), rtol=0, atol=0)
    (optimizer,) = checkpoint["optimizer_states"]
    assert sorted(optimizer["state"]) == list(range(len(shapes)))
    assert optimizer["param_groups"][0]["params"] == list(range(len(shapes)))
    assert optimizer["param_groups"][0]["betas"] == (0.9, 0.95)
    for position, shape in enumerate(shapes.values()):
        state = optimizer["state"][position]
        assert state["step"].item() == 1.0
        torch.testing.assert_close(state["exp_avg_sq"], _striped(shape), rtol=0, atol=0)


def _read(operation: str, path: Path, out: Path) -> None:
    if operation == "consolidate":
        write_consolidated(path, out / "one.ckpt")
    elif operation == "safetensors":
        write_safetensors(path, out / "model.safetensors")
    else:
        load_consolidated(path)


@pytest.mark.parametrize("operation", ["consolidate", "safetensors", "load_consolidated"])
def test_metadata_is_parsed_once(
    operation: str, two_layers: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m lightning_trn.consolidate`, the safetensors export and the one-device load each parse `.metadata`
    once (before: also once per tensor entry read, 86 parses for consolidation here), and give the saved values."""
    path, shapes = two_layers
    parses = []
    read_metadata = FileSystemReader.read_metadata

    def counting(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        parses.append(self.path)
        return read_metadata(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemReader, "read_metadata", counting)
    _read(operation, path, tmp_path)
    assert len(parses) == 1
    if operation == "consolidate":
        _assert_consolidated(torch.load(tmp_path / "one.ckpt", weights_only=True), shapes)
    elif operation == "safetensors":
        weights = load_file(tmp_path / "model.safetensors")
        assert list(weights) == list(shapes)
        for name, shape in shapes.items():
            torch.testing.assert_close(weights[name], _striped(shape), rtol=0, atol=0)


@pytest.mark.parametrize("operation", ["consolidate", "safetensors"])
def test_tensors_are_read_in_batches_of_bounded_size(
    operation: str, two_layers: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each read brings at most `BATCH_BYTES` of tensors to the host, or one larger entry alone, and reads as many
    entries as fit: fewer reads than entries, every entry read once."""
    path, _ = two_layers
    tensors = DistributedCheckpointReader(path).tensors()
    sizes = {key: math.prod(md.size) * md.properties.dtype.itemsize for key, md in tensors.items()}
    budget = 3 * 2**16  # three of the largest MLP blocks' entries (64 KiB); the embeddings (512 KiB) alone
    monkeypatch.setattr(dc, "BATCH_BYTES", budget, raising=False)
    reads: list[list[str]] = []
    load = DistributedCheckpointReader.load

    def recording(self: DistributedCheckpointReader, entries: dict) -> dict:
        reads.append([key for key, value in entries.items() if isinstance(value, torch.Tensor)])
        return load(self, entries)

    monkeypatch.setattr(DistributedCheckpointReader, "load", recording)
    _read(operation, path, tmp_path)
    batches = [keys for keys in reads if keys]
    read = [key for keys in batches for key in keys]
    assert sorted(read) == sorted(key for key in tensors if operation == "consolidate" or key.startswith("state_dict."))
    assert all(sum(sizes[key] for key in keys) <= budget or len(keys) == 1 for keys in batches)
    assert any(sizes[keys[0]] > budget for keys in batches)  # the embeddings
    # each batch is full: the next entry would not have fit (entries in order)
    for keys, following in itertools.pairwise(batches):
        assert sum(sizes[key] for key in keys) + sizes[following[0]] > budget
    assert len(batches) < len(read) / 2


@pytest.mark.native_only  # once per CI run; the tests above show both torch versions' reads
def test_64_rank_checkpoint_consolidates_with_one_metadata_parse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two of Llama-3-8B's blocks saved by 64 ranks (96 entries, 4,053 chunks): consolidation parses `.metadata` once
    and reads the tensors in fewer loads than entries, every chunk in its place. The counts are what made the 8B
    layout's consolidation take seconds, not minutes (`python -m benchmarks.dcp_read` times it against torch's own
    `dcp_to_torch_save`; a duration is no test: it depends on the machine)."""
    path, shapes = _checkpoint(tmp_path / "last.ckpt", layers=2, ranks=64)
    reader = DistributedCheckpointReader(path)
    assert sum(len(md.chunks) for md in reader.tensors().values()) == 4053
    parses, loads = [], []
    read_metadata, load = FileSystemReader.read_metadata, DistributedCheckpointReader.load

    def counting(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        parses.append(self.path)
        return read_metadata(self, *args, **kwargs)

    def recording(self: DistributedCheckpointReader, entries: dict) -> dict:
        loads.append(sum(isinstance(value, torch.Tensor) for value in entries.values()))
        return load(self, entries)

    monkeypatch.setattr(FileSystemReader, "read_metadata", counting)
    monkeypatch.setattr(DistributedCheckpointReader, "load", recording)
    write_consolidated(path, tmp_path / "one.ckpt")
    assert len(parses) == 1
    tensor_loads = [count for count in loads if count]
    assert sum(tensor_loads) == len(reader.tensors()) and len(tensor_loads) < len(reader.tensors()) / 2
    consolidated = torch.load(tmp_path / "one.ckpt", weights_only=True, mmap=True)
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        torch.testing.assert_close(consolidated["state_dict"][name], _striped(shapes[name], 64), rtol=0, atol=0)
    assert len(consolidated["optimizer_states"][0]["state"]) == len(shapes)
