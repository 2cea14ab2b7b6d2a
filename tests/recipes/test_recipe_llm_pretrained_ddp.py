"""`python -m lightning_trn.recipes.llm model.pretrained=DIR` under data parallelism: `trainer.strategy=neuron_ddp`
and `neuron_zero1` on 2 processes of the stand-in. The model is
built on the host and filled from the folder in `configure_model` on every rank, before the strategy moves it.

Proven by equality with one process: two ranks of batch 4 end with the weights and validation/test losses of one
process of batch 8 under `neuron_ddp` (the same `DistributedSampler` order: ranks take `perm[r::2]`). The data is the
default text source packed into blocks with the folder's tokenizer: every block has the same number of targets, so
the mean of the ranks' mean losses is the one process's mean. (On supervised rows each rank averages over its own
response tokens, which differs from one process's average over the batch's.) That the reference started from the
folder's weights, not from a random draw, is checked on its weights: a few AdamW steps of learning rate `LR` move
each weight by about `LR` per step, while another draw differs by the weights' scale (std 0.02).

Native suite only, for CI time: on XLA:CPU the same strategies load a folder under LoRA
(tests/recipes/test_recipe_llm_lora.py), and the strategies' own equality with one process is tested there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import child_env
from tests.recipe_runs import FLOAT64, assert_ends_alike, run
from tests.recipes.test_recipe_llm_pretrained import Folder, save_folder

pytestmark = [pytest.mark.native_only, pytest.mark.slow, pytest.mark.numerics]

STEPS = 4
LR = 1.0e-3
COMMON = (
    "data.seq_len=32",
    f"model.lr={LR}",
    "model.warmup_steps=0",
    "trainer.max_epochs=1",
    f"trainer.limit_train_batches={STEPS}",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("pretrained"))


@pytest.fixture(scope="module")
def one_process(folder: Folder, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process, and its float64 twin (tests/tolerance.py), which measures its float32 error."""
    out = tmp_path_factory.mktemp("one") / "run"
    job = (f"model.pretrained={folder.path}", *COMMON, "trainer.strategy=neuron_ddp", "trainer.devices=1")
    one = run("llm", out, *job, "data.batch_size=8", env=child_env())
    return {**one, "float64": run("llm", out.parent / "run64", *job, "data.batch_size=8", *FLOAT64, env=child_env())}


def test_the_reference_starts_from_the_folders_weights(folder: Folder, one_process: dict) -> None:
    from safetensors.torch import load_file

    saved = load_file(folder.path / "model.safetensors")
    trained = one_process["ckpt"]["state_dict"]
    assert one_process["ckpt"]["global_step"] == STEPS
    for key, value in saved.items():
        moved = (trained[f"net.{key}"] - value).abs().max().item()
        assert 0 < moved <= 2 * LR * STEPS, (key, moved)


@pytest.mark.parametrize("strategy", ["neuron_ddp", "neuron_zero1"])
def test_two_processes_end_like_one_process(folder: Folder, one_process: dict, tmp_path: Path, strategy: str) -> None:
    two = run(
        "llm",
        tmp_path / "run",
        f"model.pretrained={folder.path}",
        *COMMON,
        f"trainer.strategy={strategy}",
        "trainer.devices=2",
        "data.batch_size=4",
        env=child_env(),
    )
    assert two["ckpt"]["global_step"] == STEPS
    # fine-tuning 4 steps moves a pretrained model little: `test_the_reference_starts_from_the_folders_weights`
    # shows it moved at all
    assert_ends_alike(two, one_process, one_process["float64"], trained_below=None)
