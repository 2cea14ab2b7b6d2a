"""Steps/s of `Trainer(accelerator="neuron")` against a hand-written torch_xla loop, side by side, per recipe.

`PJRT_DEVICE=CPU python -m benchmarks.overhead [--workloads mlp vit bert] [--repeats 3] [--steps N] [--warmup N]
[--breakdown]`

Runs alternate (plugin, hand-written, plugin, ...) so that load from other processes hits both sides alike; the
figure is the ratio of the median steps/s, plugin / hand-written (target >= 0.97). The CPU-time ratio (hand-written /
plugin CPU time per step, all threads of this process) is the same comparison, less disturbed by other processes
on a shared machine (on XLA:CPU the device is the host CPU). The plugin side has a CSVLogger
and the default progress bar on (it draws on the terminal between the figures), checkpointing and validation off.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/overhead.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import (  # noqa: E402
    Measurement,
    add_workload_args,
    describe_machine,
    format_table,
    median,
    run_baseline,
    run_plugin,
    selected_workloads,
)

TARGET = 0.97


#: `--breakdown`: plugin variants run after each plugin/hand-written pair, as `run_plugin` keyword arguments
BREAKDOWN = {
    "plugin, no bar/logger": {"bar_and_logger": False},
    "plugin, no bar/logger, self.log no-op": {"bar_and_logger": False, "module_logging": False},
}


def main(argv: list[str] | None = None) -> list[list[object]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    add_workload_args(parser, repeats=3)
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the plugin " + " and ".join(f"'{name}'" for name in BREAKDOWN)
                             + ", to see where the per-step cost goes")
    args = parser.parse_args(argv)
    variants = {"plugin": {}, "hand-written": None, **(BREAKDOWN if args.breakdown else {})}
    rows = []
    for workload in selected_workloads(args):
        runs: dict[str, list[Measurement]] = {name: [] for name in variants}
        for repeat in range(args.repeats):  # alternate: plugin, hand-written, [variants], plugin, ...
            for name, kwargs in variants.items():
                runs[name].append(run_baseline(workload) if kwargs is None else run_plugin(workload, **kwargs))
            print(f"[{workload.name}] repeat {repeat + 1}/{args.repeats}: " + ", ".join(
                f"{name} {r[-1].steps_per_s:.3g} steps/s ({r[-1].cpu_ms_per_step:.3g} CPU ms/step)"
                for name, r in runs.items()), flush=True)
        rate = {name: median([m.steps_per_s for m in r]) for name, r in runs.items()}
        cpu = {name: median([m.cpu_ms_per_step for m in r]) for name, r in runs.items()}
        ratio = rate["plugin"] / rate["hand-written"]
        compiles = max(m.window.compiles for r in runs.values() for m in r)
        extra = [f"{rate[name]:.3g} ({rate[name] / rate['hand-written']:.3f}), {cpu[name]:.3g} ms"
                 for name in BREAKDOWN if name in rate]
        rows.append([workload.name, f"{workload.warmup} + {workload.steps}", args.repeats, f"{rate['plugin']:.3g}",
                     f"{rate['hand-written']:.3g}", f"{ratio:.3f}", "yes" if ratio >= TARGET else "no",
                     f"{cpu['plugin']:.3g}", f"{cpu['hand-written']:.3g}", f"{cpu['hand-written'] / cpu['plugin']:.3f}",
                     *extra, compiles])
    print()
    print(describe_machine())
    header = ["workload", "warm-up + timed steps", "runs/side", "plugin steps/s", "hand-written steps/s",
              "ratio", f">= {TARGET}", "plugin CPU ms/step", "hand-written CPU ms/step", "CPU-time ratio"]
    header += [f"{name}: steps/s (ratio), CPU ms/step" for name in BREAKDOWN if args.breakdown]
    print(format_table([*header, "compiles while timed (max)"], rows))
    return rows

if __name__ == "__main__":
    main()
