"""`python -m lightning_trn.healthcheck`: the health check as a command, on one process or many (the Fabric
launcher starts them, or torchrun / SLURM did). Exit code 0: every check passed; 1: a check failed or a rank did not
answer (every rank that can says which); 3: this process was stuck in a device call."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from lightning_trn.healthcheck import (
    DEFAULT_SIZE_MB,
    DEFAULT_TIMEOUT_S,
    HealthCheckError,
    check_arguments,
    run_health_check,
)


def _launch_defaults(env: dict[str, str]) -> tuple[str, int]:
    """(devices, num_nodes) the launcher gave this job: torchrun's or SLURM's, else all local cores on one node."""
    if "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env:
        local = int(env["LOCAL_WORLD_SIZE"])
        return str(local), max(1, int(env["WORLD_SIZE"]) // local)
    if "SLURM_NTASKS_PER_NODE" in env:
        return env["SLURM_NTASKS_PER_NODE"].split("(")[0], int(env.get("SLURM_NNODES", "1"))
    return "auto", 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m lightning_trn.healthcheck [--devices N] [--num-nodes M]`: 0 when every check passed."""
    devices, num_nodes = _launch_defaults(dict(os.environ))
    parser = argparse.ArgumentParser(
        prog="python -m lightning_trn.healthcheck", description="Check NeuronCores and collectives before training."
    )
    parser.add_argument(
        "--devices",
        default=devices,
        help="processes (NeuronCores) per node; default: the launcher's, else all ('auto')",
    )
    parser.add_argument("--num-nodes", type=int, default=num_nodes, help="nodes; default: the launcher's, else 1")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a rank waits for the others at each phase"
    )
    parser.add_argument("--size-mb", type=int, default=DEFAULT_SIZE_MB, help="MiB per copy and timed all-reduce")
    parser.add_argument("--iters", type=int, default=5, help="timed all-reduce repetitions")
    parser.add_argument("--json", default=None, help="also write the report (rank 0) to this file")
    args = parser.parse_args(argv)
    try:
        check_arguments(args.timeout, args.size_mb, args.iters)
    except ValueError as err:
        parser.error(str(err))

    from lightning.fabric import Fabric

    devices_arg: Any = int(args.devices) if str(args.devices).isdigit() else args.devices
    fabric = Fabric(accelerator="neuron", devices=devices_arg, num_nodes=args.num_nodes)
    fabric.launch()
    try:
        report = run_health_check(fabric.strategy, timeout=args.timeout, size_mb=args.size_mb, iters=args.iters)
    except HealthCheckError as err:
        # every rank says it: a launcher that sees one rank exit may kill the others before they could
        sys.stderr.write(f"[rank {fabric.global_rank}] {err}\n")
        return 1
    if fabric.global_rank == 0:
        print(report.summary())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(asdict(report), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
