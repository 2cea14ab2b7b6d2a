"""`python -m lightning_trn.consolidate <sharded checkpoint directory> <output file>`: one portable checkpoint file
from a sharded one (ZeRO-1 with `state_dict_type="sharded"`, docs/memory.md).

CPU only, no process group, no device: it reads the directory's main file and every rank's chunk file
(memory-mapped) and writes the checkpoint with the full optimizer state, CPU tensors only, atomically: what
`Trainer(accelerator="cpu" or "gpu").fit(..., ckpt_path=<output file>)` and `torch.load(..., weights_only=True)` load.
"""

from __future__ import annotations

import argparse
from typing import Optional

from lightning_trn.core.checkpoint_io import NeuronCheckpointIO


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_trn.consolidate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a sharded checkpoint directory (it holds checkpoint.pt and zero1-rank*.pt)")
    parser.add_argument("output", help="the checkpoint file to write")
    args = parser.parse_args(argv)
    io = NeuronCheckpointIO()
    io.save_checkpoint(io.load_checkpoint(args.checkpoint), args.output)
    print(f"lightning_trn: wrote {args.output} from {args.checkpoint}")


if __name__ == "__main__":
    main()
