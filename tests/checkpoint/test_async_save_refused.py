"""`NeuronCheckpointIO(async_save=True)` writes only torch.distributed.checkpoint directories (the sharded strategies of
the native backend: tests/checkpoint/test_async_save.py). A strategy that writes ZeRO-1 directories (the sharded format
on XLA) or one file refuses it when `fit` sets it up, before the first step, rather than saving synchronously behind
the user's back."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_trn import NeuronDDPStrategy
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from tests.models import RegressionModel, regression_loader

pytestmark = pytest.mark.both


@pytest.mark.parametrize(
    ("strategy", "writes"),
    [
        (NeuronDDPStrategy(zero1=True, state_dict_type="sharded"), "ZeRO-1 directories"),
        ("auto", "one file"),
    ],
    ids=["zero1-sharded", "single-device"],
)
def test_async_save_is_refused_where_checkpoints_are_not_dcp_directories(strategy: object, writes: str) -> None:
    trainer = pl.Trainer(
        accelerator="neuron",
        devices=1,
        strategy=strategy,
        plugins=[NeuronCheckpointIO(async_save=True)],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(ValueError, match=f"async_save=True.*writes {writes}"):
        trainer.fit(RegressionModel(), regression_loader(n=16))
