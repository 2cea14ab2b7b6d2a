"""`TensorDataModule`: fixed-size batches from in-memory tensors, the last partial batch padded and masked.

Every batch has exactly `batch_size` rows, so the compiled step graph is reused for all of them (XLA compiles per
shape). Padding rows repeat row 0 with `weight` 0; losses and metrics multiply by `weight`, so nothing is dropped
and nothing is counted twice; evaluation splits are padded to whole batches on every data-parallel rank.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

Tensors = dict[str, torch.Tensor]


def shuffled_split(tensors: Tensors, fractions: tuple[float, ...], seed: int) -> list[Tensors]:
    """Shuffle the rows with a fixed seed (the offline sets are sorted by class), then cut off `fractions` in order;
    the rest comes first in the result: `shuffled_split(t, (0.1, 0.2), 0)` -> [70% train, 10% val, 20% test]."""
    rows = len(next(iter(tensors.values())))
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    sizes = [int(round(rows * f)) for f in fractions]
    sizes.insert(0, rows - sum(sizes))
    return [{k: v[idx] for k, v in tensors.items()} for idx in torch.split(order, sizes)]


def evaluation_multiple(datamodule: pl.LightningDataModule, batch_size: int) -> int:
    """The row count evaluation splits are padded to a multiple of: `batch_size` on every data-parallel rank.

    Lightning shares evaluation loaders out with `DistributedSampler`, which repeats samples to even out the ranks
    (and warns that it may); a split of whole batches per rank is shared out with no repeat, so each sample counts
    once in the metrics and every batch keeps its shape."""
    trainer = datamodule.trainer
    sampler_kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
    return batch_size * (sampler_kwargs or {}).get("num_replicas", 1)


def pad_to_multiple(tensors: Tensors, multiple: int) -> Tensors:
    """Append copies of row 0 until the row count is a multiple of `multiple`; add `weight` (1 real, 0 padding)."""
    rows = len(next(iter(tensors.values())))
    pad = -rows % multiple
    padded = {k: torch.cat([v, v[:1].expand(pad, *v.shape[1:])]) for k, v in tensors.items()}
    padded["weight"] = torch.cat([torch.ones(rows), torch.zeros(pad)])
    return padded


class _RowDataset(Dataset):
    def __init__(self, tensors: Tensors) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors["weight"])

    def __getitem__(self, index: int) -> Tensors:
        return {k: v[index] for k, v in self.tensors.items()}


class TensorDataModule(pl.LightningDataModule):
    """Train/val/test splits held as tensors; batches are dicts with the split's keys plus `weight`."""

    def __init__(self, train: Tensors, val: Tensors, test: Tensors | None, batch_size: int, seed: int) -> None:
        super().__init__()
        self.splits = {"train": train, "val": val, "test": test}
        self.batch_size = batch_size
        self.seed = seed

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        tensors = self.splits[split]
        if tensors is None:
            raise ValueError(f"This data module has no {split!r} split.")
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        multiple = self.batch_size if shuffle else evaluation_multiple(self, self.batch_size)
        return DataLoader(
            _RowDataset(pad_to_multiple(tensors, multiple)),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
