"""`python -m lightning_trn.recipes.llm model.pretrained=DIR data.source=FILE.jsonl` sharded on two stand-in devices:
built on the meta device, parallelized (FSDP2 over 2; tensor parallel over 2, with the folder's tied embedding and
LM head tied again; two pipeline stages), then filled from the folder, each rank reading its blocks. Proven by
equality with the one-device run (in this process): the same losses from the first step (the loaded weights) to the
last."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_trn.recipes import cli, llm
from tests.recipe_runs import FLOAT64_ON_CPU
from tests.recipes.test_recipe_llm_pretrained import STEP, save_folder
from tests.tolerance import assert_losses_match, losses_error

pytestmark = pytest.mark.native_only


def _train_losses(run_dir: Path) -> list[float]:
    with open(run_dir / "logs" / "metrics.csv") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


@pytest.mark.numerics
def test_sharded_fine_tuning_from_a_folder_matches_one_device(tmp_path: Path) -> None:
    folder = save_folder(tmp_path)
    common = [
        f"model.pretrained={folder.path}",
        f"data.source={folder.rows}",
        *STEP,
        "trainer.max_steps=3",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
    ]
    # every rank takes the recipe's own seeded shuffle, as the one-device run does: same global batches
    cli.main(llm.RECIPE, [*common, "trainer.devices=1", f"out_dir={tmp_path / 'single'}"])  # the reference
    cli.main(llm.RECIPE, [*common, *FLOAT64_ON_CPU, f"out_dir={tmp_path / 'single64'}"])  # its float64 twin
    runs = {
        "fsdp2": ["trainer.devices=2", "trainer.strategy=model_parallel", "trainer.use_distributed_sampler=false"],
        "tp2": [
            "trainer.devices=2",
            "trainer.strategy=model_parallel",
            "model.tensor_parallel_size=2",
            "trainer.use_distributed_sampler=false",
        ],
        # two stages, the tied embedding and head on either end: each microbatch's loss is its share of the batch's
        # predicted tokens (prompt and padding are not predicted, and fall unevenly between the microbatches)
        "pp2": [
            "trainer.devices=2",
            "trainer.strategy=model_parallel",
            "model.pipeline_parallel_size=2",
            "trainer.use_distributed_sampler=false",
        ],
    }
    env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": "2"}
    losses = {"single": _train_losses(tmp_path / "single")}
    for name, overrides in runs.items():
        run = subprocess.run(
            [sys.executable, "-m", "lightning_trn.recipes.llm", *common, *overrides, f"out_dir={tmp_path / name}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        losses[name] = _train_losses(tmp_path / name)
    assert len(losses["single"]) == 3 and len(set(losses["single"])) == 3
    # within the reference's own float32 error, measured against its float64 twin (tests/tolerance.py)
    error = losses_error(losses["single"], _train_losses(tmp_path / "single64"))
    assert_losses_match(losses["fsdp2"], losses["single"], error, what="fsdp2 losses")
    assert_losses_match(losses["tp2"], losses["single"], error, what="tp2 losses")
    assert_losses_match(losses["pp2"], losses["single"], error, what="pp2 losses")
