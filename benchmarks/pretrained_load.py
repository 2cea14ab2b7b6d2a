"""Loading a Hugging Face `save_pretrained` folder into a model sharded with FSDP2 over 2 ranks: each rank reading its
own blocks (`lightning_trn.load_pretrained`), against each rank reading the whole safetensors files
(the bytes read and deserialized with `safetensors.torch.load` and kept: what a loader that is not sharding-aware
costs every rank before it can keep its shard).

`LIGHTNING_TRN_STANDIN=1 .venv-native/bin/python -m benchmarks.pretrained_load [--hidden 1024] [--layers 8]
[--vocab 32000] [--ranks 2]`

A random Llama (Llama-3's proportions: MLP 3.5 x hidden, 4 query heads per key/value head, untied LM head) is saved
with `save_pretrained` in shards of 200 MB, then a Fabric job on `--ranks` stand-in `neuron` devices builds it on the
meta device, shards every decoder layer and the root with `fully_shard`, and each rank times `load_pretrained`; after
a barrier each rank times reading every file whole. Per rank: wall and CPU seconds, bytes read from the files, host
peak (VmHWM over VmRSS before, `/proc/self/status`). Both read from the page cache (the files were just written):
this times the reading and copying, not the disk. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/pretrained_load.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _measured(function: Callable[[], Any]) -> dict[str, float]:
    """Wall and CPU seconds of `function()` and this process's host peak while it ran, over its resident memory
    before."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from VmRSS
    before = _status_kib("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return {
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "peak_bytes": (_status_kib("VmHWM") - before) * 1024,
    }


def save_folder(path: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random Llama of these sizes saved with `save_pretrained` in `path`; returns its weights' bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(hidden // 128, 4)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 7 // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200MB")
    return sum(p.nbytes for p in model.state_dict().values())


def worker(folder: str, ranks: int, out: Path) -> None:
    """One rank of the Fabric job: sharded load timed, then the whole files read, timed; writes `rank-<r>.json`."""
    import safetensors
    import torch
    from lightning.fabric import Fabric
    from safetensors.torch import load
    from torch.distributed.fsdp import fully_shard

    from lightning_trn import load_pretrained, meta_model_from_pretrained
    from lightning_trn.fabric import NeuronModelParallelStrategy

    read = {"bytes": 0}
    safe_open = safetensors.safe_open

    class CountingSlice:  # counts the bytes of each block read (headers are free)
        def __init__(self, part: Any) -> None:
            self.part = part

        def get_shape(self) -> list[int]:
            return self.part.get_shape()

        def __getitem__(self, block: Any) -> torch.Tensor:
            tensor = self.part[block]
            read["bytes"] += tensor.nbytes
            return tensor

    class CountingFile:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.file = safe_open(*args, **kwargs)

        def __enter__(self) -> CountingFile:
            self.file.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.file.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.file.keys()

        def get_slice(self, key: str) -> CountingSlice:
            return CountingSlice(self.file.get_slice(key))

        def get_tensor(self, key: str) -> torch.Tensor:
            tensor = self.file.get_tensor(key)
            read["bytes"] += tensor.nbytes
            return tensor

    record: dict[str, Any] = {}

    def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        safetensors.safe_open = CountingFile
        try:
            record["sharded"] = _measured(lambda: load_pretrained(model, folder, device=fabric.device))
        finally:
            safetensors.safe_open = safe_open
        record["sharded"]["read_bytes"] = read["bytes"]
        return model

    strategy = NeuronModelParallelStrategy(parallelize, data_parallel_size=ranks, tensor_parallel_size=1)
    fabric = Fabric(accelerator="neuron", devices=ranks, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(meta_model_from_pretrained(folder))
    record["held_bytes"] = sum(p.to_local().nbytes for p in model.module.parameters())
    fabric.barrier()
    files = sorted(Path(folder).glob("*.safetensors"))
    whole: list[dict[str, torch.Tensor]] = []
    # `load_file` would map the files and read nothing until used: the bytes are read and deserialized here, kept
    record["whole"] = _measured(lambda: whole.extend(load(file.read_bytes()) for file in files))
    record["whole"]["read_bytes"] = sum(t.nbytes for state in whole for t in state.values())
    (out / f"rank-{fabric.global_rank}.json").write_text(json.dumps(record))


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f}"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pretrained_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.ranks, Path(args.worker[1]))
        return []
    from benchmarks._harness import format_table

    with tempfile.TemporaryDirectory() as scratch:
        folder, out = Path(scratch) / "model", Path(scratch) / "out"
        out.mkdir()
        model_bytes = save_folder(folder, args.hidden, args.layers, args.vocab)
        env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": str(args.ranks)}
        command = [
            sys.executable,
            "-m",
            "benchmarks.pretrained_load",
            "--ranks",
            str(args.ranks),
            "--worker",
            str(folder),
            str(out),
        ]
        subprocess.run(command, check=True, env=env, cwd=Path(__file__).resolve().parent.parent)
        records = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(args.ranks)]
    header = [
        "rank",
        "model MB",
        "shard MB",
        "load_pretrained s (CPU s)",
        "read MB",
        "host peak MB",
        "whole files s (CPU s)",
        "read MB (whole)",
        "host peak MB (whole)",
        "time ratio",
        "peak ratio",
    ]
    rows = []
    for rank, record in enumerate(records):
        sharded, whole = record["sharded"], record["whole"]
        rows.append(
            [
                rank,
                _mb(model_bytes),
                _mb(record["held_bytes"]),
                f"{sharded['wall_s']:.2f} ({sharded['cpu_s']:.2f})",
                _mb(sharded["read_bytes"]),
                _mb(sharded["peak_bytes"]),
                f"{whole['wall_s']:.2f} ({whole['cpu_s']:.2f})",
                _mb(whole["read_bytes"]),
                _mb(whole["peak_bytes"]),
                f"{sharded['wall_s'] / whole['wall_s']:.2f}",
                f"{sharded['peak_bytes'] / whole['peak_bytes']:.2f}",
            ]
        )
    print(format_table(header, rows))
    return records


if __name__ == "__main__":
    main()
