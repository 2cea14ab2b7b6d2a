"""Worker script for tests/estimate/test_estimate.py: the LLM recipe's `CausalLM` (about 21 M parameters) trained for
two steps on 2 (`--devices`) stand-in `neuron` devices under one of the strategies of `strategy`; each rank writes to
--out `peak-<rank>.json` the stand-in allocator's peak (`torch.neuron.max_memory_allocated()`) over each step.
`--strategy pp`: a token model of about 6 M parameters split into 2 pipeline stages (`lightning_trn.pipeline_split`,
1F1B over 4 microbatches), the recipe's model being no stack of layers `pipeline_split` can divide.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lightning_trn  # registers accelerator="neuron"
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
#: the pipeline job's stages and microbatches per batch (of `BATCH_SIZE` sequences)
STAGES, MICROBATCHES = 2, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class StagedNet(nn.Module):
    """TorchTitan's convention (docs/sharding.md): the forward runs the parts this stage holds."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embedding(x) if self.embedding is not None else x
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x) if self.norm is not None else x
        return self.head(x) if self.head is not None else x


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Staged(pl.LightningModule):
    """The pipeline job's module: split in `configure_model`, one schedule run per `training_step`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = StagedNet(MODEL["vocab_size"], MODEL["hidden_size"] // 2, MODEL["num_layers"])

    def configure_model(self) -> None:
        self.pipeline = lightning_trn.pipeline_split(self.net, next_token_loss, self.trainer.strategy)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.pipeline.step(batch["input_ids"], target=batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def module_factory(strategy_name: str, activation_checkpointing: bool = False) -> pl.LightningModule:
    """The model as the recipe builds it: on the meta device for the sharded strategies, which materialize it;
    "pp": the pipeline job's token model."""
    pl.seed_everything(0, verbose=False)
    if strategy_name == "pp":
        return Staged()
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

    from lightning_trn import NeuronModelParallelStrategy

    return {
        "fsdp": lambda: FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}),
        "zero1": lambda: "neuron_zero1",
        "tp": lambda: ModelParallelStrategy(data_parallel_size=devices // 2, tensor_parallel_size=2),
        "pp": lambda: NeuronModelParallelStrategy(
            pipeline_parallel_size=STAGES, data_parallel_size=devices // STAGES, pipeline_microbatches=MICROBATCHES
        ),
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
    parser.add_argument("--strategy", choices=("fsdp", "tp", "zero1", "pp"), required=True)
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
