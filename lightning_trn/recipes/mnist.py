"""Image data for the MLP and ViT recipes: offline MNIST-5k by default, full MNIST / CIFAR-10 with a network."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from lightning_trn.recipes.common import FRACTION, POSITIVE, checked
from lightning_trn.recipes.data import TensorDataModule, shuffled_split
from lightning_trn.recipes.datasets import load_mnist_5k, load_torchvision


@dataclass
class MnistData:
    """`data.*` of the MLP and ViT recipes (schema: types and checks; defaults in their YAML)."""

    source: str
    root: str
    batch_size: int = checked(POSITIVE)
    val_fraction: float = checked(FRACTION)
    test_fraction: float = checked(FRACTION)


def mnist_datamodule(cfg: DictConfig) -> TensorDataModule:
    """`data.source=mnist5k`: shuffle with `seed`, split off val and test fractions. `mnist` / `cifar10`: the
    official test split, validation cut from the official training split."""
    data = cfg.data
    if data.source == "mnist5k":
        train, val, test = shuffled_split(load_mnist_5k(), (data.val_fraction, data.test_fraction), cfg.seed)
    else:
        full_train = load_torchvision(data.source, data.root, train=True)
        train, val = shuffled_split(full_train, (data.val_fraction,), cfg.seed)
        test = load_torchvision(data.source, data.root, train=False)
    return TensorDataModule(train, val, test, batch_size=data.batch_size, seed=cfg.seed)
