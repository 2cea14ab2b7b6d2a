"""The parallel conformance sweep: every cell (model family x layout x training event) trains the same model as one
device, within the tolerance `tests/tolerance.py` derives from the reference's own float32 error, or is refused
before its first update with a paragraph that says what is unsupported. Never a third outcome.

    python -m tests.conformance_parallel                 # the whole table (about an hour on 2 cores)
    python -m tests.conformance_parallel --core          # the cells CI runs (test_parallel_conformance.py)
    python -m tests.conformance_parallel --families qwen3 --layouts tp pp_1f1b --events accumulate

Each layout runs as one job of its ranks on the stand-in (`tests/scripts/conformance_worker.py`), all of the layout's
cells one after another; the references run in one process on the CPU, in float32, in float64 and in float32 under
another kernel set (`ATEN_CPU_CAPABILITY`): the bound is 4 x the larger of the reference's float64 error and that
spread, since a layout sums in another order too. Adam turns a rounding difference in a near-zero gradient into a
difference of up to the learning rate, element by element, so weights are compared beyond 4 x each element's Adam
allowance, derived from the references' recorded gradients and AdamW settings (`tests.tolerance.adam_allowance`).
A job that dies
leaves its finished cells; the first unfinished one is the failing cell, and the rest run again in a new job. The
table is printed as markdown (docs/sharding.md, "Conformance") and written to `--out/table.md` with every cell's
ratio to its bound.

Equality means the same data on both sides (the worker's docstring): the reference reads, as one batch, the block of
the sampler's permutation that the layout's data-parallel ranks read together.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

#: model families: a user's module as docs/sharding.md shows it, nanoGPT's nested ModuleDict with tied weights, and
#: every `SUPPORTED_MODEL_TYPES` entry through the LLM recipe's pretrained path (tiny `save_pretrained` folders), the
#: tied-embedding variants of the two families whose small checkpoints tie (Llama 3.2, Qwen2.5)
#: and Llama on packed sequences (documents kept apart by position ids and the mask, `llama_packed`)
FAMILIES = ("user", "nanogpt_tied", "llama", "mistral", "qwen2", "qwen3", "llama_tied", "qwen2_tied", "llama_packed")

#: layouts: ranks (`world`) and the strategy's mesh; pipeline layouts have 2 pipeline ranks and 4 layers
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"world": 2, "strategy": "ddp"},
    "fsdp2": {"world": 2, "dp": 2},
    "tp": {"world": 2, "tp": 2},
    "hsdp": {"world": 4, "replicate": 2, "dp": 2},
    "pp_gpipe": {"world": 2, "pp": 2, "schedule": "GPipe"},
    "pp_1f1b": {"world": 2, "pp": 2, "schedule": "1F1B"},
    "pp_interleaved": {"world": 2, "pp": 2, "schedule": "Interleaved1F1B"},
    "pp_zbv": {"world": 2, "pp": 2, "schedule": "ZBVZeroBubble"},
    "pp_fsdp2": {"world": 4, "pp": 2, "dp": 2, "schedule": "1F1B"},
    "pp_zbv_fsdp2": {"world": 4, "pp": 2, "dp": 2, "schedule": "ZBVZeroBubble"},
    "pp_tp": {"world": 4, "pp": 2, "tp": 2, "schedule": "1F1B"},
    "pp_tp_fsdp2": {"world": 8, "pp": 2, "tp": 2, "dp": 2, "schedule": "1F1B"},
    "compiled_fsdp2_tp": {"world": 4, "dp": 2, "tp": 2, "compile": True},
    "cp": {"world": 2, "cp": 2},
    "cp4": {"world": 4, "cp": 4},
    "cp_fsdp2": {"world": 4, "dp": 2, "cp": 2},
    "cp_tp": {"world": 4, "cp": 2, "tp": 2},
    "cp_hsdp": {"world": 4, "replicate": 2, "cp": 2},
}
#: the context-parallel layouts: each sequence split over the context ranks
CONTEXT_LAYOUTS = tuple(name for name, layout in LAYOUTS.items() if layout.get("cp", 1) > 1)

#: training events: optimizer steps (`steps`), sequences in the dataset (8 per batch on every layout), and what
#: happens on the way
EVENTS: dict[str, dict[str, Any]] = {
    "accumulate": {"steps": 2, "sequences": 64, "accumulate": 2},
    "val_in_window": {"steps": 2, "sequences": 64, "accumulate": 2, "validate": True},
    "last_batch": {"steps": 3, "sequences": 20},  # batches of 8, 8 and 4 sequences: one epoch
    "clip": {"steps": 2, "sequences": 64, "clip": 0.05},  # the gradient norm is above 0.05 at every step
    "resume": {"steps": 4, "sequences": 64, "accumulate": 2},  # stopped and saved after step 2, resumed
    "predict": {"steps": 1, "sequences": 64, "predict": True},
}


class Cell(NamedTuple):
    family: str
    layout: str
    event: str

    @property
    def name(self) -> str:
        return f"{self.family}.{self.layout}.{self.event}"


#: the cells CI runs: the eight cases of the conformance issue and one of each family, layout and event
CORE: tuple[Cell, ...] = (
    Cell("nanogpt_tied", "pp_1f1b", "accumulate"),  # tied weights across stages
    Cell("user", "pp_fsdp2", "val_in_window"),  # gradients kept across validation under pipeline x FSDP2
    Cell("qwen3", "tp", "accumulate"),  # Qwen3's q_norm / k_norm in the tensor-parallel plan
    Cell("user", "pp_1f1b", "last_batch"),  # a smaller batch through the stages
    Cell("llama", "pp_fsdp2", "clip"),  # the recipe's stages under FSDP2 (reduce once, no reshard after forward)
    Cell("nanogpt_tied", "pp_zbv_fsdp2", "accumulate"),  # ZBVZeroBubble x FSDP2, a tie inside one rank's stages
    Cell("llama_tied", "pp_zbv", "accumulate"),  # the recipe's stages under the split backward, pretrained, tied
    Cell("nanogpt_tied", "pp_tp", "resume"),  # pipeline x tensor parallel, tied across stages, resumed
    Cell("qwen3", "pp_tp", "predict"),  # the recipe's stages with tensor parallel inside (3-D with FSDP2)
    Cell("llama_tied", "pp_tp", "accumulate"),  # refused: a tied head under pipeline x tensor parallel
    Cell("user", "pp_zbv", "predict"),  # refused: ZBVZeroBubble does not evaluate
    Cell("user", "pp_zbv", "val_in_window"),  # refused when the fit starts, not at its first validation
    Cell("mistral", "fsdp2", "predict"),
    Cell("qwen2_tied", "hsdp", "val_in_window"),
    Cell("user", "ddp", "last_batch"),
    # context x tensor parallel in one job: packed documents stopped and resumed; Qwen3's per-head norms, validation
    Cell("llama_packed", "cp_tp", "resume"),
    Cell("qwen3", "cp_tp", "val_in_window"),
)

#: the cells that must be refused (every other cell must equal one device): the recipe refuses a tied head under
#: pipeline x tensor parallel (`lightning_trn.recipes.llm.parallelize.refuse_stages_with`), and ZBVZeroBubble does
#: not evaluate (`refuse_evaluation`: torch's V schedules run backward actions in `eval()`; a fit that validates is
#: refused at `on_train_start`, `predict` at its first batch), and a
#: last batch that does not divide into the microbatches is refused before the first (`Pipelining.check_loader`)
EXPECTED: dict[Cell, str] = {
    **{
        Cell(family, layout, event): "refused"
        for family in FAMILIES
        if family.endswith("_tied") and family != "nanogpt_tied"
        for layout in ("pp_tp", "pp_tp_fsdp2")
        for event in EVENTS
    },
    **{
        Cell(family, layout, event): "refused"
        for family in FAMILIES
        for layout in ("pp_zbv", "pp_zbv_fsdp2")
        for event in ("val_in_window", "predict")
    },
    # 4 microbatches (2 ranks x 2 stages) and 2 data-parallel ranks: the last batch, 2 per rank, does not divide
    **{Cell(family, "pp_zbv_fsdp2", "last_batch"): "refused" for family in FAMILIES},
    # context parallel: the two user modules shard over `device_mesh["data_parallel"]` alone (their gradients would
    # not be summed over the context ranks), refused at setup (`check_replicated_sharding`)
    **{
        Cell(family, layout, event): "refused"
        for family in ("user", "nanogpt_tied")
        for layout in CONTEXT_LAYOUTS
        for event in EVENTS
    },
}

ROOT = Path(__file__).resolve().parents[1]
#: a job in which no cell ends for this long is stuck (a rank waiting for one that died): it is killed
STALL_S = 240
WORKER = ROOT / "tests" / "scripts" / "conformance_worker.py"


def cells(families: Iterable[str], layouts: Iterable[str], events: Iterable[str]) -> list[Cell]:
    return [Cell(f, layout, e) for f in families for layout in layouts for e in events]


def _environment(world: int, **extra: str) -> dict[str, str]:
    from tests.launch import child_env

    return child_env(LIGHTNING_TRN_STANDIN="1", LIGHTNING_TRN_STANDIN_DEVICES=str(max(world, 2)), **extra)


def other_capability() -> str:
    """The kernel set the reference's spread is measured under: `default` (no vector kernels), or `avx2` when this
    run is under `default` already."""
    return "avx2" if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else "default"


def _read(out: Path) -> dict[str, dict[str, Any]]:
    records = {}
    path = out / "cells.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[Cell(*record["cell"]).name] = record
    return records


def _job(command: list[str], env: dict[str, str], out: Path, stall: float) -> str:
    """Run one job to its end, or kill it (all its ranks) once no cell has ended for `stall` seconds; its output."""
    import signal
    import time

    log = out / "job.log"
    with log.open("w") as output:
        proc = subprocess.Popen(
            command, env=env, cwd=out, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        progress, since = -1, time.monotonic()
        while proc.poll() is None:
            time.sleep(1)
            done = len(_read(out))
            if done != progress:
                progress, since = done, time.monotonic()
            elif time.monotonic() - since > stall:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                output.write(f"\nkilled: no cell ended for {stall:.0f} s\n")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # ranks the first one left behind
    return log.read_text()


def run_job(
    todo: list[Cell], out: Path, *arguments: str, world: int = 1, stall: float = STALL_S, **env: str
) -> dict[str, dict]:
    """Run `todo` in jobs of `world` ranks until each has a record: the first cell a dead job left without one is
    recorded as crashed (with the job's output), and the rest run again."""
    from tests.launch import free_port

    records: dict[str, dict] = {}
    out.mkdir(parents=True, exist_ok=True)
    while todo:
        (out / "cells.jsonl").unlink(missing_ok=True)
        listing = out / "cells.json"
        listing.write_text(json.dumps([list(cell) for cell in todo]))
        command = [sys.executable, str(WORKER), "--cells", str(listing), "--out", str(out), *arguments]
        command += ["--world", str(world), "--port", str(free_port())]
        output = _job(command, _environment(world, **env), out, stall)
        finished = _read(out)
        records |= finished
        left = [cell for cell in todo if cell.name not in finished]
        ended = [finished[cell.name] for cell in todo if cell.name in finished]
        if left and not (ended and "error" in ended[-1] and not ended[-1].get("refused")):
            # not ended by its own failure: the job died (or hung) in the first cell it left
            records[left[0].name] = {"cell": list(left[0]), "crashed": output[-6000:]}
            left = left[1:]
        todo = left
    return records


def _reference_cells(todo: list[Cell]) -> list[Cell]:
    """One reference per (family, event, compiled or not): the layout only names what the reference runs like."""
    seen: dict[tuple[str, str], Cell] = {}
    for cell in todo:
        seen.setdefault((cell.family, cell.event), Cell(cell.family, "reference", cell.event))
    return list(seen.values())


def run_references(todo: list[Cell], out: Path) -> dict[str, dict]:
    """The one-device runs of `todo`'s families and events: in float32, in float64 (the float32 run's rounding error)
    and in float32 under another kernel set (`other_capability`: the spread of float32 runs that sum in another
    order, which a layout also does)."""
    references = _reference_cells(todo)
    float32 = run_job(references, out / "reference", "--accelerator", "cpu")
    float64 = run_job(references, out / "reference64", "--accelerator", "cpu", "--float64")
    spread = run_job(
        references, out / "reference-spread", "--accelerator", "cpu", ATEN_CPU_CAPABILITY=other_capability()
    )
    return {
        name: {**record, "float64": float64.get(name, {}), "spread": spread.get(name, {})}
        for name, record in float32.items()
    }


def judge(cell: Cell, record: dict[str, Any], reference: dict[str, Any]) -> tuple[str, str]:
    """The cell's verdict and its detail: ("equal", the largest ratio to a bound), ("refused", the paragraph) or
    ("FAIL", why)."""
    import torch

    from tests.tolerance import adam_allowance, losses_error, losses_ratio, weights_error, weights_ratio

    if "crashed" in record:
        return "FAIL", "the job died: " + record["crashed"].strip().splitlines()[-1][:300]
    if "error" in record:
        if record.get("refused"):
            return "refused", record["error"]
        return "FAIL", record["error"][:300]
    runs = (reference, reference["float64"], reference["spread"])
    if any("error" in run or "crashed" in run or "weights" not in run for run in runs):
        return "FAIL", "a reference failed: " + str([run.get("error") or run.get("crashed") for run in runs])[:300]
    weights = torch.load(record["weights"])
    reference_weights = torch.load(reference["weights"])
    twin, other = torch.load(reference["float64"]["weights"]), torch.load(reference["spread"]["weights"])
    if weights.keys() != reference_weights.keys():
        return "FAIL", f"other state-dict keys: {sorted(set(weights) ^ set(reference_weights))[:6]}"
    # what Adam alone makes of the gradients' rounding, element by element (tests/tolerance.py)
    allowance = adam_allowance(torch.load(reference["adam"]), torch.load(reference["float64"]["adam"]))
    # the reference's own error: from float64, or between two float32 summation orders, whichever is larger
    error = max(weights_error(reference_weights, twin), weights_error(reference_weights, other))
    ratios = {"weights": weights_ratio(weights, reference_weights, error, allowance)}
    layout = LAYOUTS[cell.layout]
    single_data_rank = layout.get("strategy") != "ddp" and layout.get("dp", 1) * layout.get("replicate", 1) == 1
    keys = ["predictions"] + (["losses", "val_losses"] if single_data_rank else [])
    for key in keys:
        ours, theirs = record[key], reference[key]
        theirs64, theirs_other = reference["float64"][key], reference["spread"][key]
        if isinstance(ours, dict):  # predictions by sample: those this layout's rank 0 made
            common = sorted(ours, key=int)
            ours, theirs, theirs64, theirs_other = (
                [d[i] for i in common] for d in (ours, theirs, theirs64, theirs_other)
            )
        if len(ours) != len(theirs):
            return "FAIL", f"{len(ours)} {key}, the reference has {len(theirs)}"
        if ours:
            error = max(losses_error(theirs, theirs64), losses_error(theirs, theirs_other))
            ratios[key] = losses_ratio(ours, theirs, error)
    worst = max(ratios, key=ratios.__getitem__)
    if ratios[worst] > 1:
        return "FAIL", f"{worst} {ratios[worst]:.3g} x the bound"
    return "equal", f"{ratios[worst]:.2f}"


def sweep(todo: list[Cell], out: Path) -> dict[str, tuple[str, str]]:
    """Every cell of `todo` run and judged."""
    references = run_references(todo, out)
    verdicts = {}
    for layout in dict.fromkeys(cell.layout for cell in todo):
        layout_cells = [cell for cell in todo if cell.layout == layout]
        world = LAYOUTS[layout]["world"]
        records = run_job(layout_cells, out / layout, world=world)
        for cell in layout_cells:
            reference = references[Cell(cell.family, "reference", cell.event).name]
            verdicts[cell.name] = judge(cell, records[cell.name], reference)
            print(f"{cell.name}: {' '.join(verdicts[cell.name])[:200]}", flush=True)
    return verdicts


def table(todo: list[Cell], verdicts: dict[str, tuple[str, str]]) -> str:
    """Markdown: a row per family and layout, a column per event; a cell is `=` (ratio to its bound), `refused` or
    `FAIL`."""
    events = list(dict.fromkeys(cell.event for cell in todo))
    lines = ["| family | layout | " + " | ".join(events) + " |", "|---|---|" + "---|" * len(events)]
    rows = dict.fromkeys((cell.family, cell.layout) for cell in todo)
    for family, layout in rows:
        entries = []
        for event in events:
            verdict, detail = verdicts.get(Cell(family, layout, event).name, ("", ""))
            entries.append({"equal": f"= ({detail})", "refused": "refused", "FAIL": "**FAIL**", "": ""}[verdict])
        lines.append(f"| {family} | {layout} | " + " | ".join(entries) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", action="store_true", help="only the cells CI runs")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--events", nargs="+", default=list(EVENTS), choices=list(EVENTS))
    parser.add_argument("--out", default=None, help="where the jobs write (default: a temporary directory)")
    args = parser.parse_args()
    todo = list(CORE) if args.core else cells(args.families, args.layouts, args.events)
    out = Path(args.out or tempfile.mkdtemp(prefix="conformance-"))
    verdicts = sweep(todo, out)
    text = table(todo, verdicts)
    refusals = {name: detail for name, (verdict, detail) in verdicts.items() if verdict != "equal"}
    (out / "table.md").write_text(text + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in refusals.items()) + "\n")
    print(text)
    for name, detail in refusals.items():
        print(f"- {name}: {detail}")
    print(f"written to {out}")
    unexpected = [cell for cell in todo if verdicts[cell.name][0] != EXPECTED.get(cell, "equal")]
    sys.exit(1 if unexpected else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    main()
