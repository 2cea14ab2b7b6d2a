"""What one rank reads to resume a sharded checkpoint, by world size: bytes and metadata calls per rank at load, and
what each rank's random state costs (lightning_trn.core.checkpoint.random_state: each rank's entry in its own file).

`LIGHTNING_TRN_STANDIN=1 .venv-native/bin/python -m benchmarks.checkpoint_load_cost [--world-sizes 2 4]`

For each world size W, one Fabric job (`strategy="fsdp"`, W stand-in devices, a fixed 4-layer MLP, AdamW) saves a
sharded checkpoint and loads it. Each rank counts, around its `fabric.load` only: bytes read (`rchar` of
/proc/self/io: every `read` of a file, and of the process group's sockets), metadata calls (Python's `os.stat`,
`os.lstat`, `os.listdir`, `os.scandir` and `open`, counted by wrappers: what Lightning, torch.distributed.checkpoint
and lightning_trn call), and the bytes of the files it reads whose size depends on W: `meta.pt` (which every rank
reads whole) and its random-state file. "meta.pt with every rank's state" is what `meta.pt` weighed before this change
(every rank's entry in it: the file's size now plus W entries), read by every rank. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/checkpoint_load_cost.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_COUNTED = ("stat", "lstat", "listdir", "scandir")


def _rchar() -> int:
    with open("/proc/self/io") as file:
        return next(int(line.split()[1]) for line in file if line.startswith("rchar"))


def worker(out: Path, world_size: int) -> None:
    """One job (this process is rank 0; Fabric launches the others): save, then load while counting."""
    import torch
    from lightning.fabric import Fabric

    import lightning_trn  # noqa: F401  # registers accelerator="neuron"
    from lightning_trn.core.checkpoint.random_state import rank_file_name

    fabric = Fabric(accelerator="neuron", devices=world_size, strategy="fsdp")
    fabric.launch()
    fabric.seed_everything(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(4)]
    model = fabric.setup_module(torch.nn.Sequential(*layers))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loss = model(torch.randn(8, 256, device=fabric.device)).square().mean()
    fabric.backward(loss)
    optimizer.step()
    path = out / f"w{world_size}" / "state.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    fabric.barrier()

    calls = {"open": 0, **dict.fromkeys(_COUNTED, 0)}
    originals = {name: getattr(os, name) for name in _COUNTED}
    builtin_open = builtins.open

    def counting(name: str, function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return counted

    before = _rchar()
    for name, function in originals.items():
        setattr(os, name, counting(name, function))
    builtins.open = counting("open", builtin_open)
    try:
        fabric.load(path, {"model": model, "optimizer": optimizer, "step": 0})
    finally:
        for name, function in originals.items():
            setattr(os, name, function)
        builtins.open = builtin_open
    read = _rchar() - before
    rank = fabric.global_rank
    record = {
        "bytes_read": read,
        "metadata_calls": sum(calls.values()),
        "meta_pt": (path / "meta.pt").stat().st_size,
        "rank_file": (path / rank_file_name(rank)).stat().st_size,
        "dcp_metadata": (path / ".metadata").stat().st_size,
        "shard": sum(p.stat().st_size for p in path.glob(f"__{rank}_*.distcp")),
    }
    (out / f"w{world_size}-rank{rank}.json").write_text(json.dumps(record))
    fabric.barrier()


def run(world_sizes: list[int]) -> list[dict[str, Any]]:
    """One job per world size; each rank's record."""
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory)
        for world_size in world_sizes:
            env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": str(world_size)}
            command = [sys.executable, "-m", "benchmarks.checkpoint_load_cost", "--worker", str(world_size)]
            subprocess.run([*command, "--out", str(out)], env=env, check=True, cwd=Path(__file__).parents[1])
            for rank in range(world_size):
                record = json.loads((out / f"w{world_size}-rank{rank}.json").read_text())
                rows.append({"world_size": world_size, "rank": rank, **record})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_load_cost", description=__doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.out, args.worker)
        return
    rows = run(args.world_sizes)
    print(
        "| ranks | rank | bytes read at load | beyond its shard | metadata calls at load | meta.pt | its random-state "
        "file | meta.pt with every rank's state (before) | DCP .metadata | its shard |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        before = row["meta_pt"] + row["world_size"] * row["rank_file"]
        print(
            f"| {row['world_size']} | {row['rank']} | {row['bytes_read']:,} | {row['bytes_read'] - row['shard']:,} | "
            f"{row['metadata_calls']} | "
            f"{row['meta_pt']:,} | {row['rank_file']:,} | {before:,} | {row['dcp_metadata']:,} | {row['shard']:,} |"
        )


if __name__ == "__main__":
    main()
