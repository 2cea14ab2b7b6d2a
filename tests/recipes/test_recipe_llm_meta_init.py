"""Meta-device initialization of the LLM recipe (`recipes/llm/`): under a sharded strategy `build_model` builds
`LlamaForCausalLM` on the meta device and the strategy's `materialize` gives each rank its shards, replaying the
eager build's initialization (`eager_init_steps`, `CausalLM.materialization_steps`) on one submodule at a time.

What is checked: the trn2-8b preset's model (7.24 B parameters) exists without memory; materialized weights and
buffers (the rotary `inv_freq`, non-persistent, included) equal the eager build's bit for bit, whatever the mesh;
2 stand-in processes train from them exactly as from the eager build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_trn.core.parallel.model_parallel import materialize
from lightning_trn.recipes import cli, llm
from tests.launch import child_env

pytestmark = pytest.mark.native_only

SCRIPT = Path(__file__).parents[1] / "scripts" / "llm_meta_init.py"
sys.path.insert(0, str(SCRIPT.parent))
from llm_meta_init import MODEL, SEED  # noqa: E402

RUN_TIMEOUT_S = 120


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (non-persistent ones included) by name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _assert_bit_equal(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert state.keys() == reference.keys()
    differ = [name for name, value in reference.items() if not torch.equal(state[name].cpu(), value.cpu())]
    assert not differ, differ


def _eager_net(seed: int = SEED) -> torch.nn.Module:
    torch.manual_seed(seed)
    return llm.CausalLM(**MODEL).net


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_trn2_8b_preset_model_is_built_on_meta_without_memory() -> None:
    """`build_model` under the preset's model_parallel strategy: every tensor on meta, the exact parameter count of
    Llama-3-8B's shape with a 32k vocabulary, without host memory (eager: 29 GB fp32)."""
    preset = list(llm.PRESETS["trn2-8b"])
    # the preset's settings with a small model first: were it built eagerly, the 8 B one would take 29 GB
    small = llm.build_model(cli.load_config(llm.RECIPE, [*preset, "data.vocab_size=300", "model.num_layers=1"]))
    assert all(t.is_meta for t in small.parameters())
    cfg = cli.load_config(llm.RECIPE, preset)
    assert cfg.trainer.strategy == "model_parallel"
    before = _resident_bytes()
    module = llm.build_model(cfg)
    grown = _resident_bytes() - before
    assert all(t.is_meta for t in module.net.parameters()) and all(t.is_meta for t in module.net.buffers())
    vocab, hidden, inter, layers, kv = 32000, 4096, 14336, 32, 8 * 128
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    expected = 2 * vocab * hidden + layers * per_layer + hidden
    assert sum(p.numel() for p in module.parameters()) == expected == 7_241_732_096
    assert grown < 256 * 2**20, f"{grown / 2**20:.0f} MiB"


@pytest.mark.parametrize(("strategy", "meta"), [("auto", False), ("model_parallel", True), ("fsdp", True)])
def test_build_model_uses_meta_for_sharded_strategies(strategy: str, meta: bool) -> None:
    module = llm.build_model(cli.load_config(llm.RECIPE, [f"trainer.strategy={strategy}"]))
    assert all(p.is_meta == meta for p in module.parameters())
    assert "meta_init" not in module.hparams  # a checkpoint loads into a module built on the host


def test_materialization_reproduces_the_eager_build() -> None:
    """`materialize` (the strategies' own) on a meta-built module: the eager build's weights and buffers, although
    the generator drew in between; it gets its state back afterwards, and tensors not on meta keep their values."""
    torch.manual_seed(SEED)
    module = llm.CausalLM(meta_init=True, **MODEL)
    assert module.net.model.rotary_emb.inv_freq.is_meta
    module.val_loss.update(torch.tensor(3.0), torch.tensor(2))  # a metric's state, on the host, not on meta
    torch.rand(11)
    state = torch.random.get_rng_state()
    materialize(module, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert (module.val_loss.total.item(), module.val_loss.count.item()) == (3.0, 2.0)  # not emptied with the model
    _assert_bit_equal(_state(module.net), _state(_eager_net()))
    # not a generator that happened to match: another seed gives other weights, the same buffers
    other = _state(_eager_net(SEED + 1))
    assert not torch.equal(module.net.lm_head.weight, other["lm_head.weight"])
    assert torch.equal(module.net.model.rotary_emb.inv_freq, other["model.rotary_emb.inv_freq"])


def test_meta_init_without_a_mesh_is_materialized_in_configure_model(tmp_path: Path) -> None:
    """Under a strategy that does not shard (one CPU device), `configure_model` materializes the whole model."""
    seen = {}

    class Record(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen.update({name: t.detach().clone() for name, t in _state(pl_module.net).items()})

    torch.manual_seed(SEED)
    module = llm.CausalLM(meta_init=True, **MODEL)
    tokens = torch.randint(0, MODEL["vocab_size"], (4, MODEL["seq_len"]))
    loader = torch.utils.data.DataLoader(llm.data._BlockDataset({"input_ids": tokens, "labels": tokens}), batch_size=4)
    pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
        default_root_dir=tmp_path,
    ).fit(module, train_dataloaders=loader)
    _assert_bit_equal(seen, _state(_eager_net()))


def _run(out: Path, meta: bool, tp: int = 1) -> dict:
    """The worker script on 2 stand-in devices: rank 0's initial and final weights and its losses."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--meta", str(int(meta)), "--tp", str(tp)]
    env = child_env(LIGHTNING_TRN_STANDIN="1", LIGHTNING_TRN_STANDIN_DEVICES="2")
    result = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        "init": torch.load(out / "init.pt"),
        "final": torch.load(out / "final.pt"),
        "losses": json.loads((out / "losses.json").read_text()),
    }


@pytest.mark.slow
def test_two_processes_train_from_meta_init_exactly_as_from_eager_init(tmp_path: Path) -> None:
    """FSDP2 over 2 processes: built on meta and materialized, the module starts from the eager build's weights and
    buffers and ends 3 AdamW steps on the same losses and weights, bit for bit, as the eagerly built one."""
    meta, eager = _run(tmp_path / "meta", meta=True), _run(tmp_path / "eager", meta=False)
    _assert_bit_equal(meta["init"], _state(_eager_net()))
    _assert_bit_equal(meta["init"], eager["init"])
    assert meta["losses"] == eager["losses"] and len(meta["losses"]) == 3
    _assert_bit_equal(meta["final"], eager["final"])
    assert not torch.equal(meta["final"]["lm_head.weight"], meta["init"]["lm_head.weight"])  # it trained


@pytest.mark.slow
def test_tensor_parallel_meta_init_materializes_the_eager_weights(tmp_path: Path) -> None:
    """Tensor parallel over 2 processes (column- and row-wise shards of each block): the gathered weights and the
    buffers as training starts are the eager build's."""
    _assert_bit_equal(_run(tmp_path / "tp2", meta=True, tp=2)["init"], _state(_eager_net()))
