"""NeuronCompilerFlags: validation, merging with the user's NEURON_CC_FLAGS, conflicts, restore, late application."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_trn  # noqa: F401  (registers accelerator="neuron")
from lightning_trn.pytorch.callbacks import NeuronCompilerFlags
from lightning_trn.pytorch.callbacks.compiler_flags import cc_flags_digest
from lightning_trn.runtime import get_runtime
from lightning_trn.runtime.environment import parse_cc_flags

pytestmark = pytest.mark.xla_only


@pytest.fixture(autouse=True)
def no_user_flags(monkeypatch):
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optlevel": 4}, "optlevel=4"),
        ({"optlevel": "fast"}, "use 1, 2 or 3"),
        ({"model_type": "cnn"}, "generic, transformer, unet-inference"),
        ({"auto_cast": "some"}, "none, matmult, all"),
        ({"auto_cast_type": "int8"}, "bf16, fp16, tf32, fp8_e4m3"),
    ],
)
def test_invalid_values_are_rejected_with_the_allowed_ones(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NeuronCompilerFlags(**kwargs)


@pytest.mark.parametrize("spelling", [1, "1", "O1", "-O1", "o1"])
def test_optlevel_spellings(spelling):
    assert NeuronCompilerFlags(optlevel=spelling).flags == "--optlevel=1"


def test_merge_keeps_user_flags_and_adds_no_duplicates(monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "-O1 --retry_failed_compilation")
    callback = NeuronCompilerFlags(
        optlevel="O1", model_type="transformer", auto_cast="matmult", extra_flags=["--retry_failed_compilation"]
    )
    merged = callback.apply()
    assert os.environ["NEURON_CC_FLAGS"] == merged
    assert merged.startswith("-O1 --retry_failed_compilation")  # the user's text is kept as written
    names = [name for name, _ in parse_cc_flags(merged)]
    assert sorted(names) == ["--auto-cast", "--model-type", "--optlevel", "--retry_failed_compilation"]
    assert dict(parse_cc_flags(merged))["--model-type"] == "transformer"


def test_conflict_with_user_flags_names_both_values(monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--optlevel 2")
    with pytest.raises(ValueError, match=r"`--optlevel`.*'2' in NEURON_CC_FLAGS.*'3' from NeuronCompilerFlags"):
        NeuronCompilerFlags(optlevel=3).apply()
    assert os.environ["NEURON_CC_FLAGS"] == "--optlevel 2"


def test_conflict_inside_the_callback_arguments():
    with pytest.raises(ValueError, match=r"`--model-type`.*'generic'.*'transformer' from extra_flags"):
        NeuronCompilerFlags(model_type="generic", extra_flags="--model_type=transformer")


def test_digest_ignores_spelling_and_order():
    assert cc_flags_digest("-O1 --model-type transformer") == cc_flags_digest("--model_type=transformer --optlevel=1")
    assert cc_flags_digest("-O1") != cc_flags_digest("-O2")


class FlagsSeenModel(BoringModel):
    """Records NEURON_CC_FLAGS while training, when the compiler would read it."""

    flags_seen: set

    def training_step(self, batch, batch_idx):
        self.flags_seen = getattr(self, "flags_seen", set()) | {os.environ.get("NEURON_CC_FLAGS")}
        return super().training_step(batch, batch_idx)


def _fit(callback: NeuronCompilerFlags) -> FlagsSeenModel:
    model = FlagsSeenModel()
    trainer = Trainer(
        accelerator="neuron",
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(model)
    return model


def test_flags_are_in_force_during_fit_and_restored_on_teardown(monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--retry_failed_compilation")
    model = _fit(NeuronCompilerFlags(optlevel=1, model_type="transformer"))
    assert model.flags_seen == {"--retry_failed_compilation --optlevel=1 --model-type=transformer"}
    assert os.environ["NEURON_CC_FLAGS"] == "--retry_failed_compilation"


def test_unset_variable_is_removed_again_on_teardown():
    _fit(NeuronCompilerFlags(optlevel=3))
    assert "NEURON_CC_FLAGS" not in os.environ


def test_applying_after_compilation_says_so():
    runtime = get_runtime()
    value = (torch.ones(2, device=runtime.device()) * 3).sum()
    runtime.sync()
    assert value.item() == 6.0 and runtime.metrics().compiles > 0
    callback = NeuronCompilerFlags(optlevel=1)
    with pytest.warns(UserWarning, match=r"already compiled \d+ graph\(s\).*can only affect graphs compiled from now"):
        callback.apply()
    callback.restore()
