"""MLP recipe: AWS's Trainium tutorial network (784-120-84-10) on MNIST. `python -m recipes.mlp --help`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from safetensors.torch import save_file
from torch import nn
from typing_extensions import override

from lightning_trn.recipes.classifier import Batch, ClassifierModule
from lightning_trn.recipes.cli import main
from lightning_trn.recipes.common import POSITIVE, UNIT_INTERVAL, Recipe, RecipeConfig, doc
from lightning_trn.recipes.mnist import MnistData, mnist_datamodule


class MnistMLP(ClassifierModule):
    """Fully connected ReLU network on flattened 28x28 images, trained with SGD."""

    def __init__(self, hidden: list[int], lr: float, momentum: float = 0.0, in_features: int = 784, classes: int = 10):
        super().__init__()
        self.save_hyperparameters()
        widths = [in_features, *hidden]
        layers: list[nn.Module] = []
        for fan_in, fan_out in itertools.pairwise(widths):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(widths[-1], classes))

    @override
    def logits(self, batch: Batch) -> torch.Tensor:
        return self.net(batch["x"].flatten(1))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"])


@dataclass
class MlpModel:
    """`model.*` of `configs/mlp.yaml`."""

    hidden: list[int] = doc(
        "widths of the hidden layers (each followed by a ReLU), between the 784 pixels and the 10 classes"
    )
    lr: float = doc("SGD learning rate", POSITIVE)
    momentum: float = doc("SGD momentum", UNIT_INTERVAL)


@dataclass
class MlpConfig(RecipeConfig):
    """Schema of `configs/mlp.yaml`."""

    data: MnistData = doc("the images: source, splits and batches")
    model: MlpModel = doc("the network and its optimizer")


def build_model(cfg: DictConfig) -> MnistMLP:
    return MnistMLP(hidden=list(cfg.model.hidden), lr=cfg.model.lr, momentum=cfg.model.momentum)


def export(module: MnistMLP, out_dir: Path) -> None:
    """`model.safetensors`: the `nn.Sequential` weights, loadable into the same `nn.Sequential` anywhere."""
    save_file({k: v.contiguous() for k, v in module.net.state_dict().items()}, str(out_dir / "model.safetensors"))


RECIPE = Recipe("mlp", MnistMLP, mnist_datamodule, build_model, export, MlpConfig)

if __name__ == "__main__":
    main(RECIPE)
