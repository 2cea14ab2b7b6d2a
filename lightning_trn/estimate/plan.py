"""Which layouts of a job fit: `plan(job, ...)` estimates each tensor-parallel size and activation-checkpointing
choice at growing micro-batches and keeps, per choice, the largest micro-batch that fits (`python -m
lightning_trn.estimate <recipe> --plan`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_trn.estimate.report import API, Estimate

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


#: what `plan` asks the caller for each layout: (module factory, one micro-batch, Trainer arguments)
Job = Callable[[int, bool, int], tuple[Callable[[], Any], Any, dict[str, Any]]]


def plan(
    job: Job,
    tensor_parallel_sizes: Sequence[int],
    activation_checkpointing: Sequence[bool] = (False, True),
    micro_batches: Sequence[int] = MICRO_BATCHES,
    *,
    platform: str | None = None,
    caller: str = API,
) -> list[Layout]:
    """For each tensor-parallel size and activation-checkpointing choice, the largest of `micro_batches` (tried
    smallest first, stopping at the first that does not fit) whose job fits.

    Args:
        job: `job(tensor_parallel_size, activation_checkpointing, micro_batch)` returns the `estimate` arguments of
            that layout: `(module_factory, batch, trainer_kwargs)`.
    """
    from lightning_trn.estimate.simulation import estimate

    if not micro_batches:
        raise ValueError("plan: micro_batches is empty; give the micro-batch sizes to try.")
    layouts = []
    for size in tensor_parallel_sizes:
        for checkpointing in activation_checkpointing:
            layout: Layout | None = None
            for micro_batch in sorted(micro_batches):
                factory, batch, trainer_kwargs = job(size, checkpointing, micro_batch)
                result = estimate(factory, batch, platform=platform, caller=caller, **trainer_kwargs)
                if not result.fits:
                    layout = layout or Layout(size, checkpointing, None, result)
                    break
                layout = Layout(size, checkpointing, micro_batch, result)
            if layout is not None:
                layouts.append(layout)
    return layouts


def format_plan(layouts: Sequence[Layout]) -> str:
    """The plan as a table, one row per layout; the layouts that fit first, the largest micro-batch first."""
    header = (
        f"{'tensor parallel':>15} | {'act. checkpointing':>18} | {'largest micro-batch':>19} | {'needed per rank':>15}"
    )
    lines = [header]
    order = sorted(layouts, key=lambda layout: (layout.micro_batch is None, -(layout.micro_batch or 0)))
    for layout in order:
        fits = str(layout.micro_batch) if layout.micro_batch is not None else "none fits"
        needed = f"{layout.estimate.needed / _GIB:.2f} GiB"
        lines.append(
            f"{layout.tensor_parallel_size:>15} | {str(layout.activation_checkpointing).lower():>18} | {fits:>19} | "
            f"{needed:>15}"
        )
    capacity = layouts[0].estimate.capacity / _GIB if layouts else 0
    lines.append(f"capacity per rank: {capacity:.2f} GiB (needed: peak x (1 + margin) + reserved)")
    return "\n".join(lines)
