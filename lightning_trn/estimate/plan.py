"""Which layouts of a job fit, fastest first: `plan(job, ...)` estimates each (tensor-parallel, context-parallel)
shape and activation-checkpointing choice at growing micro-batches and keeps, per choice, the largest micro-batch
that fits;
`format_plan` orders them by the step-time model's tokens/s per chip (`step_time`), the ones that do not fit last
(`python -m lightning_trn.estimate <recipe> --plan`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_trn.estimate.report import API, Estimate
from lightning_trn.estimate.step_time import StepTime, seconds

_GIB = 2**30
#: the micro-batches tried by default, smallest first: memory grows with the micro-batch, so the first that does not
#: fit ends a choice's search
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Layout:
    """One choice of the plan and what it allows: the largest micro-batch that fits (None: not even the smallest)
    and that micro-batch's estimate (else the smallest's, which shows by how much it is over)."""

    tensor_parallel_size: int
    activation_checkpointing: bool
    micro_batch: int | None
    estimate: Estimate
    context_parallel_size: int = 1


#: what `plan` asks the caller for each layout: (module factory, one micro-batch, Trainer arguments); its first
#: argument is a tensor-parallel size, or a (tensor-parallel, context-parallel) pair
Job = Callable[[Any, bool, int], tuple[Callable[[], Any], Any, dict[str, Any]]]


def plan(
    job: Job,
    tensor_parallel_sizes: Sequence[int | tuple[int, int]],
    activation_checkpointing: Sequence[bool] = (False, True),
    micro_batches: Sequence[int] = MICRO_BATCHES,
    *,
    platform: str | None = None,
    caller: str = API,
) -> list[Layout]:
    """For each tensor-parallel size (or (tensor, context)-parallel pair) and activation-checkpointing choice, the
    largest of `micro_batches` (tried smallest first, stopping at the first that does not fit) whose job fits.

    Args:
        job: `job(size, activation_checkpointing, micro_batch)` returns the `estimate` arguments of that layout:
            `(module_factory, batch, trainer_kwargs)`; `size` as given in `tensor_parallel_sizes`.
    """
    from lightning_trn.estimate.simulation import estimate

    if not micro_batches:
        raise ValueError("plan: micro_batches is empty; give the micro-batch sizes to try.")
    layouts = []
    for size in tensor_parallel_sizes:
        tensor, context = size if isinstance(size, tuple) else (size, 1)
        for checkpointing in activation_checkpointing:
            layout: Layout | None = None
            for micro_batch in sorted(micro_batches):
                factory, batch, trainer_kwargs = job(size, checkpointing, micro_batch)
                result = estimate(factory, batch, platform=platform, caller=caller, **trainer_kwargs)
                if not result.fits:
                    layout = layout or Layout(tensor, checkpointing, None, result, context)
                    break
                layout = Layout(tensor, checkpointing, micro_batch, result, context)
            if layout is not None:
                layouts.append(layout)
    return layouts


def _tokens_per_s(timing: StepTime | None) -> float:
    """Predicted tokens/s per chip; 0 when unknown (no prediction, or no token ids in the batch)."""
    return (timing.tokens_per_s_per_chip or 0.0) if timing is not None else 0.0


def format_plan(layouts: Sequence[Layout]) -> str:
    """The plan as a table, one row per layout: the layouts that fit first, fastest first (predicted tokens/s per
    chip at their largest micro-batch), then the ones that do not."""
    context = any(layout.context_parallel_size > 1 for layout in layouts)  # its column only where it varies
    header = (
        (f"{'context parallel':>16} | " if context else "")
        + f"{'tensor parallel':>15} | {'act. checkpointing':>18} | {'largest micro-batch':>19} | "
        f"{'needed per rank':>15} | {'tokens/s per chip':>17} | {'MFU':>6} | {'step':>8}"
    )
    lines = [header]
    # each layout's prediction once: the order and its row read it
    timed = [(layout, layout.estimate.step_time() if layout.micro_batch is not None else None) for layout in layouts]
    order = sorted(timed, key=lambda pair: (pair[0].micro_batch is None, -_tokens_per_s(pair[1])))
    for layout, timing in order:
        fits = str(layout.micro_batch) if layout.micro_batch is not None else "none fits"
        needed = f"{layout.estimate.needed / _GIB:.2f} GiB"
        speed = f"{_tokens_per_s(timing):,.0f}" if timing is not None and timing.tokens_per_s_per_chip else "-"
        mfu = f"{100 * timing.mfu:.1f} %" if timing is not None else "-"
        step = seconds(timing.step_s) if timing is not None else "-"
        lines.append(
            (f"{layout.context_parallel_size:>16} | " if context else "")
            + f"{layout.tensor_parallel_size:>15} | {str(layout.activation_checkpointing).lower():>18} | {fits:>19} | "
            f"{needed:>15} | {speed:>17} | {mfu:>6} | {step:>8}"
        )
    capacity = layouts[0].estimate.capacity / _GIB if layouts else 0
    lines.append(f"capacity per rank: {capacity:.2f} GiB (needed: peak x (1 + margin) + reserved)")
    timing = next((timing for _, timing in order if timing is not None), None)
    if timing is not None:
        lines.append(
            'tokens/s per chip, MFU and step: the step-time model (docs/sharding.md, "How fast?") at the largest '
            "micro-batch that fits; constants:"
        )
        lines += [f"  {source}" for source in timing.hardware.sources]
    return "\n".join(lines)
