"""Worker script for tests/checkpoint/test_fault_tolerance.py: save a ~32 MB checkpoint to one path through
`NeuronCheckpointIO`, over and over, until killed.

Version v holds `weights = arange(N) + v` (float64), `version = v` and `checksum = weights.sum()`, so a reader can tell
a complete version from a mix. Prints `SAVED <v>` after each save returns.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO

NUMEL = 4 * 1024 * 1024  # float64: 32 MB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", required=True)
    parser.add_argument("--first-version", type=int, default=0)
    args = parser.parse_args()

    io = NeuronCheckpointIO()
    base = torch.arange(NUMEL, dtype=torch.float64)
    for version in itertools.count(args.first_version):
        weights = base + version
        io.save_checkpoint({"version": version, "weights": weights, "checksum": float(weights.sum())}, args.path)
        print(f"SAVED {version}", flush=True)


if __name__ == "__main__":
    main()
