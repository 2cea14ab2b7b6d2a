"""Reading a sharded checkpoint of Llama-3-8B's layout on 64 ranks: consolidation, safetensors export and the
one-device load, against reading it entry by entry as lightning_trn did before (one `FileSystemReader` and one
`dcp.load` per tensor entry, each parsing `.metadata` again), and beside torch's own whole-directory conversion,
`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` (one `dcp.load` of everything: the host holds the whole
state at once, where `consolidate` holds one batch).

`python -m benchmarks.dcp_read [--layers 32] [--ranks 64] [--scale 64] [--baseline-entries 24]`

The checkpoint is synthetic, with the layout an FSDP2 save of the Trainer gives (`state_dict.<parameter>`, AdamW's
`exp_avg` and `exp_avg_sq` sharded on dim 0 over every rank, `step` on one rank, `param_groups` as byte entries):
the metadata DCP's global planner makes of such a save (checked equal to `create_default_global_save_plan`'s),
written by DCP's `FileSystemWriter`: 1,176 entries, 56,163 chunks, 6.7 MB for 32 layers on 64 ranks. Only the sizes
are divided by `--scale` (dim 0 rounded up to a multiple of the ranks, as Llama-3-8B's sizes are), so the files stay
small. The entry-by-entry baseline takes over a second of CPU per entry at this size, so it reads
`--baseline-entries` entries spread over the checkpoint and is extrapolated to all of them (0 reads them all).
Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

if __package__ in (None, ""):  # `python benchmarks/dcp_read.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_trn.core.checkpoint.distributed_checkpoint import (
    METADATA_FILE,
    DistributedCheckpointReader,
    load_consolidated,
    write_consolidated,
    write_safetensors,
)

#: Llama-3-8B (hidden size, key/value projection rows, MLP size, vocabulary, blocks)
HIDDEN, KV, MLP, VOCAB, LAYERS = 4096, 1024, 14336, 128256, 32
#: AdamW's hyperparameters, one byte entry each in a DCP checkpoint
_GROUP = {
    "lr": 3e-4,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "weight_decay": 0.1,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


def llama_shapes(layers: int = LAYERS, scale: int = 1, ranks: int = 64) -> dict[str, tuple[int, ...]]:
    """Llama-3-8B's parameter names and shapes with `layers` blocks, every size divided by `scale` and dim 0 rounded
    up to a multiple of `ranks` (FSDP2 shards dim 0; at full size every rank holds an equal block of it)."""

    def shape(*sizes: int) -> tuple[int, ...]:
        scaled = [max(1, size // scale) for size in sizes]
        scaled[0] = math.ceil(scaled[0] / ranks) * ranks
        return tuple(scaled)

    shapes = {"model.embed_tokens.weight": shape(VOCAB, HIDDEN)}
    for layer in range(layers):
        block = f"model.layers.{layer}."
        shapes.update(
            {
                block + "self_attn.q_proj.weight": shape(HIDDEN, HIDDEN),
                block + "self_attn.k_proj.weight": shape(KV, HIDDEN),
                block + "self_attn.v_proj.weight": shape(KV, HIDDEN),
                block + "self_attn.o_proj.weight": shape(HIDDEN, HIDDEN),
                block + "mlp.gate_proj.weight": shape(MLP, HIDDEN),
                block + "mlp.up_proj.weight": shape(MLP, HIDDEN),
                block + "mlp.down_proj.weight": shape(HIDDEN, MLP),
                block + "input_layernorm.weight": shape(HIDDEN),
                block + "post_attention_layernorm.weight": shape(HIDDEN),
            }
        )
    shapes["model.norm.weight"] = shape(HIDDEN)
    shapes["lm_head.weight"] = shape(VOCAB, HIDDEN)
    return shapes


def write_fsdp_checkpoint(path: Any, shapes: dict[str, tuple[int, ...]], ranks: int = 64) -> None:
    """An FSDP2 AdamW checkpoint of parameters `shapes` (after one step) saved by `ranks` ranks, in DCP's format:
    the metadata DCP's global planner makes of the ranks' plans (every sharded entry a chunk of dim 0 per rank in
    rank order, `step` replicated and kept once, `param_groups` as byte entries), written by
    `FileSystemWriter.finish`. Every chunk a rank saved holds the rank's number (`step`: 1). Chunk shapes repeat, so
    each rank's `__<rank>_0.distcp` stores each distinct chunk once and the metadata points every chunk of that
    shape there (a zip archive per chunk would take longer to write than to read); a reader still loads every chunk
    on its own."""
    os.makedirs(path, exist_ok=True)
    entries: dict[str, Any] = {}
    mappings: dict[str, tuple] = {}
    results: list[WriteResult] = []
    stored: list[dict[Any, _StorageInfo]] = [{} for _ in range(ranks)]
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(os.path.join(path, f"__{rank}_0.distcp"), "wb")) for rank in range(ranks)]
        properties = TensorProperties(dtype=torch.float32)

        def store(rank: int, index: MetadataIndex, key: Any, value: Callable[[], Any]) -> None:
            if key not in stored[rank]:
                buffer = io.BytesIO()
                torch.save(value(), buffer)
                file = files[rank]
                stored[rank][key] = _StorageInfo(os.path.basename(file.name), file.tell(), buffer.tell())
                file.write(buffer.getvalue())
            info = dataclasses.replace(stored[rank][key])  # one object per chunk, as in a real save's pickled metadata
            results.append(WriteResult(index, info.length, info))

        for name, shape in shapes.items():
            rows = shape[0] // ranks
            for path_of in (
                ("state_dict", name),
                *(("optimizer_0", "state", name, state) for state in ("exp_avg", "exp_avg_sq")),
            ):
                fqn = ".".join(path_of)
                mappings[fqn] = path_of
                chunks = []
                for rank in range(ranks):
                    offset = torch.Size((rank * rows,) + (0,) * (len(shape) - 1))
                    sizes = torch.Size((rows, *shape[1:]))
                    chunks.append(ChunkStorageMetadata(offsets=offset, sizes=sizes))
                    store(
                        rank,
                        MetadataIndex(fqn, offset, rank),
                        sizes,
                        lambda sizes=sizes, rank=rank: torch.full(sizes, float(rank)),
                    )
                entries[fqn] = TensorStorageMetadata(properties, torch.Size(shape), chunks)
            path_of = ("optimizer_0", "state", name, "step")
            fqn = ".".join(path_of)
            mappings[fqn] = path_of
            chunk = ChunkStorageMetadata(offsets=torch.Size(), sizes=torch.Size())
            entries[fqn] = TensorStorageMetadata(properties, torch.Size(), [chunk])
            store(0, MetadataIndex(fqn, torch.Size(), 0), torch.Size(), lambda: torch.tensor(1.0))
        for key, value in {**_GROUP, "params": list(shapes)}.items():
            path_of = ("optimizer_0", "param_groups", 0, key)
            fqn = ".".join(map(str, path_of))
            mappings[fqn] = path_of
            entries[fqn] = BytesStorageMetadata()
            store(0, MetadataIndex(fqn), fqn, lambda value=value: value)
    writer = FileSystemWriter(path, sync_files=False)
    writer.set_up_storage_writer(True)
    writer.finish(Metadata(entries, planner_data=mappings), [results])


def read_entry_by_entry(path: Any, keys: list[str]) -> None:
    """The tensor entries `keys` read as lightning_trn read them before: a new reader and a `dcp.load` per entry."""
    tensors = DistributedCheckpointReader(path).tensors()
    for key in keys:
        md = tensors[key]
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        dcp.load(
            {key: torch.empty(md.size, dtype=md.properties.dtype)},
            storage_reader=FileSystemReader(path),
            planner=planner,
            no_dist=True,
        )


def _timed(function: Any, *args: Any) -> tuple[float, float]:
    """Wall-clock and CPU seconds of `function(*args)` (CPU time is what a shared machine disturbs least)."""
    wall, cpu = time.perf_counter(), time.process_time()
    function(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.dcp_read", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--scale", type=int, default=64, help="divide every size by this")
    parser.add_argument(
        "--baseline-entries",
        type=int,
        default=24,
        help="tensor entries the entry-by-entry baseline reads, extrapolated (0: all)",
    )
    args = parser.parse_args(argv)
    from benchmarks._harness import format_table

    warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = os.path.join(scratch, "last.ckpt")
        write_fsdp_checkpoint(checkpoint, llama_shapes(args.layers, args.scale, args.ranks), args.ranks)
        reader = DistributedCheckpointReader(checkpoint)
        keys = list(reader.tensors())
        chunks = sum(len(md.chunks) for md in reader.tensors().values())
        metadata_mb = os.path.getsize(os.path.join(checkpoint, METADATA_FILE)) / 2**20
        sample = keys if args.baseline_entries <= 0 else keys[:: max(1, len(keys) // args.baseline_entries)]
        before = [seconds / len(sample) * len(keys) for seconds in _timed(read_entry_by_entry, checkpoint, sample)]
        after = _timed(write_consolidated, checkpoint, os.path.join(scratch, "one.ckpt"))
        torch_own = _timed(dcp_to_torch_save, checkpoint, os.path.join(scratch, "torch.pt"))
        loaded = _timed(load_consolidated, checkpoint)
        exported = _timed(write_safetensors, checkpoint, os.path.join(scratch, "model.safetensors"))
    entries = len(reader.metadata.state_dict_metadata)
    estimate = "" if len(sample) == len(keys) else f", from {len(sample)} entries"
    header = [
        "entries (tensors)",
        "chunks",
        ".metadata",
        "before: entry by entry",
        "consolidate",
        "ratio (CPU)",
        "torch's dcp_to_torch_save",
        "consolidate / torch's (CPU)",
        "load_consolidated",
        "safetensors export",
    ]
    print(
        format_table(
            header,
            [
                [
                    f"{entries} ({len(keys)})",
                    chunks,
                    f"{metadata_mb:.1f} MB",
                    f"{before[0]:.0f} s ({before[1]:.0f} s CPU{estimate})",
                    f"{after[0]:.1f} s ({after[1]:.1f} s CPU)",
                    f"{before[1] / after[1]:.0f}x",
                    f"{torch_own[0]:.1f} s ({torch_own[1]:.1f} s CPU)",
                    f"{after[1] / torch_own[1]:.2f}",
                    f"{loaded[0]:.1f} s ({loaded[1]:.1f} s CPU)",
                    f"{exported[0]:.1f} s ({exported[1]:.1f} s CPU)",
                ]
            ],
        )
    )


if __name__ == "__main__":
    main()
