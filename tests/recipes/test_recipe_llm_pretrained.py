"""The LLM recipe fine-tuning a Hugging Face `save_pretrained` folder (`model.pretrained=DIR`) on supervised rows
(`data.source=FILE.jsonl`), on one device of the running backend: the loss covers the response tokens only, one
step equals the same step written with plain transformers + torch on the CPU, a fine-tuned model exports to a folder
that transformers generates from and the recipe loads again, and model types of another layout are refused.

The folder holds a tiny random Llama (uneven sizes, tied embeddings) and a byte-level BPE tokenizer trained on a few
strings, with a chat template: nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from lightning_trn.recipes import cli, common, llm
from lightning_trn.recipes.llm import sft

pytestmark = pytest.mark.both

CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
)
ROWS = [
    {"prompt": f"Question {i}: how many films?", "response": f"Film number {i * 37} is good."}
    if i % 2
    else {
        "messages": [
            {"role": "user", "content": f"Review {i}?"},
            {"role": "assistant", "content": f"Bad {i}."},
            {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": f"Good film {i * 3}."},
        ]
    }
    for i in range(40)
]
#: one device, 32-token blocks, no warm-up (the first step takes the full learning rate), no evaluation
STEP = (
    "data.seq_len=32",
    "data.batch_size=4",
    "model.warmup_steps=0",
    "model.lr=1.0e-3",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.log_every_n_steps=1",
)


class Folder(NamedTuple):
    path: Path
    rows: Path


def save_folder(root: Path) -> Folder:
    """A tiny random Llama and its tokenizer saved with `save_pretrained` in `root/model`, and a JSON Lines file of
    `ROWS` (also used by tests/recipes/test_recipe_llm_pretrained_sharded.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = [json.dumps(row) for row in ROWS] + ["user assistant question review film good bad"]
    tokenizer = llm.train_tokenizer(texts, vocab_size=300)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=36,
        intermediate_size=70,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rows = root / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n")
    return Folder(root / "model", rows)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("pretrained"))


def _overrides(folder: Folder, out_dir: Path, *more: str) -> list[str]:
    return [f"model.pretrained={folder.path}", f"data.source={folder.rows}", f"out_dir={out_dir}", *STEP, *more]


def test_only_the_response_tokens_are_labelled(folder: Folder) -> None:
    tokenizer = llm.pretrained_tokenizer(str(folder.path))
    ids, labels = sft.encode_row(tokenizer, ROWS[1])
    response = tokenizer(ROWS[1]["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert labels == [sft.IGNORE_INDEX] * (len(ids) - len(response)) + response
    ids, labels = sft.encode_row(tokenizer, ROWS[0])
    assert ids == tokenizer.apply_chat_template(ROWS[0]["messages"], tokenize=True, return_dict=False)
    kept = [token for token in labels if token != sft.IGNORE_INDEX]
    assert tokenizer.decode(kept).replace(" ", "") == "Bad0.<|eos|>Goodfilm0.<|eos|>"


def test_one_fine_tuning_step_equals_plain_transformers_and_torch(folder: Folder, tmp_path: Path) -> None:
    """The recipe's step (its data, module, AdamW groups and gradient clipping, on this backend's device) and the
    same step by hand on the CPU: Hugging Face's own shifted, masked loss from `from_pretrained`'s model."""
    from transformers import AutoModelForCausalLM

    cfg = cli.load_config(
        llm.RECIPE, _overrides(folder, tmp_path / "run", "trainer.max_steps=1", "trainer.limit_val_batches=0")
    )
    data = llm.RECIPE.build_data(cfg)
    module = llm.RECIPE.build_model(cfg)
    trainer = common.build_trainer(cfg, llm.RECIPE)
    trainer.fit(module, datamodule=data)
    batch = next(iter(data.train_dataloader()))
    assert (batch["labels"] == sft.IGNORE_INDEX).any() and (batch["labels"] != sft.IGNORE_INDEX).any()

    reference = AutoModelForCausalLM.from_pretrained(folder.path, dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in reference.named_parameters()}
    matrices = [p for p in reference.parameters() if p.ndim >= 2]
    vectors = [p for p in reference.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": cfg.model.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=cfg.model.lr,
        betas=(0.9, 0.95),
    )
    loss = reference(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    # AdamW's first step is blind to the loss's scale: the logged loss checks the normalization (response tokens).
    # One float32 forward each, two implementations: a few ulps of the loss (~log 300 = 5.7), far under 1e-5 of it
    torch.testing.assert_close(trainer.callback_metrics["train_loss"].cpu(), loss.detach(), rtol=1e-5, atol=1e-6)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.trainer.gradient_clip_val)
    optimizer.step()

    trained = {name: p.detach().cpu() for name, p in module.net.named_parameters()}
    assert trained.keys() == before.keys()
    assert module.net.lm_head.weight is module.net.model.embed_tokens.weight
    for name, p in reference.named_parameters():
        assert not torch.equal(p, before[name]), name  # every tensor moved: equality below is not the start's
        # AdamW's first step moves w by lr x g / (|g| + 1e-8), which a relative error d in g changes by <= lr x d / 4:
        # 1e-6 would take d = 4e-3, where two float32 backward passes differ by a few ulps (d ~ 1e-6)
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_fine_tune_export_generate_and_load_the_export(folder: Folder, tmp_path: Path) -> None:
    """`model.pretrained=A` fine-tuned a few steps by the recipe command, exported to B (weights = the checkpoint's,
    not A's; A's tokenizer), B generates in plain transformers, and `model.pretrained=B` reads B's weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, results = cli.main(
        llm.RECIPE,
        _overrides(
            folder,
            tmp_path / "run",
            "trainer.max_steps=3",
            "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1",
        ),
    )
    out = tmp_path / "export"
    cli.main(llm.RECIPE, ["export", f"ckpt={results['checkpoint']}", f"out={out}"])

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    state = torch.load(results["checkpoint"], weights_only=True)["state_dict"]
    original = load_file(folder.path / "model.safetensors")
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, state[f"net.{name}"].cpu(), rtol=0, atol=0)
    assert not torch.equal(exported.model.embed_tokens.weight, original["model.embed_tokens.weight"])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Review 3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    generated = exported.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 4)

    cfg = cli.load_config(
        llm.RECIPE,
        [
            f"model.pretrained={out}",
            f"data.source={folder.rows}",
            f"out_dir={tmp_path / 'again'}",
            *STEP,
            "trainer.limit_val_batches=1",
        ],
    )
    module = llm.RECIPE.build_model(cfg)
    common.build_trainer(cfg, llm.RECIPE).validate(module, datamodule=llm.RECIPE.build_data(cfg), verbose=False)
    for name, value in module.net.state_dict().items():
        torch.testing.assert_close(value.cpu(), exported.state_dict()[name], rtol=0, atol=0, msg=name)


def test_a_model_type_of_another_layout_is_refused(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(tmp_path)
    cfg = cli.load_config(llm.RECIPE, [f"model.pretrained={tmp_path}"])
    with pytest.raises(ValueError, match="'gpt2' model.*model_type llama, mistral, qwen2, qwen3"):
        llm.RECIPE.build_model(cfg)
