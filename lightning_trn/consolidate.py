"""`python -m lightning_trn.consolidate <sharded checkpoint directory> <output file>`: one portable checkpoint file
from a sharded one: a torch.distributed.checkpoint directory of a sharded strategy (`ModelParallelStrategy`,
docs/sharding.md) or a ZeRO-1 directory (`state_dict_type="sharded"`, docs/memory.md).

CPU only, no process group, no device. The output is Lightning's one-file checkpoint with the full optimizer state,
CPU tensors only, written atomically: what `Trainer(accelerator="cpu" or "gpu").fit(..., ckpt_path=<output file>)`
and `torch.load(..., weights_only=True)` load. A distributed checkpoint's metadata is parsed once and its tensors are
read in batches of up to 512 MiB, each straight into a memory-mapped scratch file beside the output (host memory: one
chunk at a time; the page cache holds the rest). `--safetensors` writes the model's weights as a Hugging Face
safetensors file instead (host memory: one batch), names without `--strip-prefix`.
"""

from __future__ import annotations

import argparse

from lightning_trn.core.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.distributed_checkpoint import (
    is_distributed_checkpoint,
    write_consolidated,
    write_safetensors,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_trn.consolidate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "checkpoint",
        help="a sharded checkpoint directory (.metadata and *.distcp files, or checkpoint.pt and zero1-rank*.pt)",
    )
    parser.add_argument("output", help="the file to write")
    parser.add_argument(
        "--safetensors",
        action="store_true",
        help="write the model weights as a safetensors file (distributed checkpoints)",
    )
    parser.add_argument(
        "--strip-prefix",
        default="",
        metavar="PREFIX",
        help='with --safetensors: drop this from the weights\' names, e.g. "model."',
    )
    args = parser.parse_args(argv)
    distributed = is_distributed_checkpoint(args.checkpoint)
    if args.safetensors:
        if not distributed:
            parser.error("--safetensors reads torch.distributed.checkpoint directories (.metadata, *.distcp)")
        count = write_safetensors(args.checkpoint, args.output, args.strip_prefix)
        print(f"lightning_trn: wrote {count} tensors to {args.output} from {args.checkpoint}")
        return
    if distributed:
        write_consolidated(args.checkpoint, args.output)
    else:
        io = NeuronCheckpointIO()
        io.save_checkpoint(io.load_checkpoint(args.checkpoint), args.output)
    print(f"lightning_trn: wrote {args.output} from {args.checkpoint}")


if __name__ == "__main__":
    main()
