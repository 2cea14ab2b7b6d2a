"""`python -m lightning_trn.precompile`: a short run that fills the cache; graphs-only mode saves nothing."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_trn import precompile
from lightning_trn.pytorch.callbacks.compile_cache.archive import list_entries
from lightning_trn.runtime import get_runtime
from lightning_trn.runtime.discovery import NEURON, Platform

pytestmark = pytest.mark.xla_only

PROJECT_ROOT = Path(__file__).resolve().parents[2]

#: a "real" training script: 5 epochs of 8 batches, checkpoints and a CSV logger, a compile cache
SCRIPT = r"""
import json, os, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
import lightning_trn
from lightning_trn.pytorch.callbacks import NeuronCompileCache

class Model(BoringModel):
    val_batches = 0
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=8)
    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=8)
    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)
    def validation_step(self, batch, batch_idx):
        self.val_batches += 1
        self.log("val_loss", self.loss(self(batch[0])))

out = sys.argv[1]
model = Model()
trainer = Trainer(accelerator="neuron", max_epochs=5, num_sanity_val_steps=0, enable_progress_bar=False,
                  logger=CSVLogger(os.path.join(out, "logs")),
                  callbacks=[NeuronCompileCache(os.path.join(out, "cache")),
                             ModelCheckpoint(dirpath=os.path.join(out, "ckpt"))])
trainer.fit(model)
print("RESULT " + json.dumps({"global_step": trainer.global_step, "val_batches": model.val_batches,
                              "loggers": len(trainer.loggers)}))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "NEURON_"))}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=str(PROJECT_ROOT))
    return env


def _result(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_parse_separates_options_from_the_training_command():
    command = ["-m", "pkg.train", "--steps", "9"]
    assert precompile._parse(["--steps", "2", *command]) == (2, command)
    assert precompile._parse(["train.py", "--lr", "1"]) == (3, ["train.py", "--lr", "1"])
    with pytest.raises(SystemExit):
        precompile._parse(["--steps", "0", "train.py"])
    with pytest.raises(SystemExit):
        precompile._parse(["-m"])


def test_precompile_runs_a_few_steps_and_fills_the_cache(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_trn.precompile", "--steps", "2", str(script), str(tmp_path)],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _result(proc.stdout)
    assert result == {"global_step": 2, "val_batches": 2, "loggers": 1}  # one epoch of 2 + 2 batches, not 5 x 8
    assert list_entries(str(tmp_path / "cache"))  # the graphs are in the cache for the real run
    assert list((tmp_path / "ckpt").glob("*.ckpt"))  # real values on XLA:CPU: checkpoints and metrics are kept
    assert list((tmp_path / "logs").rglob("*.csv"))


@pytest.mark.slow
def test_on_neuron_it_runs_under_neuron_parallel_compile_and_graphs_only_saves_nothing(tmp_path, monkeypatch):
    """The platform check is faked (no Trainium here); the wrapper is a stand-in that, like the real one, sets
    NEURON_EXTRACT_GRAPHS_ONLY=1 and runs the command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "neuron_parallel_compile"
    wrapper.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/wrapped\nNEURON_EXTRACT_GRAPHS_ONLY=1 exec "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(get_runtime(), "detect_platform", lambda: Platform(NEURON, 2, "faked"))
    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    code = precompile.main(["--steps", "1", str(script), str(tmp_path)])

    assert code == 0
    assert (tmp_path / "wrapped").read_text().split() == [sys.executable, str(script), str(tmp_path)]
    assert not list((tmp_path / "ckpt").glob("*.ckpt"))  # fake outputs: no checkpoint written
    assert not list((tmp_path / "logs").rglob("*.csv"))  # and no metrics logged (the logger made its folder)


#: a recipe's job (bar, CSV logger, checkpoints, validation, test) with a compile cache; prints the cache counters
RECIPE_SCRIPT = r"""
import importlib, json, sys
from lightning_trn.runtime import get_runtime
from lightning_trn.recipes.cli import load_config
from lightning_trn.recipes.common import fit

out, cache, name, *overrides = sys.argv[1:]
recipe = importlib.import_module(f"lightning_trn.recipes.{name}").RECIPE
get_runtime().enable_compile_cache(cache)
fit(recipe, load_config(recipe, [f"out_dir={out}", *overrides]))
print("RESULT " + json.dumps(get_runtime().compile_cache_counters()))
"""


def _precompile_then_run(tmp_path: Path, recipe: str, overrides: list[str]) -> tuple[dict, dict]:
    """The cache counters of `precompile --steps 3` of a recipe's job, then of the whole job on the same cache."""
    script = tmp_path / "job.py"
    script.write_text(RECIPE_SCRIPT)
    run = [str(script), str(tmp_path / "out"), str(tmp_path / "cache"), recipe, *overrides]
    pre = subprocess.run(
        [sys.executable, "-m", "lightning_trn.precompile", "--steps", "3", *run],
        env=_env(),
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pre.returncode == 0, pre.stderr[-3000:]
    job = subprocess.run(
        [sys.executable, *run], env=_env(), cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300
    )
    assert job.returncode == 0, job.stderr[-3000:]
    return _result(pre.stdout), _result(job.stdout)


@pytest.mark.slow
def test_precompile_sees_every_graph_of_a_recipe_job(tmp_path):
    """A few precompile steps of the MLP recipe's job put every graph the whole job compiles into the cache: the job
    then misses none (on XLA:CPU a cached graph counts as `unloadable`, not as a miss: it cannot be deserialised)."""
    pre, counters = _precompile_then_run(tmp_path, "mlp", ["trainer.max_epochs=2"])
    assert pre["misses"] == 3  # the evaluation step, the first and the steady training step
    assert counters["misses"] == 0 and counters["unloadable"] == 3


#: the LLM recipe's job, 2 epochs of 12 steps (logging steps 10 and 20, a checkpoint and validation per epoch, then
#: test), its model narrower than the recipe's (same layers and ops, faster to compile: CI time)
LLM_JOB = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=12",
    "trainer.limit_val_batches=4",
    "trainer.limit_test_batches=4",
    "data.vocab_size=300",
    "data.seq_len=32",
    "model.hidden_size=32",
    "model.intermediate_size=64",
]


@pytest.mark.slow
def test_precompile_sees_every_graph_of_the_llm_recipe_job(tmp_path):
    """The same for the LLM recipe (AdamW with its LR schedule, clipping, a graph at checkpoints): every graph comes
    up in 3 precompile steps (in 1, in fact); the longer job with logging steps and a second epoch compiles nothing
    new."""
    pre, counters = _precompile_then_run(tmp_path, "llm", LLM_JOB)
    assert pre["misses"] == 4
    assert counters["misses"] == 0 and counters["unloadable"] == 4
