"""Will a job fit? Simulate one training step of a job at its real world size, in one process, without memory.

`estimate(module_factory, batch, accelerator="neuron", devices=64, strategy=..., precision=...)` runs the plugin's own
strategy code (`Trainer.fit`: the strategy's environment, `configure_model`, sharding, materialization, optimizer
setup, then two training steps: forward, backward, gradient reduction, optimizer step) as one rank of the job would,
with

- PyTorch's fake process group (`init_process_group("fake")`): every collective returns at once, as TorchTitan's
  estimator (`scripts/estimate/estimation.py`) does;
- fake tensors (`FakeTensorMode`) on the `neuron` device: shapes, dtypes and devices, no storage;
- PyTorch's `FSDPMemTracker` (FSDP2 models) or `MemTracker` (others): every tensor allocated on the device, filed
  as parameters, gradients, optimizer state, activations or temporaries, and the peak;
- `CommDebugMode`: the collectives of the second step (its counts), with their buffer sizes.

The first step creates the optimizer state; the second is measured with it present (`reset_mod_stats` and a fresh
peak between), as `torch.neuron.reset_peak_memory_stats()` before it and `max_memory_allocated()` after it would.
Ranks whose shards have the same shapes have the same memory: rank 0 stands for them (`ranks=` simulates others).
With pipeline stages one rank of each kind of stage is simulated (first, middle, last), torch's schedule running
every microbatch, and the report adds the schedule's bubble and each stage's transfers (`report.PipelineEstimate`).
Lightning's loop runs unchanged except that it logs nothing (`logger=False`, no progress bar or checkpoints) and the
module's `log` calls are dropped: host bookkeeping of scalars, not device memory.

A job fits when `peak * (1 + margin) + reserved <= capacity` (`report.PLATFORMS`: each number with its source).
It runs the same with or without `LIGHTNING_TRN_STANDIN` and needs no device-count variable: where no Neuron stack
is installed it loads the CPU stand-in itself and gives it the simulated node's devices for the simulation only.
`python -m lightning_trn.estimate llm preset=trn2-8b [key=value ...]` does this for a recipe (docs/sharding.md,
"Will it fit?").

Modules: `simulation` (the simulated rank), `patches` (the process state a simulation changes and puts back),
`report` (the platforms' budgets, the result and its text), `plan` (the layouts of a job that fit, `--plan`).
"""

from __future__ import annotations

from lightning_trn.estimate.patches import EstimateError, native_device
from lightning_trn.estimate.plan import Layout, format_plan, plan
from lightning_trn.estimate.report import (
    API,
    CAPACITY_GIB,
    PLATFORMS,
    RECIPE,
    ROWS,
    XLA_NOTE,
    XLA_PLATFORMS,
    Collective,
    Estimate,
    PipelineEstimate,
    PlatformBudget,
    RankMemory,
    bubble_fraction,
)
from lightning_trn.estimate.simulation import default_platform, describe, estimate, simulate_rank, stage_kinds

__all__ = [
    "API",
    "CAPACITY_GIB",
    "XLA_NOTE",
    "XLA_PLATFORMS",
    "describe",
    "PLATFORMS",
    "Collective",
    "Estimate",
    "EstimateError",
    "Layout",
    "RECIPE",
    "ROWS",
    "native_device",
    "PipelineEstimate",
    "PlatformBudget",
    "RankMemory",
    "bubble_fraction",
    "default_platform",
    "estimate",
    "format_plan",
    "plan",
    "simulate_rank",
    "stage_kinds",
]
