"""Compile-cache warm start: time to first step and compile-cache lookups, cold cache vs warm cache.

`PJRT_DEVICE=CPU python -m benchmarks.compile_cache [--workload vit] [--steps 3] [--repeats 1]`

A cache is enabled per process before its first compile, so each run is a child process training a few steps with
`NeuronCompileCache(<dir>)`: first with an empty directory (cold), then again with the same one (warm). XLA:CPU
(torch-xla 2.9) finds every entry on the warm run but cannot load it (`unloadable`) and compiles again, so the time
ratio is ~1 there; the saving needs Neuron, whose compiler loads its cached NEFFs (docs/compilation.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/compile_cache.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import WORKLOADS, config_and_loader, format_table, fresh_module

_REPO = Path(__file__).resolve().parent.parent
#: the child's last stdout line starts with this, followed by its figures as JSON
_RESULT = "COMPILE_CACHE_RESULT "


def child(workload_name: str, cache_dir: str, steps: int) -> None:
    """Train `steps` steps with the cache at `cache_dir`; print time to first step, compiles and cache counters."""
    import lightning.pytorch as pl

    from benchmarks._harness import wait_for_device
    from lightning_trn import NeuronCompileCache
    from lightning_trn.runtime import get_runtime

    workload = WORKLOADS[workload_name]
    _, loader = config_and_loader(workload)
    module = fresh_module(workload)
    figures: dict[str, Any] = {}

    class FirstStep(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if "time_to_first_step" not in figures:
                wait_for_device()
                figures["time_to_first_step"] = time.perf_counter() - start
                figures["compiles_first_step"] = get_runtime().metrics().compiles

    trainer = pl.Trainer(
        accelerator="neuron",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[NeuronCompileCache(cache_dir), FirstStep()],
        default_root_dir=cache_dir,
    )
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    wait_for_device()
    figures["fit_time"] = time.perf_counter() - start
    figures["compiles"] = get_runtime().metrics().compiles
    figures.update(get_runtime().compile_cache_counters())
    print(_RESULT + json.dumps(figures), flush=True)


def run_child(workload: str, cache_dir: str, steps: int) -> dict[str, Any]:
    """One child process (`--child`); returns its figures plus `process_time` (interpreter start to exit)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.compile_cache",
        "--child",
        cache_dir,
        "--workload",
        workload,
        "--steps",
        str(steps),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=_REPO, capture_output=True, text=True, env=dict(os.environ))
    elapsed = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    if done.returncode or not lines:
        raise RuntimeError(f"child run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return {**json.loads(lines[-1][len(_RESULT) :]), "process_time": elapsed}


def main(argv: list[str] | None = None) -> list[list[object]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_cache", description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="vit", help="recipe to train (default vit)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    parser.add_argument("--repeats", type=int, default=1, help="cold/warm pairs, each with a new directory")
    parser.add_argument("--child", metavar="CACHE_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.workload, args.child, args.steps)
        return []
    rows = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="bench-compile-cache-") as cache_dir:
            cold = run_child(args.workload, cache_dir, args.steps)
            warm = run_child(args.workload, cache_dir, args.steps)
        for name, run in (("cold", cold), ("warm", warm)):
            rows.append(
                [
                    repeat + 1,
                    name,
                    f"{run['time_to_first_step']:.2f}",
                    f"{run['fit_time']:.2f}",
                    f"{run['process_time']:.1f}",
                    run["compiles_first_step"],
                    run["compiles"],
                    run.get("hits", "-"),
                    run.get("misses", "-"),
                    run.get("unloadable", "-"),
                ]
            )
        ratio = warm["time_to_first_step"] / cold["time_to_first_step"]
        rows.append(
            [
                repeat + 1,
                "warm / cold",
                f"{ratio:.2f}",
                f"{warm['fit_time'] / cold['fit_time']:.2f}",
                f"{warm['process_time'] / cold['process_time']:.2f}",
                "",
                "",
                "",
                "",
                "",
            ]
        )
        print(
            f"[{args.workload}] pair {repeat + 1}/{args.repeats}: time to first step warm/cold {ratio:.2f}", flush=True
        )
    print()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, workload {args.workload}, {args.steps} steps/run, "
        f"PJRT_DEVICE={os.environ.get('PJRT_DEVICE', '(unset)')}"
    )
    print(
        format_table(
            [
                "pair",
                "run",
                "time to first step (s)",
                "fit (s)",
                "process (s)",
                "compiles by first step",
                "compiles",
                "cache hits",
                "cache misses",
                "unloadable",
            ],
            rows,
        )
    )
    return rows


if __name__ == "__main__":
    main()
