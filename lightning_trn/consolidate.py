"""`python -m lightning_trn.consolidate <sharded checkpoint directory> <output file>`: one portable checkpoint file
from a sharded one: a torch.distributed.checkpoint directory of a sharded strategy (`ModelParallelStrategy`,
docs/sharding.md) or a ZeRO-1 directory (`state_dict_type="sharded"`, docs/memory.md).

CPU only, no process group, no device. The output is Lightning's one-file checkpoint with the full optimizer state,
CPU tensors only, written atomically: what `Trainer(accelerator="cpu" or "gpu").fit(..., ckpt_path=<output file>)`
and `torch.load(..., weights_only=True)` load. A distributed checkpoint's metadata is parsed once and its tensors are
read in batches of up to 512 MiB, each straight into a memory-mapped scratch file beside the output (host memory: one
chunk at a time; the page cache holds the rest). `--safetensors` writes the model's weights as a Hugging Face
safetensors file instead (host memory: one batch; a one-file checkpoint is read whole), names without
`--strip-prefix`, and `--copy-from FOLDER` copies the pretrained folder's config and tokenizer files beside it: a
Hugging Face folder from a LightningModule of your own (docs/getting-started.md).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.checkpoint.distributed_checkpoint import (
    DistributedCheckpointReader,
    is_distributed_checkpoint,
    model_tensors,
    write_consolidated,
    write_safetensors,
)
from lightning_trn.core.parallel.zero1 import SHARDED_MAIN_FILE

_NOT_SHARDED = (
    "{!r} is not a sharded checkpoint directory: it has neither .metadata (a torch.distributed.checkpoint directory) "
    f"nor {SHARDED_MAIN_FILE} (a ZeRO-1 directory)."
)


def consolidate(checkpoint: Any, output: Any) -> None:
    """Write the sharded checkpoint directory `checkpoint` (distributed or ZeRO-1) as one portable file `output`.

    Raises:
        ValueError: `checkpoint` is not a sharded checkpoint directory.
    """
    if is_distributed_checkpoint(checkpoint):
        write_consolidated(checkpoint, output)
        return
    if not os.path.isfile(os.path.join(checkpoint, SHARDED_MAIN_FILE)):
        raise ValueError(_NOT_SHARDED.format(os.fspath(checkpoint)))
    io = NeuronCheckpointIO()
    io.save_checkpoint(io.load_checkpoint(checkpoint), output)


def model_checkpoint(checkpoint: Any) -> dict[str, Any]:
    """What loading the model of the sharded checkpoint directory `checkpoint` needs: the model's weights
    (`state_dict`, whole CPU tensors) and Lightning's other entries (hyperparameters, the module's own), without the
    optimizer state, which a consolidated file would hold as well (twice the weights' size under Adam).

    Raises:
        ValueError: `checkpoint` is not a sharded checkpoint directory.
    """
    if is_distributed_checkpoint(checkpoint):
        reader = DistributedCheckpointReader(checkpoint)
        names = dict(model_tensors(reader))
        weights = {names[key]: tensor for key, tensor in reader.read_tensors(names)}
        return {**reader.lightning_meta(), "state_dict": weights}
    main = os.path.join(checkpoint, SHARDED_MAIN_FILE)
    if not os.path.isfile(main):
        raise ValueError(_NOT_SHARDED.format(os.fspath(checkpoint)))
    saved = torch.load(main, map_location="cpu", weights_only=True, mmap=True)
    return {key: value for key, value in saved.items() if key != "optimizer_states"}


#: the files of a Hugging Face folder that hold weights: `--copy-from` copies every other one
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.ckpt")


def write_model_safetensors(checkpoint: Any, output: Any, prefix: str = "") -> int:
    """Write the model weights of `checkpoint` (a one-file checkpoint, or a sharded directory) as a safetensors file,
    names without `prefix`; returns how many tensors. A distributed checkpoint is read batch by batch
    (`write_safetensors`); a file or a ZeRO-1 directory is loaded whole. A tensor tied to one already written (the LM
    head of a model with `tie_word_embeddings`) is left out, as `save_pretrained` does: transformers ties it again."""
    if is_distributed_checkpoint(checkpoint):
        return write_safetensors(checkpoint, output, prefix)
    from safetensors.torch import save_file

    state = NeuronCheckpointIO().load_checkpoint(checkpoint)["state_dict"]
    weights: dict[str, Any] = {}
    written: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if storage in written:
            continue
        written.add(storage)
        weights[name[len(prefix) :] if prefix and name.startswith(prefix) else name] = tensor.contiguous()
    tmp = f"{os.fspath(output)}.tmp"
    save_file(weights, tmp, metadata={"format": "pt"})
    os.replace(tmp, output)
    return len(weights)


def copy_folder_files(folder: Any, destination: Any) -> list[str]:
    """Copy the files of the Hugging Face folder `folder` that hold no weights (config.json, generation_config.json,
    the tokenizer's) into `destination`; returns their names."""
    source = Path(folder)
    if not source.is_dir():
        raise ValueError(f"--copy-from {os.fspath(folder)!r}: the folder does not exist.")
    copied = []
    for file in sorted(source.iterdir()):
        if file.is_file() and not any(fnmatch.fnmatch(file.name, pattern) for pattern in _WEIGHT_FILES):
            shutil.copy2(file, Path(destination) / file.name)
            copied.append(file.name)
    return copied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_trn.consolidate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "checkpoint",
        help="a sharded checkpoint directory (.metadata and *.distcp files, or checkpoint.pt and zero1-rank*.pt); "
        "with --safetensors also a one-file checkpoint",
    )
    parser.add_argument("output", help="the file to write")
    parser.add_argument(
        "--safetensors",
        action="store_true",
        help="write the model weights as a safetensors file (e.g. OUT_DIR/model.safetensors)",
    )
    parser.add_argument(
        "--strip-prefix",
        default="",
        metavar="PREFIX",
        help='with --safetensors: drop this from the weights\' names, e.g. "model."',
    )
    parser.add_argument(
        "--copy-from",
        metavar="FOLDER",
        help="with --safetensors: copy the Hugging Face folder's other files (config.json, generation_config.json, "
        "the tokenizer's) beside the output, which makes its folder one that from_pretrained loads",
    )
    args = parser.parse_args(argv)
    if args.copy_from and not args.safetensors:
        parser.error("--copy-from goes with --safetensors")
    try:
        if args.safetensors:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            count = write_model_safetensors(args.checkpoint, args.output, args.strip_prefix)
            print(f"lightning_trn: wrote {count} tensors to {args.output} from {args.checkpoint}")
            if args.copy_from:
                copied = copy_folder_files(args.copy_from, Path(args.output).parent)
                print(f"lightning_trn: copied {', '.join(copied)} from {args.copy_from}")
            return
        consolidate(args.checkpoint, args.output)
    except ValueError as err:
        parser.error(str(err))
    print(f"lightning_trn: wrote {args.output} from {args.checkpoint}")


if __name__ == "__main__":
    main()
