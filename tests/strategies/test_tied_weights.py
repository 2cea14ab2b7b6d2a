"""Tied weights (an output head sharing the embedding's matrix, as GPT-2 and BERT's MLM head do) stay one Parameter
through fit, validate, test and predict and after the model returns to the CPU, and train as Lightning's CPU run
trains them. Run by both suites."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_trn  # noqa: F401  registers accelerator="neuron"

pytestmark = pytest.mark.both

VOCAB, WIDTH = 12, 6


class TiedLM(LightningModule):
    """Predicts the next token with a head that is the transposed embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def _loss(self, batch: tuple) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self.head(torch.tanh(self.mix(self.embed(tokens)))), targets)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (48,), generator=g)
    return DataLoader(TensorDataset(tokens, (tokens + 1) % VOCAB), batch_size=8)


def run(accelerator: str) -> tuple[TiedLM, list[float]]:
    """Two fits, then validate, test and predict; the tie is checked after each."""
    seed_everything(3)
    model = TiedLM()
    trainer_args = {
        "accelerator": accelerator,
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    losses = []
    for stage in ("fit", "fit", "validate", "test", "predict"):
        trainer = Trainer(**trainer_args)
        if stage == "fit":
            trainer.fit(model, loader(), loader())
        elif stage == "predict":
            losses.append(float(sum(trainer.predict(model, loader()))))
        else:
            losses.append(
                getattr(trainer, stage)(model, loader())[0][f"{'val' if stage == 'validate' else 'test'}_loss"]
            )
        assert model.head.weight is model.embed.weight, f"untied after {stage}"
        assert model.embed.weight.device.type == "cpu"
    return model, losses


def test_ties_hold_and_train_like_lightning_on_cpu():
    neuron_model, neuron_losses = run("neuron")
    cpu_model, cpu_losses = run("cpu")
    # plain SGD, lr 0.5, 12 steps: a few ulps of a gradient (batch means of products of factors <= 1, ~0.2: ~5e-8)
    # move a weight by lr x that a step, ~3e-7 after 12, under 1e-6; the losses (~2) move less, relatively
    assert neuron_losses == pytest.approx(cpu_losses, rel=1e-5)
    for (name, mine), theirs in zip(neuron_model.state_dict().items(), cpu_model.state_dict().values(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)
