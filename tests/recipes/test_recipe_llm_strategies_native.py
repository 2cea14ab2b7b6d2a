"""The LLM recipe (`recipes/llm/`) on the native backend (the stand-in), ending exactly like the run it stands for:

- `trainer.strategy=fsdp` (one FSDP unit per decoder layer) on two devices ends with the weights and validation/test
  losses of one unsharded device on the same global batch;
- a job checkpointing mid-epoch (`ckpt_every_n_steps`), killed after its first checkpoint and restarted with
  `ckpt_path=`, ends bitwise equal to the uninterrupted job (shuffle position, LR schedule, optimizer state);
- `model.pipeline_parallel_size=2` (two stages of one decoder layer each, on two devices) ends like the same
  `trainer.strategy=model_parallel` job on one device, and its checkpoint is the unsplit model's.

For FSDP the reference is one device under `neuron_ddp`: like FSDP, a distributed strategy, so Lightning draws the
training order with `DistributedSampler(shuffle=True, seed=seed)` in both runs, and two ranks of batch 4 (`perm[r::2]`)
together take the one-device batch 8. A `strategy=auto` run shuffles with the recipe's own generator instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_trn.recipes.llm import CausalLM
from tests.recipe_runs import (
    FLOAT64,
    RESUMABLE,
    TINY_LLM,
    assert_ends_alike,
    assert_ends_identically,
    kill_after_first_checkpoint,
    left_behind,
    run,
)
from tests.tolerance import assert_losses_match, assert_moments_match, losses_error

pytestmark = pytest.mark.native_only

METRICS = ("val_loss", "val_ppl", "test_loss", "test_ppl")


def _env() -> dict[str, str]:
    return {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": "2"}


@pytest.mark.slow
@pytest.mark.numerics
def test_fsdp_on_two_devices_ends_like_one_device(tmp_path: Path) -> None:
    job = (*TINY_LLM, "trainer.strategy=neuron_ddp", "trainer.devices=1", "data.batch_size=8")
    one = run("llm", tmp_path / "one", *job, env=_env(), metrics=METRICS)
    exact = run("llm", tmp_path / "one64", *job, *FLOAT64, env=_env(), metrics=METRICS)
    fsdp = run(
        "llm",
        tmp_path / "fsdp",
        *TINY_LLM,
        "trainer.strategy=fsdp",
        "trainer.devices=2",
        "data.batch_size=4",
        env=_env(),
        metrics=METRICS,
    )
    assert fsdp["ckpt"]["global_step"] == 6
    # the sharded run writes a distributed checkpoint directory, as `strategy="fsdp"` does (docs/sharding.md); its
    # consolidated state holds the whole weights
    assert (tmp_path / "fsdp" / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    # its evaluation splits are whole batches on both ranks: Lightning's sampler repeats no block, and the recipe
    # leaves out Lightning's warning that it might (docs/troubleshooting.md)
    assert "Using `DistributedSampler`" not in fsdp["stderr"]
    assert_ends_alike(fsdp, one, exact)
    # the perplexities are their losses' exponentials (each a TokenMean of its own, reduced over the ranks): float32
    # exp, a few ulps relative, of the same mean (~6: 1 ulp = 5e-7), under 1e-5
    for split in ("val", "test"):
        loss = torch.tensor(one["metrics"][f"{split}_loss"][0])
        assert one["metrics"][f"{split}_ppl"][0] == pytest.approx(loss.exp().item(), rel=1e-5)


@pytest.mark.slow
def test_a_job_killed_mid_epoch_and_restarted_ends_as_the_uninterrupted_job(tmp_path: Path) -> None:
    expected = run("llm", tmp_path / "a", *TINY_LLM, *RESUMABLE, env=_env())
    ckpt = kill_after_first_checkpoint("llm", tmp_path / "b", *TINY_LLM, *RESUMABLE, env=_env())
    resumed = run("llm", tmp_path / "b", *TINY_LLM, *RESUMABLE, f"ckpt_path={ckpt}", env=_env())
    assert_ends_identically(resumed, expected)


@pytest.mark.slow
@pytest.mark.numerics
def test_pipeline_stages_end_like_one_device(tmp_path: Path) -> None:
    """Both ranks read the same batches (one data-parallel rank), as the one device does: the same losses every step
    (the last stage's, logged on every rank), evaluation and weights within float tolerance. The stages' checkpoint,
    consolidated, is the unsplit model's: every weight under its name (strictly loadable into `CausalLM` without
    stages), and AdamW's state at the positions of the one-device run's param groups (matrices, vectors)."""
    job = (*TINY_LLM, "trainer.strategy=model_parallel")
    one = run("llm", tmp_path / "one", *job, "trainer.devices=1", env=_env(), metrics=METRICS)
    exact = run("llm", tmp_path / "one64", *job, "trainer.devices=1", *FLOAT64, env=_env(), metrics=METRICS)
    stages = run(
        "llm", tmp_path / "pp", *job, "trainer.devices=2", "model.pipeline_parallel_size=2", env=_env(), metrics=METRICS
    )
    assert_ends_alike(stages, one, exact)
    losses = [left_behind(tmp_path / out, ("train_loss",))["metrics"]["train_loss"] for out in ("pp", "one", "one64")]
    assert len(losses[1]) == 6
    assert_losses_match(losses[0], losses[1], losses_error(losses[1], losses[2]), what="train_loss")
    CausalLM(**stages["ckpt"]["hyper_parameters"]).load_state_dict(stages["ckpt"]["state_dict"])
    saved, reference = stages["ckpt"]["optimizer_states"][0], one["ckpt"]["optimizer_states"][0]
    assert [group["params"] for group in saved["param_groups"]] == [
        group["params"] for group in reference["param_groups"]
    ]
    assert_moments_match(saved, reference, exact["ckpt"]["optimizer_states"][0])
