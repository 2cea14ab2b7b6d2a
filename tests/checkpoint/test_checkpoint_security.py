"""Checkpoints load with `weights_only=True` by default: a pickle that would run code is refused, not executed."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from models import RegressionModel

import lightning_trn  # noqa: F401  (registers accelerator="neuron")
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO

pytestmark = pytest.mark.xla_only


class CreatesMarkerWhenUnpickled:
    """Unpickling calls `open(marker, "w")`: a stand-in for arbitrary code in a tampered checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (str(self.marker), "w"))


@pytest.fixture
def evil_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A Lightning-shaped checkpoint carrying the payload; returns (checkpoint path, marker path)."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    state = {
        "state_dict": RegressionModel().state_dict(),
        "global_step": 0,
        "epoch": 0,
        "pytorch-lightning_version": "2.6.0",
        "payload": CreatesMarkerWhenUnpickled(marker),
    }
    torch.save(state, path)
    assert not marker.exists()
    return path, marker


def test_checkpoint_io_refuses_a_malicious_pickle(evil_checkpoint: tuple[Path, Path]):
    path, marker = evil_checkpoint
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        NeuronCheckpointIO().load_checkpoint(path)
    assert not marker.exists()


def test_fit_refuses_a_malicious_resume_checkpoint(evil_checkpoint: tuple[Path, Path], tmp_path: Path):
    path, marker = evil_checkpoint
    trainer = Trainer(
        accelerator="neuron",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        trainer.fit(RegressionModel(), ckpt_path=path)
    assert not marker.exists()


def test_payload_is_live_when_the_user_opts_out(evil_checkpoint: tuple[Path, Path]):
    """The two tests above prove something only if the payload really runs on a full unpickle; an explicit
    `weights_only=False` (for checkpoints the user trusts) is still honoured."""
    path, marker = evil_checkpoint
    NeuronCheckpointIO().load_checkpoint(path, weights_only=False)
    assert marker.exists()


def test_lightning_checkpoint_round_trips_with_weights_only(tmp_path: Path):
    """The safe default must not break normal resumes: a real Trainer checkpoint loads with `weights_only=True`."""
    trainer = Trainer(
        accelerator="neuron",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    model = RegressionModel()
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "ok.ckpt")
    checkpoint = NeuronCheckpointIO().load_checkpoint(tmp_path / "ok.ckpt")
    assert checkpoint["global_step"] == 2
    assert torch.equal(checkpoint["state_dict"]["layer.weight"], model.layer.weight.detach().cpu())
