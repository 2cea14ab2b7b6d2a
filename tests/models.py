"""Small learnable models for the tests (importable from subprocesses that put `tests/` on sys.path)."""

from __future__ import annotations

import random

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

TRUE_WEIGHTS = torch.arange(1.0, 9.0).unsqueeze(1)


def regression_loader(n: int = 512, batch_size: int = 16, shuffle: bool = True, seed: int = 0) -> DataLoader:
    """y = X @ [1..8]: a task a linear layer learns exactly, so the loss must fall towards zero."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    return DataLoader(TensorDataset(x, x @ TRUE_WEIGHTS), batch_size=batch_size, shuffle=shuffle, generator=generator)


class AugmentedDataset(Dataset):
    """Fixed regression samples, each returned with noise drawn from torch's, numpy's and Python's global generators,
    as random data augmentation draws it: what a sample looks like depends on the host generators' state."""

    def __init__(self, n: int = 256, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.1 * torch.randn(8) + float(np.random.uniform(-0.05, 0.05)) + random.uniform(-0.05, 0.05)
        return self.x[index] + noise, self.y[index]


class RegressionModel(LightningModule):
    """Linear regression with SGD; records where its parameters and batches live."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(8, 1)
        self.batch_devices: set[str] = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batch_devices.add(x.device.type)
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return regression_loader()
