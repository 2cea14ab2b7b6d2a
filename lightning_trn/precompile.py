"""Fill the compile cache ahead of training: `python -m lightning_trn.precompile [--steps N] script.py [args...]`.

The training command runs unchanged in a child process with `LIGHTNING_TRN_PRECOMPILE_STEPS=N`; the Neuron
strategies read it and cut the run to one epoch of `N` training and `N` validation batches, enough to meet every
graph of a fixed-shape loop. Graphs land in whatever cache the script configures (`NeuronCompileCache`).
On a Neuron host with `neuron_parallel_compile` on the PATH the command runs under it: graphs are extracted with
`NEURON_EXTRACT_GRAPHS_ONLY=1` (outputs are fake, so checkpoints and loggers are skipped) and compiled in parallel.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys

import lightning.pytorch as pl

from lightning_trn.runtime import get_runtime

log = logging.getLogger(__name__)

PRECOMPILE_STEPS_ENV = "LIGHTNING_TRN_PRECOMPILE_STEPS"
#: set by `neuron_parallel_compile`: tensors hold no real values, only the graphs are recorded
GRAPHS_ONLY_ENV = "NEURON_EXTRACT_GRAPHS_ONLY"


def precompile_steps() -> int | None:
    """The step cap of a precompile run, or None in a normal run."""
    value = os.environ.get(PRECOMPILE_STEPS_ENV, "").strip()
    return int(value) if value else None


def graphs_only() -> bool:
    """Whether this process only extracts graphs, so its tensor values are fake and must not be saved."""
    return os.environ.get(GRAPHS_ONLY_ENV, "").strip().lower() in ("1", "true", "yes")


def apply_precompile_limits(trainer: pl.Trainer) -> None:
    """In a precompile run, shorten the Trainer's run; with fake outputs also drop its loggers. No-op otherwise."""
    steps = precompile_steps()
    if steps is not None:
        trainer.limit_train_batches = steps
        trainer.limit_val_batches = steps
        trainer.fit_loop.max_epochs = 1
        log.info("lightning_trn precompile: one epoch of %d training and validation batches.", steps)
    if graphs_only() and trainer.loggers:
        trainer.loggers = []
        log.info("lightning_trn: %s=1, outputs are fake: loggers disabled.", GRAPHS_ONLY_ENV)


def build_command(target: list[str]) -> list[str]:
    """`python script.py args` or `python -m module args`; on Neuron wrapped in `neuron_parallel_compile`."""
    command = [sys.executable, *target]
    wrapper = shutil.which("neuron_parallel_compile") if get_runtime().on_neuron() else None
    return [wrapper, *command] if wrapper else command


def _parse(argv: list[str]) -> tuple[int, list[str]]:
    """Split `[--steps N] (script.py | -m module) [args...]`: everything from the script or `-m` on is the target."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_trn.precompile",
        usage="%(prog)s [--steps N] (script.py | -m module) [args...]",
        description="Run a training command for a few steps to fill the compile cache.",
    )
    parser.add_argument("--steps", type=int, default=3, help="training and validation batches to run (default 3)")
    split = 0
    while split < len(argv) and argv[split] != "-m" and argv[split].startswith("-"):
        split += 2 if argv[split] == "--steps" else 1
    args = parser.parse_args(argv[:split])
    target = argv[split:]
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if not target or (target[0] == "-m" and len(target) < 2):
        parser.error("give the training command: script.py [args...] or -m module [args...]")
    return args.steps, target


def main(argv: list[str] | None = None) -> int:
    """Run the precompile and return the child's exit code."""
    steps, target = _parse(sys.argv[1:] if argv is None else argv)
    command = build_command(target)
    env = {**os.environ, PRECOMPILE_STEPS_ENV: str(steps)}
    print(f"lightning_trn precompile ({steps} steps): {' '.join(command)}", file=sys.stderr)
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
