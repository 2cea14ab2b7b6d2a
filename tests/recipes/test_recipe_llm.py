"""The LLM recipe (`recipes/llm/`) on XLA:CPU: the default job meets its perplexity bar without recompiling per
step, its export loads in plain transformers without torch_xla, bad overrides are one line, the packed blocks keep
every token, the tokenizer is deterministic and the causal mask reads nothing from the device."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_trn.recipes import cli, common, llm
from tests.xla_free_python import run_without_torch_xla

pytestmark = pytest.mark.xla_only

DOCUMENTS = [f"review {i}: " + "good " * (i % 7) + "bad " * (i % 3) + f"film number {i * 37}." for i in range(300)]


@pytest.fixture(scope="module")
def default_job(tmp_path_factory) -> dict:
    """The default `python -m recipes.llm` job, in this process: its results, printed lines and runtime counters."""
    import contextlib
    import io

    from lightning_trn.runtime import get_runtime

    out_dir = tmp_path_factory.mktemp("llm") / "run"
    cfg = cli.load_config(llm.RECIPE, [f"out_dir={out_dir}", "trainer.enable_progress_bar=false"])
    before = get_runtime().metrics()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        model, results = common.fit(llm.RECIPE, cfg)
    delta = get_runtime().metrics() - before
    return {"cfg": cfg, "model": model, "results": results, "stdout": stdout.getvalue(), "metrics": delta}


@pytest.mark.slow
def test_default_job_meets_the_perplexity_bar_without_recompiling(default_job):
    printed = re.search(r"^\[llm\] val_ppl=([0-9.]+) unigram_ppl=([0-9.]+)$", default_job["stdout"], re.MULTILINE)
    assert printed, default_job["stdout"][-2000:]
    val_ppl, unigram_ppl = float(printed.group(1)), float(printed.group(2))
    assert val_ppl <= unigram_ppl / 2, (val_ppl, unigram_ppl)
    assert default_job["results"]["val_ppl"] == pytest.approx(val_ppl, abs=0.01)  # printed to 2 decimals: +-0.005
    assert "[llm] held-out test: test_loss=" in default_job["stdout"]
    # one training step graph (+ the first step's, which creates the AdamW state), validation, test: a graph per
    # step, or a host read per step (transformers' packed-sequence check), would show up as 100s here
    steps = default_job["cfg"].trainer.limit_train_batches
    metrics = default_job["metrics"]
    assert metrics.compiles <= 6, metrics
    assert metrics.device_to_host + metrics.scalar_reads < steps // 2, metrics


@pytest.mark.slow
def test_export_loads_in_plain_transformers_without_torch_xla_and_generates(default_job, tmp_path, tmp_path_factory):
    checkpoint = default_job["results"]["checkpoint"]
    out = common.export(llm.RECIPE, checkpoint, str(tmp_path / "export"))
    module = common.load_module(llm.RECIPE, checkpoint).eval()
    assert module.hparams.num_kv_heads < module.hparams.num_heads  # grouped-query attention
    input_ids = module.tokenizer()(
        ["A charming, funny film.", "Dull and far too long!!"], padding=True, return_tensors="pt"
    )["input_ids"][:, :6]
    with torch.no_grad():
        expected = module(input_ids)
    torch.save(input_ids, tmp_path / "input_ids.pt")
    child = run_without_torch_xla(
        f"""
        import importlib.util, sys
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        out = {str(out)!r}
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        tokenizer = AutoTokenizer.from_pretrained(out)
        input_ids = torch.load({str(tmp_path / "input_ids.pt")!r}, weights_only=True)
        with torch.no_grad():
            torch.save(model(input_ids=input_ids).logits, {str(tmp_path / "logits.pt")!r})
        prompt = tokenizer("This movie is", return_tensors="pt")
        generated = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        assert generated.shape == (1, prompt["input_ids"].shape[1] + 5), generated.shape
        print("TEXT:" + tokenizer.decode(generated[0]).replace("\\n", " "))
        assert importlib.util.find_spec("torch_xla") is None
        assert not any(name.startswith(("torch_xla", "lightning_trn", "recipes")) for name in sys.modules)
        print("CHILD OK")
    """,
        tmp_path_factory.getbasetemp(),
    )
    assert child.returncode == 0 and "CHILD OK" in child.stdout, child.stdout[-2000:] + child.stderr[-4000:]
    assert "TEXT:This movie is" in child.stdout
    # one float32 forward of the same weights, transformers' own mask and attention path against the recipe's: a few
    # ulps (eps 1.2e-7) of the activations (~1) per layer, and of the logits (~10), well under 1e-4 + 1e-4 x |logit|
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt", weights_only=True), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.seq_len=0", "Config key data.seq_len=0: expected a value greater than 0 (default 128)."),
        ("data.seq_len=long", "Config key data.seq_len='long': expected an integer (default 128)."),
        ("data.vocab_size=100", "Config key data.vocab_size=100: expected a value of at least 259"),
        ("model.num_kv_heads=1.5", "Config key model.num_kv_heads=1.5: expected an integer (default 2)."),
        ("model.activation_checkpointing=maybe", "Config key model.activation_checkpointing='maybe': expected true or"),
        (
            "preset=trn9-1t",
            "Config key preset='trn9-1t': expected one of none, trn1-1b, trn2-8b, trn2-8b-32k, trn2-70b.",
        ),
    ],
)
def test_a_bad_override_is_one_line_naming_key_value_and_expectation(override, expected):
    with pytest.raises(SystemExit) as stop:
        cli.main(llm.RECIPE, [override])
    message = str(stop.value)
    assert message.startswith("recipes.llm: ") and expected in message and "\n" not in message, message


def test_the_command_line_prints_that_one_line_and_nothing_else():
    run = subprocess.run(
        [sys.executable, "-m", "recipes.llm", "data.seq_len=0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )
    expected = "recipes.llm: Config key data.seq_len=0: expected a value greater than 0 (default 128)."
    assert (run.returncode, run.stdout, run.stderr.strip().splitlines()) == (1, "", [expected]), run.stderr


def test_presets_come_before_the_command_lines_overrides():
    cfg = cli.load_config(llm.RECIPE, ["trainer.devices=8", "preset=trn1-1b"])
    assert cfg.preset == "trn1-1b" and cfg.model.hidden_size == 2048 and cfg.trainer.strategy == "neuron_zero1"
    assert cfg.trainer.devices == 8  # the command line wins
    assert cli.load_config(llm.RECIPE, []).model.hidden_size == 128


def test_a_global_batch_is_kept_when_the_layout_changes():
    """`data.global_batch_size` (the presets') gives the batch per data-parallel rank: pipeline stages and tensor
    parallel leave fewer ranks, each with more sequences (which the stages split into microbatches)."""
    batch = {}
    for layout in (
        [],
        ["model.pipeline_parallel_size=4"],
        ["model.replicate_size=4"],
        ["model.tensor_parallel_size=8"],
    ):
        batch[" ".join(layout)] = cli.load_config(llm.RECIPE, ["preset=trn2-70b", *layout]).data.batch_size
    # 256 ranks; tensor parallel 4: 64 data-parallel ranks; with 4 stages, 16; HSDP's replicas read their own
    assert batch == {
        "": 1,
        "model.pipeline_parallel_size=4": 4,
        "model.replicate_size=4": 1,
        "model.tensor_parallel_size=8": 2,
    }
    assert cli.load_config(llm.RECIPE, ["preset=trn1-1b", "trainer.devices=8"]).data.batch_size == 128 // (8 * 4)
    assert cli.load_config(llm.RECIPE, ["data.batch_size=3"]).data.batch_size == 3  # no global batch: as given
    with pytest.raises(ValueError, match=re.escape("data.batch_size=2 and data.global_batch_size=64 are both set")):
        cli.load_config(llm.RECIPE, ["preset=trn2-70b", "data.batch_size=2"])
    with pytest.raises(ValueError, match=re.escape("does not divide into 64 data-parallel ranks")):
        cli.load_config(llm.RECIPE, ["preset=trn2-70b", "data.global_batch_size=96"])


def test_packed_blocks_have_one_shape_and_keep_every_token_but_the_tail():
    tokenizer = llm.train_tokenizer(DOCUMENTS, 300)
    documents = llm.encode_documents(tokenizer, DOCUMENTS)
    eos, seq_len = tokenizer.eos_token_id, 16
    blocks = llm.pack(documents, eos, seq_len)
    stream = [t for ids in documents for t in (*ids, eos)]
    assert blocks.shape == (len(stream) // seq_len, seq_len) and 0 < len(stream) % seq_len < seq_len
    assert blocks.flatten().tolist() == stream[: blocks.numel()]  # in order: nothing lost or doubled but the tail
    assert blocks.flatten().tolist().count(eos) == stream[: blocks.numel()].count(eos)

    data = llm.LMDataModule(tokenizer, {"train": blocks, "val": blocks[:21], "test": blocks[:5]}, batch_size=4, seed=0)
    train = list(data.train_dataloader())
    assert {tuple(b["input_ids"].shape) for b in train} == {(4, seq_len)} and len(train) == len(blocks) // 4
    assert all(torch.equal(b["input_ids"], b["labels"]) for b in train)
    for loader, real in ((data.val_dataloader(), blocks[:21]), (data.test_dataloader(), blocks[:5])):
        batches = list(loader)
        assert {tuple(b[k].shape) for b in batches for k in ("input_ids", "labels")} == {(4, seq_len)}
        labels = torch.cat([b["labels"] for b in batches])
        assert torch.equal(labels[: len(real)], real) and (labels[len(real) :] == llm.IGNORE_INDEX).all()


def test_documents_split_with_the_seed():
    train, val, test = llm.split_documents(DOCUMENTS, 0.1, 0.2, seed=3)
    assert (len(train), len(val), len(test)) == (210, 30, 60)
    assert sorted(train + val + test) == sorted(DOCUMENTS)
    assert llm.split_documents(DOCUMENTS, 0.1, 0.2, seed=3) == (train, val, test)
    assert llm.split_documents(DOCUMENTS, 0.1, 0.2, seed=4) != (train, val, test)


def test_the_tokenizer_is_deterministic_in_and_across_processes(tmp_path):
    from lightning_trn.recipes.data_sources import load_rotten_tomatoes

    texts = llm.split_documents(load_rotten_tomatoes()[0], 0.1, 0.1, seed=42)[0]
    first = llm.train_tokenizer(texts, 2048)
    again = llm.train_tokenizer(texts, 2048)
    assert first.backend_tokenizer.to_str() == again.backend_tokenizer.to_str()
    assert len(first) == 2048 and [first.bos_token_id, first.eos_token_id, first.pad_token_id] == [0, 1, 2]
    code = (
        "from lightning_trn.recipes import llm\n"
        "from lightning_trn.recipes.data_sources import load_rotten_tomatoes\n"
        "texts = llm.split_documents(load_rotten_tomatoes()[0], 0.1, 0.1, seed=42)[0]\n"
        "print(hash('a string'))\n"
        "print(llm.train_tokenizer(texts, 2048).backend_tokenizer.to_str())\n"
    )
    # another process has another string hash seed (the child, as every fork of the warm interpreter, has that
    # interpreter's random one); under a fixed PYTHONHASHSEED the child gets another fixed one (and starts cold)
    env = dict(os.environ)
    if env.get("PYTHONHASHSEED", "random") != "random":
        env["PYTHONHASHSEED"] = str(int(env["PYTHONHASHSEED"]) + 1)
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
        env=env,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    child_hash, child_tokenizer = child.stdout.strip().split("\n", 1)
    assert int(child_hash) != hash("a string")  # its sets of strings iterate in another order
    assert child_tokenizer == first.backend_tokenizer.to_str()
    encoded = first("An unexpectedly moving film.", add_special_tokens=False)["input_ids"]
    assert first.decode(encoded) == "An unexpectedly moving film."  # byte-level: the text comes back exactly


def test_unigram_perplexity_of_uniform_tokens_is_the_vocabulary_size():
    blocks = torch.arange(8).repeat(10).view(10, 8)  # every token of 8 equally often
    assert llm.unigram_perplexity(blocks, blocks, vocab_size=8) == pytest.approx(8.0)  # exp(-log 1/8) in float64
    skewed = torch.zeros(10, 8, dtype=torch.long)
    assert llm.unigram_perplexity(skewed, skewed, vocab_size=8) < 1.2


def _tiny(attn_implementation: str) -> llm.CausalLM:
    torch.manual_seed(0)
    return llm.CausalLM(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seq_len=12,
        attn_implementation=attn_implementation,
    ).eval()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_the_device_built_causal_mask_gives_transformers_causal_logits(attn_implementation):
    module = _tiny(attn_implementation)
    input_ids = torch.randint(0, 300, (3, 12))
    with torch.no_grad():
        expected = module.net(input_ids=input_ids).logits  # transformers' own causal mask
        torch.testing.assert_close(module(input_ids), expected)
    attention = module.net.model.layers[0].self_attn
    assert attention.k_proj.out_features == 2 * attention.head_dim < attention.q_proj.out_features  # GQA


def test_the_forward_does_not_read_the_device():
    """Without a mask transformers asks `.all()` on the host whether the blocks are packed; the recipe's 4-D mask is
    never read, so the step stays one graph."""
    import torch_xla

    from lightning_trn.runtime import get_runtime

    device = torch_xla.device()
    module = _tiny("sdpa").to(device)
    input_ids = torch.randint(0, 300, (3, 12)).to(device)
    torch_xla.sync()

    def reads(forward) -> int:
        before = get_runtime().metrics()
        forward().sum()
        delta = get_runtime().metrics() - before
        torch_xla.sync()
        return delta.device_to_host + delta.scalar_reads

    assert reads(lambda: module.net(input_ids=input_ids, use_cache=False).logits) > 0  # no mask: transformers reads
    assert reads(lambda: module(input_ids)) == 0
    assert reads(lambda: module.loss_sum({"input_ids": input_ids, "labels": input_ids})[0]) == 0


def test_sdpa_attention_runs_under_the_plugins_bf16_autocast():
    """The rotary embedding leaves query and key in fp32 beside a bf16 value; under the plugin's `bf16-mixed`
    autocast SDPA casts them to one dtype, as CUDA's autocast does (`tests/strategies/test_precision.py`), so Hugging
    Face's own
    SDPA attention trains with `trainer.precision=bf16-mixed` on XLA."""
    import torch_xla

    from lightning_trn.runtime import get_runtime

    device = torch_xla.device()
    module = _tiny("sdpa").to(device)
    input_ids = torch.randint(0, 300, (3, 12)).to(device)
    batch = {"input_ids": input_ids, "labels": input_ids}
    with torch.no_grad():
        full, count = module.loss_sum(batch)
        with get_runtime().autocast(torch.bfloat16):
            mixed, _ = module.loss_sum(batch)
    # cross entropy moves by at most 2 x max |logit error|: bf16 matmuls (eps 7.8e-3) err by a few eps of the logits'
    # scale (< 1 at this init), well under 2e-2 x the loss (~log 300 = 5.7)
    torch.testing.assert_close((mixed / count).cpu(), (full / count).cpu(), rtol=2e-2, atol=0)
