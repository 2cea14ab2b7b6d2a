"""Worker script for tests/standin/test_estimate.py: the LLM recipe's `CausalLM` (about 21 M parameters) trained for
two steps on 2 (`--devices`) stand-in `neuron` devices under one of the strategies of `strategy`; each rank writes to
--out `peak-<rank>.json` the stand-in allocator's peak (`torch.neuron.max_memory_allocated()`) over each step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.recipes.llm import CausalLM

#: a Llama of about 21 M parameters: 4 layers, grouped-query attention, an 8k vocabulary
MODEL = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "seq_len": 128,
}
BATCH_SIZE = 4
DEVICES = 2


def module_factory(strategy_name: str, activation_checkpointing: bool = False) -> CausalLM:
    """The model as the recipe builds it: on the meta device for the sharded strategies, which materialize it."""
    pl.seed_everything(0, verbose=False)
    return CausalLM(meta_init=strategy_name != "zero1", activation_checkpointing=activation_checkpointing, **MODEL)


def batch(device: str = "cpu") -> dict[str, torch.Tensor]:
    """One micro-batch: token ids and labels, `BATCH_SIZE` blocks of `seq_len`."""
    ids = torch.zeros(BATCH_SIZE, MODEL["seq_len"], dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids}


def strategy(name: str, devices: int = DEVICES) -> Any:
    """The Trainer's `strategy` argument for each configuration the test compares; "tp": tensor parallel over 2,
    data parallel (FSDP2) over the rest."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {
        "fsdp": lambda: FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}),
        "zero1": lambda: "neuron_zero1",
        "tp": lambda: ModelParallelStrategy(data_parallel_size=devices // 2, tensor_parallel_size=2),
    }[name]()


class PeakOfEachStep(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.peaks = out, []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        torch.neuron.synchronize()
        torch.neuron.reset_peak_memory_stats()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        torch.neuron.synchronize()
        self.peaks.append(torch.neuron.max_memory_allocated())
        if batch_idx == 1:
            (self.out / f"peak-{trainer.global_rank}.json").write_text(json.dumps(self.peaks))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=("fsdp", "tp", "zero1"), required=True)
    parser.add_argument("--ac", type=int, choices=(0, 1), default=0, help="activation checkpointing")
    parser.add_argument("--devices", type=int, default=DEVICES)
    args = parser.parse_args()
    trainer = pl.Trainer(
        accelerator="neuron",
        devices=args.devices,
        strategy=strategy(args.strategy, args.devices),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[PeakOfEachStep(args.out)],
    )
    loader = DataLoader([batch(), batch()], batch_size=None)  # each rank: the same two micro-batches
    trainer.fit(module_factory(args.strategy, bool(args.ac)), train_dataloaders=loader)


if __name__ == "__main__":
    main()


def estimated(strategy_name: str, checkpointing: bool, devices: int) -> Any:
    """`lightning_trn.estimate.estimate` of the configuration, in the calling process (the test calls it in a child
    process). The stand-in there shows `DEVICES` devices: more ranks are simulated as nodes of `DEVICES` (the same
    mesh)."""
    from lightning_trn.estimate import estimate

    return estimate(
        lambda: module_factory(strategy_name, checkpointing),
        batch("meta"),
        accelerator="neuron",
        devices=DEVICES,
        num_nodes=devices // DEVICES,
        strategy=strategy(strategy_name, devices),
    )
