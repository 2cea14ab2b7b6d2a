"""How long a sharded checkpoint save stops training, synchronous against asynchronous
(`NeuronCheckpointIO(async_save=True)`, `lightning_trn.core.checkpoint.async_save`).

`LIGHTNING_TRN_STANDIN=1 .venv-native/bin/python -m benchmarks.async_save [--hidden 2048] [--layers 2] [--ranks 2]
[--batch 1] [--write-delay 12] [--every 40] [--saves 2]`

A `--ranks`-rank FSDP job (`strategy="fsdp"`, stand-in `neuron` devices) trains an MLP of `--layers` square
`--hidden` layers with AdamW on `--batch` samples per rank and step (the model and optimizer state sharded over the
ranks) and saves a DCP checkpoint every `--every` steps (`ModelCheckpoint(every_n_train_steps=...)`, `save_top_k=1`:
each save replaces the previous one, as a job's periodic checkpoint), `--saves` times after a warm-up save; once with
synchronous saves, once asynchronous.

Slow storage: on the stand-in a step runs on the host CPU (many times slower than on a NeuronCore) while a save goes
to the local page cache, so a synchronous save costs a fraction of a step there; a job on Trainium writing to FSx, EFS
or S3 sees the opposite. `--write-delay` makes every rank's DCP file write of a save take that many seconds longer (a
sleep in torch's `FileSystemWriter.write_data`, holding no lock: storage latency, not host work), so that the
synchronous save takes many steps, as it does there. Keep `--every` steps longer than a save's write: a save waits
for the previous one.

Rank 0 times every step from one batch start to the next: the save runs at the end of its step, and under an
asynchronous save the writes' competition for the host (the GIL, the cores, the page cache) shows in the steps
during them. Blocked time per save = (the steps' total - their count x the median step) / saves, in seconds and in
median steps (noisy on a shared machine: it can come out below zero); the saving step's own time over the median is
the save call's cost alone; "staging" is the time `AsyncCheckpointer.save` took on rank 0 (the host copy and the
launch) and "state dict" Lightning's collection of the sharded state dicts (its copy from the device) before it. The
target: asynchronous blocked time <= max(1.5 steps, state dict + staging). Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/async_save.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: the arguments each job gets from the command line
_JOB_ARGS = ("hidden", "layers", "ranks", "batch", "write_delay", "every", "saves")


def worker(args: argparse.Namespace) -> None:
    """One job (this process is rank 0; Lightning launches the others): train, save, write rank 0's timings."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_trn.core.checkpoint.async_save import AsyncCheckpointer
    from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[torch.nn.Module] = []
            for _ in range(args.layers):
                layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh()]
            self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(pl.Callback):
        """Rank 0's batch-start times, and how long each save's state-dict collection took."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.save_started = 0.0
            self.state_dict_s: list[float] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_save_checkpoint(self, *_: Any) -> None:
            # Lightning calls it once it has collected the state dicts, before the strategy saves them
            self.state_dict_s.append(time.perf_counter() - self.save_started)

    if args.write_delay:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def slow_write(*a: Any, **k: Any) -> Any:
            time.sleep(args.write_delay)
            return write_data(*a, **k)

        FileSystemWriter.write_data = slow_write  # type: ignore[method-assign]
    steps = args.every * (args.saves + 1) + 1
    clock = Clock()
    io = NeuronCheckpointIO(async_save=args.mode == "async")
    staging: list[float] = []
    save = AsyncCheckpointer.save

    def timed_save(saver: AsyncCheckpointer, *a: Any, **k: Any) -> None:
        save(saver, *a, **k)
        staging.append(saver.last_blocked_s)

    AsyncCheckpointer.save = timed_save  # type: ignore[method-assign]  # the strategy's writer, made at its setup
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.batch * args.ranks * steps, args.hidden))
    trainer = pl.Trainer(
        accelerator="neuron",
        devices=args.ranks,
        strategy="fsdp",
        plugins=[io],
        max_steps=steps,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=args.out / "ckpts", every_n_train_steps=args.every, save_top_k=1), clock],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    save_checkpoint = trainer.save_checkpoint

    def timed_save_checkpoint(*a: Any, **k: Any) -> None:  # what ModelCheckpoint calls
        clock.save_started = time.perf_counter()
        save_checkpoint(*a, **k)

    trainer.save_checkpoint = timed_save_checkpoint  # type: ignore[method-assign]
    trainer.fit(Net(), DataLoader(data, batch_size=args.batch))
    if trainer.is_global_zero:
        record = {"starts": clock.starts, "state_dict_s": clock.state_dict_s, "staging_s": staging}
        (args.out / f"{args.mode}.json").write_text(json.dumps(record))


def summarize(record: dict[str, Any], every: int) -> dict[str, float]:
    """Median step; per save (past the warm-up save): blocked seconds (all steps over the median), the saving
    step's own seconds over the median, state-dict and staging seconds."""
    times = [b - a for a, b in zip(record["starts"], record["starts"][1:], strict=False)]
    measured = times[every:]  # from the step after the warm-up save's
    median = statistics.median(measured)
    saves = len(measured) // every
    blocked = (sum(measured) - len(measured) * median) / saves
    save_step = statistics.mean(measured[every - 1 :: every]) - median  # the step a save ends
    state_dict = statistics.mean(record["state_dict_s"][1:])
    staging = statistics.mean(record["staging_s"][1:]) if record["staging_s"] else 0.0
    return {"step": median, "blocked": blocked, "save_step": save_step, "state_dict": state_dict, "staging": staging}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.async_save",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="samples per rank and step")
    parser.add_argument(
        "--write-delay", type=float, default=12.0, help="seconds more per write of a save (slow storage)"
    )
    parser.add_argument("--every", type=int, default=40, help="steps between saves")
    parser.add_argument("--saves", type=int, default=2, help="timed saves, after a warm-up one")
    parser.add_argument("--mode", choices=("sync", "async"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        worker(args)
        return []
    from benchmarks._harness import describe_machine, format_table

    env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": str(args.ranks)}
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for mode in ("sync", "async"):
            out = Path(scratch) / mode
            out.mkdir()
            command = [sys.executable, "-m", "benchmarks.async_save", "--mode", mode, "--out", str(out)]
            command += [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in _JOB_ARGS]
            subprocess.run(command, check=True, env=env, cwd=Path(__file__).resolve().parent.parent)
            results[mode] = summarize(json.loads((out / f"{mode}.json").read_text()), args.every)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    header = [
        "saves",
        "state MB per rank",
        "step s",
        "blocked s per save",
        "blocked in steps",
        "saving step over median s",
        "state dict s",
        "staging s",
    ]
    rows = []
    for mode, r in results.items():
        mb = params * 4 * 3 / args.ranks / 2**20  # fp32 weights and AdamW's two moments
        rows.append(
            [
                mode,
                f"{mb:.0f}",
                f"{r['step']:.3f}",
                f"{r['blocked']:.3f}",
                f"{r['blocked'] / r['step']:.1f}",
                f"{r['save_step']:.3f}",
                f"{r['state_dict']:.3f}",
                f"{r['staging']:.3f}" if mode == "async" else "-",
            ]
        )
    sync, background = results["sync"], results["async"]
    target = max(1.5 * background["step"], background["state_dict"] + background["staging"])
    print(describe_machine())
    print(format_table(header, rows))
    print(
        f"async / sync blocked time: {background['blocked'] / sync['blocked']:.2f}; async blocked "
        f"{background['blocked']:.3f} s against the target {target:.3f} s (max of 1.5 steps and state dict + staging)"
    )
    return [{"mode": mode, **r} for mode, r in results.items()]


if __name__ == "__main__":
    main()
