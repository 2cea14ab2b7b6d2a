"""Compiled blocks under sharding on the native backend (the stand-in's `neuron` compiler: Dynamo captures each
block's graph, which then runs op by op, so what is proven is the capture, the placement of the compile step and the
numerics around it, not speed).

- The LLM recipe's `parallelize` in TorchTitan's order (tensor parallel, activation checkpointing, `torch.compile` per
  decoder layer, FSDP2) trains exactly like the eager model under FSDP2, tensor parallel and dp x tp, with no graph
  break and no graph built after the first step (one 4-process run, `tests/scripts/compile_blocks.py`).
- `model.compile=true` with `data.length_buckets` on fine-tuning rows: the run equals the eager one, builds one graph
  per bucket and mode (training, evaluation) the first time that bucket's shape comes and none after, and its
  checkpoint keys are the eager run's: each run's checkpoint loads into the other.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch._dynamo.utils import counters
from typing_extensions import override

from lightning_trn.recipes import cli, common, llm
from tests.launch import child_env
from tests.recipes.test_recipe_llm_pretrained import STEP, Folder, save_folder

pytestmark = [pytest.mark.native_only, pytest.mark.numerics]

SCRIPT = Path(__file__).parents[1] / "scripts" / "compile_blocks.py"


class _Steps(Callback):
    """(sequence length, Dynamo's graph count after the step) and the loss of every training step."""

    def __init__(self) -> None:
        self.graphs: list[tuple[int, int]] = []
        self.losses: list[float] = []

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.graphs.append((batch["input_ids"].shape[1], counters["stats"]["unique_graphs"]))
        self.losses.append(float(outputs["loss"]))


class _Run(NamedTuple):
    module: llm.CausalLM
    steps: _Steps
    checkpoint: Path
    data: Any


def _fine_tune(folder: Folder, out: Path, compiled: bool) -> _Run:
    """The recipe's fine-tuning of `folder` on its rows in length buckets 22, 24 and 32 (its rows' labelled tokens end
    at 22, 24 or later), one epoch, validation at its end; the checkpoint written after it."""
    overrides = [f"model.pretrained={folder.path}", f"data.source={folder.rows}", f"out_dir={out}", *STEP]
    overrides += ["data.length_buckets=[22,24]", "trainer.num_sanity_val_steps=0", f"model.compile={compiled}"]
    cfg = cli.load_config(llm.RECIPE, overrides)
    data = llm.RECIPE.build_data(cfg)
    module = llm.RECIPE.build_model(cfg)
    trainer = common.build_trainer(cfg, llm.RECIPE)
    steps = _Steps()
    trainer.callbacks.append(steps)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(out / "end.ckpt")
    return _Run(module, steps, out / "end.ckpt", data)


def test_recipe_compile_with_length_buckets_equals_eager_and_compiles_once_per_bucket(tmp_path: Path) -> None:
    folder = save_folder(tmp_path)
    torch._dynamo.reset()  # no graph of an earlier test in this process serves this one's blocks
    start, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    eager = _fine_tune(folder, tmp_path / "eager", compiled=False)
    assert counters["stats"]["unique_graphs"] == start
    compiled = _fine_tune(folder, tmp_path / "compiled", compiled=True)
    assert all(layer._compiled_call_impl is not None for layer in compiled.module.net.model.layers)

    # training: a graph the first time a bucket's length comes, none after (the layers share it)
    lengths = [length for length, _ in compiled.steps.graphs]
    assert len(set(lengths)) == 3, lengths
    graphs = [start] + [count for _, count in compiled.steps.graphs]
    seen: set[int] = set()
    for step, length in enumerate(lengths):
        assert graphs[step + 1] - graphs[step] == (length not in seen), (step, lengths, graphs)
        seen.add(length)
    # validation: one graph per bucket in its batches (evaluation mode, no gradients: graphs of their own)
    val_lengths = {batch["input_ids"].shape[1] for batch in compiled.data.val_dataloader()}
    assert counters["stats"]["unique_graphs"] - graphs[-1] == len(val_lengths)
    assert sum(counters["graph_break"].values()) == breaks

    # the stand-in runs each captured graph op by op: the eager kernels in the eager order, bit-exact; 1e-6 absorbs
    # nothing there
    assert compiled.steps.losses == pytest.approx(eager.steps.losses, abs=1e-6)
    eager_state = {key: value.cpu() for key, value in eager.module.state_dict().items()}
    for key, value in compiled.module.state_dict().items():
        torch.testing.assert_close(value.cpu(), eager_state[key], rtol=0, atol=1e-6, msg=key)

    # checkpoints: the same keys, so each run's loads into the other (strictly) and into a module built from it alone
    eager_saved, compiled_saved = (
        torch.load(run.checkpoint, weights_only=True)["state_dict"] for run in (eager, compiled)
    )
    assert list(compiled_saved) == list(eager_saved)
    assert not any("_orig_mod" in key for key in compiled_saved)
    eager.module.load_state_dict(compiled_saved)
    compiled.module.load_state_dict(eager_saved)
    loaded = llm.CausalLM.load_from_checkpoint(compiled.checkpoint, map_location="cpu", weights_only=True)
    assert all(layer._compiled_call_impl is None for layer in loaded.net.model.layers)  # export: not compiled


def test_recipe_compile_allows_the_graphs_its_buckets_and_tensor_parallel_need() -> None:
    """4 length buckets and seq_len, training and evaluation, 2 kinds of first-layer input under tensor parallel: 20
    graphs of the layers' one compiled function, past Dynamo's default limit of 8, where `fullgraph=True` fails."""
    overrides = ["trainer.strategy=model_parallel", "trainer.devices=2", "model.tensor_parallel_size=2"]
    overrides += ["data.length_buckets=[16,32,64,96]", "model.compile=true"]
    with torch._dynamo.config.patch(recompile_limit=8):  # restored after the test
        llm.build_model(cli.load_config(llm.RECIPE, overrides))
        assert torch._dynamo.config.recompile_limit == 20
        llm.build_model(cli.load_config(llm.RECIPE, ["model.compile=false"]))
        assert torch._dynamo.config.recompile_limit == 20  # never lowered


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_under_fsdp2_tp_and_dp_tp(tmp_path: Path) -> None:
    report_file = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", str(SCRIPT), str(report_file)],
        env=child_env(LIGHTNING_TRN_STANDIN_DEVICES="4"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report.keys() == {"fsdp", "tp", "dp_tp"}
    for mesh, result in report.items():
        assert result["same_keys"], mesh  # compiled in place: no `_orig_mod.` in the names
        # bit-exact on the stand-in (its captured graphs run the eager ops in order): 1e-6 absorbs nothing there
        assert result["compiled_losses"] == pytest.approx(result["eager_losses"], abs=1e-6), mesh
        assert result["max_weight_difference"] <= 1e-6, mesh
        assert result["eager_graphs"] == 0, mesh
        # the decoder layers share their graphs; under tensor parallel the first layer's input (the embedding's
        # output) can be a tensor of another type than the later ones' (a collective's pending result): 2 graphs
        assert result["first_step_graphs"] in ((1,) if mesh == "fsdp" else (1, 2)), mesh
        assert result["later_graphs"] == 0, mesh  # fixed shapes: nothing recompiles after the first step
        assert result["graph_breaks"] == 0, mesh  # fullgraph=True would have raised on one anyway
