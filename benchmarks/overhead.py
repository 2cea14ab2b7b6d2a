"""Steps/s of `Trainer(accelerator="neuron")` against a hand-written torch_xla loop, side by side, per recipe.

`PJRT_DEVICE=CPU python -m benchmarks.overhead [--workloads mlp vit bert] [--repeats 3] [--steps N] [--warmup N]
[--breakdown [--lightning-on-cpu]]`

Runs alternate (plugin, hand-written, plugin, ...) so that load from other processes hits both sides alike; the
figure is the median over the repeats of plugin / hand-written steps/s, each repeat's pair run back to back (target
>= 0.97): on a shared VM the speed of the same loop drifts by 20-40% over minutes, which pairs of adjacent runs
cancel. The CPU-time ratio (hand-written / plugin CPU time per step, all threads of this process) is the same
comparison, less disturbed by other processes on a shared machine (on XLA:CPU the device is the host CPU). The
plugin side has a CSVLogger and the default progress bar on (it draws on the terminal between the figures),
checkpointing and validation off.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/overhead.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import (
    Measurement,
    Workload,
    add_workload_args,
    describe_machine,
    format_table,
    median,
    run_baseline,
    run_plugin,
    selected_workloads,
)

TARGET = 0.97
FLOOR = "plugin, no bar/logger, self.log no-op"
CPU_FLOOR = "Lightning on CPU, no bar/logger, self.log no-op"
CPU_BASELINE = "hand-written on CPU"
NO_LOADER_CUT = "hand-written, loader without per-batch sync"


def paired(
    runs: list[Measurement], baseline: list[Measurement], compare: Callable[[Measurement, Measurement], float]
) -> float:
    """Median over the repeats of `compare(run, baseline run of the same repeat)`."""
    return median([compare(run, base) for run, base in zip(runs, baseline, strict=True)])


def speed_ratio(run: Measurement, base: Measurement) -> float:
    return run.steps_per_s / base.steps_per_s


def cpu_time_ratio(run: Measurement, base: Measurement) -> float:
    """Baseline / run CPU time per step: higher is better, like `speed_ratio`."""
    return base.cpu_ms_per_step / run.cpu_ms_per_step


def extra_ms_per_step(run: Measurement, base: Measurement) -> float:
    """The wall time per step `run` takes beyond `base`."""
    return 1e3 / run.steps_per_s - 1e3 / base.steps_per_s


#: `--breakdown`: variants run after each plugin/hand-written pair: the plugin without parts of its work, and the
#: hand-written loop with the plugin's pipelining (no sync in the loader)
BREAKDOWN: dict[str, Callable[[Workload], Measurement]] = {
    "plugin, no bar/logger": partial(run_plugin, bar_and_logger=False),
    FLOOR: partial(run_plugin, bar_and_logger=False, module_logging=False),
    NO_LOADER_CUT: partial(run_baseline, loader_cuts=False),
}
#: `--lightning-on-cpu`: the floor of `BREAKDOWN` in stock Lightning on the CPU accelerator, and its baseline
CPU_REFERENCE: dict[str, Callable[[Workload], Measurement]] = {
    CPU_FLOOR: partial(run_plugin, bar_and_logger=False, module_logging=False, accelerator="cpu"),
    CPU_BASELINE: partial(run_baseline, accelerator="cpu"),
}


def main(argv: list[str] | None = None) -> list[list[object]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    add_workload_args(parser, repeats=3)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time "
        + ", ".join(f"'{name}'" for name in BREAKDOWN)
        + ", to see where the per-step cost goes and what the plugin's pipelining gains",
    )
    parser.add_argument(
        "--lightning-on-cpu",
        action="store_true",
        help=f"with --breakdown: also time '{CPU_FLOOR}' against '{CPU_BASELINE}', what Lightning's "
        "own loop costs per step with neither lightning_trn nor XLA in it",
    )
    args = parser.parse_args(argv)
    variants: dict[str, Callable[[Workload], Measurement]] = {"plugin": run_plugin, "hand-written": run_baseline}
    if args.breakdown:
        variants.update(BREAKDOWN)
        if args.lightning_on_cpu:
            variants.update(CPU_REFERENCE)
    rows = []
    for workload in selected_workloads(args):
        runs: dict[str, list[Measurement]] = {name: [] for name in variants}
        for repeat in range(args.repeats):  # alternate: plugin, hand-written, [variants], plugin, ...
            for name, run in variants.items():
                runs[name].append(run(workload))
            print(
                f"[{workload.name}] repeat {repeat + 1}/{args.repeats}: "
                + ", ".join(
                    f"{name} {r[-1].steps_per_s:.3g} steps/s ({r[-1].cpu_ms_per_step:.3g} CPU ms/step)"
                    for name, r in runs.items()
                ),
                flush=True,
            )
        rate = {name: median([m.steps_per_s for m in r]) for name, r in runs.items()}
        cpu = {name: median([m.cpu_ms_per_step for m in r]) for name, r in runs.items()}
        ratio = {name: paired(r, runs["hand-written"], speed_ratio) for name, r in runs.items()}
        cpu_ratio = paired(runs["plugin"], runs["hand-written"], cpu_time_ratio)
        compiles = max(m.window.compiles for r in runs.values() for m in r)
        extra = [f"{rate[name]:.3g} ({ratio[name]:.3f}), {cpu[name]:.3g} ms" for name in BREAKDOWN if name in rate]
        if NO_LOADER_CUT in runs:
            extra.append(f"{paired(runs['plugin'], runs[NO_LOADER_CUT], speed_ratio):.3f}")
        if CPU_FLOOR in runs:
            extra += [
                f"{paired(runs[FLOOR], runs['hand-written'], extra_ms_per_step):.3g}",
                f"{paired(runs[CPU_FLOOR], runs[CPU_BASELINE], extra_ms_per_step):.3g}",
            ]
        rows.append(
            [
                workload.name,
                f"{workload.warmup} + {workload.steps}",
                args.repeats,
                f"{rate['plugin']:.3g}",
                f"{rate['hand-written']:.3g}",
                f"{ratio['plugin']:.3f}",
                "yes" if ratio["plugin"] >= TARGET else "no",
                f"{cpu['plugin']:.3g}",
                f"{cpu['hand-written']:.3g}",
                f"{cpu_ratio:.3f}",
                *extra,
                compiles,
            ]
        )
    print()
    print(describe_machine())
    header = [
        "workload",
        "warm-up + timed steps",
        "runs/side",
        "plugin steps/s (median)",
        "hand-written steps/s (median)",
        "ratio (median of pairs)",
        f">= {TARGET}",
        "plugin CPU ms/step",
        "hand-written CPU ms/step",
        "CPU-time ratio",
    ]
    if args.breakdown:
        header += [f"{name}: steps/s (ratio), CPU ms/step" for name in BREAKDOWN]
        header.append(f"plugin / {NO_LOADER_CUT}")
    if args.breakdown and args.lightning_on_cpu:
        header += ["loop floor on XLA: ms/step over hand-written", "loop floor on CPU: ms/step over hand-written"]
    print(format_table([*header, "compiles while timed (max)"], rows))
    return rows


if __name__ == "__main__":
    main()
