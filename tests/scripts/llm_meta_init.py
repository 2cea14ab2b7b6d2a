"""Worker script for tests/recipes/test_recipe_llm_meta_init.py: the LLM recipe's `CausalLM` (a small config) trained
for a few steps under Lightning's `ModelParallelStrategy` on 2 stand-in `neuron` devices, built either eagerly
(`--meta 0`) or on the meta device (`--meta 1`, what `build_model` does for sharded strategies), then materialized by
the strategy. Rank 0 writes to --out `init.pt` (the full parameters and every buffer, non-persistent ones included,
as training starts), `final.pt` (the same after training) and `losses.json` (every step's loss).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.recipes.llm import CausalLM
from lightning_trn.recipes.llm.data import _BlockDataset

SEED = 1234
#: a small Llama: grouped-query attention (4 heads over 2 key/value heads), a padding row, rotary buffers
MODEL = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "seq_len": 16,
    "lr": 1e-2,
    "warmup_steps": 1,
}
STEPS = 3


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (DTensors gathered: a collective, all ranks call it) and buffer, as CPU tensors."""
    named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {
        name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone() for name, t in named.items()
    }


class Record(pl.Callback):
    """The weights as training starts and ends, and the losses; written by rank 0."""

    def __init__(self, out: Path) -> None:
        self.out, self.losses = out, []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, full_state(pl_module.net), "init.pt")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, full_state(pl_module.net), "final.pt")
        if trainer.is_global_zero:
            (self.out / "losses.json").write_text(json.dumps(self.losses))

    def _save(self, trainer: pl.Trainer, state: dict[str, torch.Tensor], name: str) -> None:
        if trainer.is_global_zero:
            torch.save(state, self.out / name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--meta", type=int, choices=(0, 1), required=True)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the rest is FSDP2)")
    args = parser.parse_args()
    pl.seed_everything(SEED)
    tokens = torch.randint(0, MODEL["vocab_size"], (32, MODEL["seq_len"]), generator=torch.Generator().manual_seed(0))
    model = CausalLM(meta_init=bool(args.meta), **MODEL)
    torch.rand(7)  # draws between building and materializing must not change the weights
    trainer = pl.Trainer(
        accelerator="neuron",
        devices=2,
        strategy=ModelParallelStrategy(2 // args.tp, args.tp),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record(args.out)],
    )
    trainer.fit(
        model, train_dataloaders=DataLoader(_BlockDataset({"input_ids": tokens, "labels": tokens}), batch_size=4)
    )


if __name__ == "__main__":
    main()
