"""Device behaviour of each recipe's training loop: compiles after warm-up, host transfers per step, CPU fallbacks.

`PJRT_DEVICE=CPU python -m benchmarks.device_behaviour [--workloads mlp vit bert] [--steps N] [--warmup N]`

One run per side (plugin, then hand-written) with the runtime's counters (`get_runtime().metrics()`, from
`torch_xla.debug.metrics`) read before every timed step. Targets for the plugin: 0 compiles after warm-up, no
device-to-host transfer on steps other than logging steps and epoch ends, 0 CPU-fallback ops.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/device_behaviour.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import (
    Measurement,
    add_workload_args,
    describe_machine,
    format_table,
    run_baseline,
    run_plugin,
    selected_workloads,
)


def transfers_by_kind(run: Measurement) -> str:
    """Device-to-host transfers and `.item()` reads per kind of step, e.g. `other 0/140, logging 0/3, epoch end 4/2`
    (transfers / steps of that kind)."""
    steps = Counter(run.step_kinds)
    moved: Counter = Counter()
    for kind, delta in zip(run.step_kinds, run.per_step, strict=True):
        moved[kind] += delta.device_to_host + delta.scalar_reads
    return ", ".join(f"{kind} {moved[kind]}/{steps[kind]}" for kind in ("other", "logging", "epoch end") if steps[kind])


def main(argv: list[str] | None = None) -> list[list[object]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_behaviour", description=__doc__.splitlines()[0])
    add_workload_args(parser)
    args = parser.parse_args(argv)
    rows = []
    for workload in selected_workloads(args):
        for side, run in (("plugin", run_plugin), ("hand-written", run_baseline)):
            m = run(workload, record_steps=True)
            other_steps = [d for d, k in zip(m.per_step, m.step_kinds, strict=True) if k == "other"]
            clean = all(d.device_to_host == 0 and d.scalar_reads == 0 for d in other_steps)
            rows.append(
                [
                    workload.name,
                    side,
                    f"{workload.warmup} + {workload.steps}",
                    m.whole.compiles - m.window.compiles,
                    m.window.compiles,
                    f"{m.window.executions / workload.steps:.2f}",
                    transfers_by_kind(m),
                    "yes" if clean else "no",
                    dict(m.whole.cpu_fallbacks) or 0,
                ]
            )
            print(f"[{workload.name}] {side}: done", flush=True)
    print()
    print(describe_machine())
    print(
        format_table(
            [
                "workload",
                "loop",
                "warm-up + timed steps",
                "compiles in warm-up",
                "compiles after warm-up",
                "executions/step",
                "D2H transfers + scalar reads / steps, by kind of step",
                "none on other steps",
                "CPU fallbacks (whole run)",
            ],
            rows,
        )
    )
    return rows


if __name__ == "__main__":
    main()
