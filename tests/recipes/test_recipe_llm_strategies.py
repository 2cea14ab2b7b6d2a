"""The LLM recipe (`lightning_trn/recipes/llm/`) under its command-line strategy overrides on XLA:CPU: each ends
with exactly the run it stands for, not merely a run whose loss went down.

- `trainer.strategy=neuron_ddp` / `neuron_zero1` with `trainer.devices=2` and half the per-device batch end with the
  one-process run's weights and validation/test losses (float summation order apart). The reference is one process
  under `neuron_ddp`: every distributed strategy, whatever its size, makes Lightning replace the recipe's shuffle
  with `DistributedSampler(shuffle=True, seed=seed)`, whose epoch permutation the ranks split `perm[r::2]`, so two
  ranks with batch b together take the one-process batch 2b `perm[2bk:2b(k+1)]`. (A `strategy=auto` run shuffles
  with the recipe's own generator: another order.) The validation and test batches split the same way.

The recipe's mid-epoch restart is tested on the native backend (`tests/recipes/test_recipe_llm_strategies_native.py`:
nothing in it depends on the backend but the plugin's random state, which `tests/checkpoint/test_fault_tolerance.py`
checks on XLA:CPU with the MLP recipe killed at a random moment), to keep CI within its time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import child_env
from tests.recipe_runs import FLOAT64, TINY_LLM, assert_ends_alike, run

pytestmark = pytest.mark.xla_only

#: one layer: half the compile time of the default two
TINY = (*TINY_LLM, "model.num_layers=1")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process, batch 8, under `neuron_ddp` (so the injected `DistributedSampler` orders the data); `float64`,
    its twin in float64 on the CPU (tests/tolerance.py)."""
    out = tmp_path_factory.mktemp("llm_one") / "run"
    job = (*TINY, "trainer.strategy=neuron_ddp", "data.batch_size=8")
    one = run("llm", out, *job, env=child_env())
    return {**one, "float64": run("llm", out.parent / "run64", *job, *FLOAT64, env=child_env())}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["neuron_ddp", "neuron_zero1"])
def test_two_processes_end_like_one_process_with_the_same_global_batch(
    tmp_path: Path, one_process: dict, strategy: str
) -> None:
    two = run(
        "llm",
        tmp_path / "run",
        *TINY,
        f"trainer.strategy={strategy}",
        "trainer.devices=2",
        "data.batch_size=4",
        env=child_env(),
    )
    assert two["ckpt"]["global_step"] == 6
    assert_ends_alike(two, one_process, one_process["float64"])
