"""What the memory tools save and cost, on the backend this runs on: ZeRO-1 against plain data parallel (2
processes), activation checkpointing against none (1 process), natively FSDP2 (`strategy="fsdp"`, each block a
unit) against plain data parallel (2 processes), and bf16-true's stochastic rounding against round-to-nearest (1
process; in software everywhere but the XLA stack's NeuronCores, TorchNeuron included).

    python -m benchmarks.memory [--width 1024] [--depth 4] [--batch 128] [--steps 20] [--warmup 3]
                                [--pairs zero1,zero1-bf16,checkpointing,fsdp,rounding]

A stack of `depth` blocks (two Linear(width, width), each followed by GELU) trained with AdamW through
`Trainer(accelerator="neuron")`. Printed per pair, each with its ratio against the baseline run beside it: the
optimizer's memory on rank 0 (its state, plus the fp32 masters of bf16 parameters: ZeRO-1's chunks, or the
precision plugin's with `master_weights=True`); the
device allocator's peak over the run and the activation peak of a step's forward and backward (that peak less the
memory held before the step and the gradients; natively, TorchNeuron's or the stand-in's `torch.neuron` allocator;
XLA reports none, and XLA:CPU's would say nothing of a NeuronCore's); steady-state steps/s. Every run starts in a
fresh process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._harness import format_table, wait_for_device
from lightning_trn import NeuronPrecision
from lightning_trn.core.parallel.zero1 import local_bytes, optimizer_state_bytes
from lightning_trn.pytorch.strategies import NeuronFSDPStrategy
from lightning_trn.runtime import get_runtime


class Blocks(pl.LightningModule):
    def __init__(self, width: int, depth: int, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width), torch.nn.GELU()
            )
            for _ in range(depth)
        )
        self.checkpointed = checkpointed

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x.square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _allocator() -> Any | None:
    """The device module's allocator statistics (TorchNeuron's `torch.neuron`, or the stand-in's), if it has them."""
    try:
        module = torch.get_device_module(get_runtime().device_type)
    except (AttributeError, RuntimeError):
        return None
    return module if hasattr(module, "reset_peak_memory_stats") else None


def _bytes(tensors: Any) -> int:
    """What the tensors take on this rank (a DTensor: its shard)."""
    return sum(local_bytes(t) for t in tensors)


def _gradient_bytes(trainer: pl.Trainer) -> int:
    """Gradients of the module's parameters and of the optimizer's own (ZeRO-1's chunks)."""
    params = {id(p): p for p in trainer.lightning_module.parameters()}
    params.update({id(p): p for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]})
    return _bytes(p.grad for p in params.values() if p.grad is not None)


def _optimizer_bytes(trainer: pl.Trainer) -> int:
    """The optimizer's state, its parameters that are not the module's (ZeRO-1's fp32 chunks), and the precision
    plugin's fp32 master weights."""
    optimizer = trainer.optimizers[0]
    module_params = {id(p) for p in trainer.lightning_module.parameters()}
    chunks = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in module_params]
    masters = trainer.precision_plugin.state_dict().get("master_weights", {}).values()
    return optimizer_state_bytes(optimizer) + _bytes(chunks) + _bytes(masters)


class _ActivationPeak(pl.Callback):
    """The largest activation peak of the timed steps' forward and backward (allocator peak between the step's start
    and the end of its backward, less what was allocated at its start and the gradients backward created)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.allocator = _allocator()
        self.before = 0
        self.peak: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.allocator is not None and idx >= self.warmup:
            self.allocator.reset_peak_memory_stats()
            # the last step's gradients are freed by `zero_grad` before the forward
            self.before = self.allocator.memory_allocated() - _gradient_bytes(trainer)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.allocator is None or trainer.global_step < self.warmup:
            return
        peak = self.allocator.max_memory_allocated() - self.before - _gradient_bytes(trainer)
        self.peak = peak if self.peak is None else max(self.peak, peak)


class _Clock(pl.Callback):
    """Steady-state time: from the start of step `warmup` (device idle) to the end of the last (device idle)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if args[-1] == self.warmup:
            wait_for_device()
            self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        wait_for_device()
        self.end = time.perf_counter()


def worker(args: argparse.Namespace) -> None:
    """One run; rank 0 writes its figures to `args.out` as JSON."""
    pl.seed_everything(0)
    data = TensorDataset(torch.randn(args.batch * args.devices * (args.steps + args.warmup), args.width))
    clock, activations = _Clock(args.warmup), _ActivationPeak(args.warmup)
    precision = NeuronPrecision(
        args.precision, master_weights=args.master_weights, stochastic_rounding=not args.round_to_nearest
    )
    strategy = NeuronFSDPStrategy(auto_wrap_policy={torch.nn.Sequential}) if args.strategy == "fsdp" else args.strategy
    trainer = pl.Trainer(
        accelerator="neuron",
        devices=args.devices,
        strategy=strategy,
        plugins=[precision],
        max_steps=args.steps + args.warmup,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock, activations],
    )
    model = Blocks(args.width, args.depth, args.checkpointed)
    runtime = get_runtime()
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    if trainer.is_global_zero:
        peak = runtime.memory_stats(runtime.device()).get("allocated_bytes.all.peak")
        figures = {
            "state_bytes": _optimizer_bytes(trainer),
            "peak_bytes": peak,
            "activation_bytes": activations.peak,
            "steps_per_s": args.steps / (clock.end - clock.start),
        }
        Path(args.out).write_text(json.dumps(figures))


def _run(args: argparse.Namespace, out: Path, *extra: str) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "benchmarks.memory",
        "--worker",
        "--out",
        str(out),
        "--width",
        str(args.width),
        "--depth",
        str(args.depth),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        *extra,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _ratio(value: float | None, baseline: float | None) -> str:
    return "n/a" if not value or not baseline else f"{value / baseline:.2f}"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def _activation_cells(tool: dict[str, Any], baseline: dict[str, Any], checkpointing: bool) -> list[str]:
    """The activation peak is what checkpointing changes; ZeRO-1 does not touch activations (not shown)."""
    if not checkpointing:
        return ["-", "-"]
    return [
        f"{_mib(tool['activation_bytes'])} / {_mib(baseline['activation_bytes'])}",
        _ratio(tool["activation_bytes"], baseline["activation_bytes"]),
    ]


_DDP, _ZERO1 = ("--devices", "2", "--strategy", "neuron_ddp"), ("--devices", "2", "--strategy", "neuron_zero1")
_BF16 = ("--precision", "bf16-true")
#: name -> (row label, baseline run's arguments, tool run's arguments)
PAIRS = {
    "zero1": ("ZeRO-1 vs DDP, fp32, 2 processes", _DDP, _ZERO1),
    "zero1-bf16": (
        "ZeRO-1 vs DDP, bf16-true with fp32 masters, 2 processes",
        (*_DDP, *_BF16, "--master-weights"),
        (*_ZERO1, *_BF16),
    ),
    "checkpointing": ("activation checkpointing vs none, 1 process", (), ("--checkpointed",)),
    "fsdp": ("FSDP2 vs DDP, fp32, 2 processes (native)", _DDP, ("--devices", "2", "--strategy", "fsdp")),
    # off the XLA stack's NeuronCores (TorchNeuron included) bf16-true rounds in software: what that costs
    "rounding": ("bf16-true stochastic rounding vs round-to-nearest, 1 process", (*_BF16, "--round-to-nearest"), _BF16),
}
#: pairs that need a backend that shards models (`DeviceRuntime.shards_models`)
_SHARDED_PAIRS = ("fsdp",)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128, help="samples per process and step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--pairs", default=None, help=f"comma-separated, of: {', '.join(PAIRS)} (default: those the backend runs)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="32-true", help=argparse.SUPPRESS)
    parser.add_argument("--master-weights", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--round-to-nearest", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    pairs = (
        args.pairs.split(",")
        if args.pairs
        else [name for name in PAIRS if get_runtime().shards_models or name not in _SHARDED_PAIRS]
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, baseline_args, tool_args) in enumerate(PAIRS[key] for key in pairs):
            baseline = _run(args, Path(tmp) / f"{index}-baseline.json", *baseline_args)
            tool = _run(args, Path(tmp) / f"{index}-tool.json", *tool_args)
            rows.append(
                [
                    name,
                    f"{tool['state_bytes'] / 2**20:.2f} / {baseline['state_bytes'] / 2**20:.2f}",
                    _ratio(tool["state_bytes"], baseline["state_bytes"]),
                    f"{_mib(tool['peak_bytes'])} / {_mib(baseline['peak_bytes'])}",
                    _ratio(tool["peak_bytes"], baseline["peak_bytes"]),
                    *_activation_cells(tool, baseline, "checkpointing" in name),
                    f"{tool['steps_per_s']:.1f} / {baseline['steps_per_s']:.1f}",
                    _ratio(tool["steps_per_s"], baseline["steps_per_s"]),
                ]
            )
    print(f"backend: {get_runtime().name}; {args.depth} blocks of width {args.width}, batch {args.batch} per process")
    print(
        format_table(
            [
                "pair (tool vs baseline)",
                "optimizer MiB, rank 0",
                "optimizer ratio",
                "device peak MiB",
                "peak ratio",
                "activation peak MiB",
                "activation ratio",
                "steps/s",
                "steps/s ratio",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
