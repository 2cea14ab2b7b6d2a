"""The LLM recipe (`recipes/llm/`) on the native backend, the stand-in as the `neuron` device: the default job with
activation checkpointing meets the perplexity bar, and its export generates in a process without the stand-in."""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipe_runs import FLOAT64_ON_CPU, export_checkpoint, run_without_standin
from tests.tolerance import assert_losses_match, losses_error

pytestmark = pytest.mark.native_only


@pytest.mark.slow
def test_llm_recipe_meets_the_bar_natively_with_activation_checkpointing(tmp_path) -> None:
    env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_trn.recipes.llm",
            "model.activation_checkpointing=true",
            "trainer.enable_progress_bar=false",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "lightning_trn: native backend" in run.stderr
    printed = re.search(r"^\[llm\] val_ppl=([0-9.]+) unigram_ppl=([0-9.]+)$", run.stdout, re.MULTILINE)
    assert printed, run.stdout[-2000:]
    assert float(printed.group(1)) <= float(printed.group(2)) / 2
    train_loss = _train_losses(tmp_path / "runs" / "llm")
    assert len(train_loss) >= 10 and train_loss[-1] < train_loss[0] - 1.0, train_loss

    checkpoint = tmp_path / "runs" / "llm" / "checkpoints" / "last.ckpt"
    export_checkpoint("llm", checkpoint, tmp_path / "export", env)
    code = (
        "import sys, torch\n"
        "assert torch._C._get_privateuse1_backend_name() == 'privateuseone'  # no stand-in here\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "prompt = tokenizer('The acting is', return_tensors='pt')\n"
        "out = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)\n"
        "assert out.shape[1] == prompt['input_ids'].shape[1] + 5\n"
        "print('GENERATED', tokenizer.decode(out[0]))\n"
    )
    loaded = run_without_standin(code, str(tmp_path / "export"), cwd=tmp_path)
    assert "GENERATED The acting is" in loaded.stdout, loaded.stderr[-2000:]


def _train_losses(run_dir: Path) -> list[float]:
    with open(run_dir / "logs" / "metrics.csv") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]]


@pytest.mark.slow
@pytest.mark.numerics
def test_tensor_parallel_llm_trains_like_one_device(tmp_path) -> None:
    """`trainer.strategy=model_parallel model.tensor_parallel_size=2` (`recipes.llm.parallelize`, TorchTitan's whole
    plan: embedding and LM head split over the vocabulary, the cross entropy under `loss_parallel`, column-wise q/k/v
    and gate/up, row-wise o and down, sequence-parallel norms; AdamW on its default `foreach` path) gives the
    one-device run's losses on the same batches."""
    short = [
        "trainer.limit_train_batches=10",
        "trainer.log_every_n_steps=5",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=1",
        "trainer.enable_progress_bar=false",
    ]
    runs = {
        "single": ["trainer.devices=1"],
        "single64": list(FLOAT64_ON_CPU),  # the reference's float64 twin (tests/tolerance.py)
        # both ranks of the tensor-parallel group take the recipe's own seeded shuffle, as the single run does
        "tp2": [
            "trainer.devices=2",
            "trainer.strategy=model_parallel",
            "model.tensor_parallel_size=2",
            "trainer.use_distributed_sampler=false",
        ],
    }
    ppl = {}
    for name, overrides in runs.items():
        env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": "2"}
        run = subprocess.run(
            [sys.executable, "-m", "lightning_trn.recipes.llm", *short, *overrides, f"out_dir={tmp_path / name}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        ppl[name] = float(re.search(r"val_ppl=([0-9.]+)", run.stdout).group(1))
    # the sharded checkpoint holds each block matrix in two halves (column-wise split by rows, row-wise by columns),
    # the embedding and LM head in two vocabulary halves, and the norms whole
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "tp2" / "checkpoints" / "last.ckpt")).read_metadata().state_dict_metadata
    layer = "state_dict.net.model.layers.1."
    names = [
        layer + name
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.o_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
        )
    ]
    names += ["state_dict.net.model.embed_tokens", "state_dict.net.lm_head", "state_dict.net.model.norm"]
    halves = {name.rsplit(".", 1)[-1]: [tuple(c.sizes) for c in saved[name + ".weight"].chunks] for name in names}
    assert halves == {
        "q_proj": [(64, 128)] * 2,
        "k_proj": [(32, 128)] * 2,
        "o_proj": [(128, 64)] * 2,
        "up_proj": [(192, 128)] * 2,
        "down_proj": [(128, 192)] * 2,
        "input_layernorm": [(128,)],
        "embed_tokens": [(1024, 128)] * 2,
        "lm_head": [(1024, 128)] * 2,
        "norm": [(128,)],
    }, halves
    single, tp2 = _train_losses(tmp_path / "single"), _train_losses(tmp_path / "tp2")
    assert len(single) == 2 and single[-1] < single[0]
    # within the reference's own float32 error, measured against its float64 twin (tests/tolerance.py); the printed
    # perplexity is rounded to 0.01, so its logarithm is known to 0.005 / ppl at best
    error = losses_error(single, _train_losses(tmp_path / "single64"))
    assert_losses_match(tp2, single, error)
    printed = max(error, 0.005 / ppl["single"])
    assert_losses_match([math.log(ppl["tp2"])], [math.log(ppl["single"])], printed, what="log val_ppl")
