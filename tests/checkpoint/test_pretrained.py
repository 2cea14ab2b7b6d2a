"""`lightning_trn.load_pretrained`: a Hugging Face `save_pretrained` folder read into a model built on the meta device
(or on the host), on one device of the running backend (XLA:CPU here; tests/checkpoint/test_pretrained_sharded.py runs
the same check on the stand-in `neuron` device and the sharded ones), and its refusals.

The model is a tiny Llama whose sizes shard unevenly (hidden 36, 6 heads over 2 key/value heads, vocabulary 101),
with tied embeddings (no `lm_head.weight` in the files) and saved in several safetensors files; its logits on the
CPU are the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from lightning_trn import load_pretrained, meta_model_from_pretrained
from lightning_trn.core.parallel.model_parallel import materialize
from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.xla_only

TINY = {
    "vocab_size": 101,
    "hidden_size": 36,
    "intermediate_size": 70,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


class Folder(NamedTuple):
    path: Path
    ids: torch.Tensor
    logits: torch.Tensor  # the saved model's, on the CPU


def save_llama(path: Path, max_shard_size: str = "20KB", **sizes: Any) -> Folder:
    """A random Llama saved with `save_pretrained` (several files when `max_shard_size` is below its size), token ids
    and its CPU logits for them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(attn_implementation="eager", **{**TINY, **sizes})).eval()
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    ids = torch.arange(14).reshape(2, 7) * 7 % model.config.vocab_size
    with torch.no_grad():
        return Folder(path, ids, model(ids).logits)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_llama(tmp_path_factory.mktemp("tiny"))


def check_single_device(folder: Folder, device: torch.device) -> None:
    """Built on meta, loaded onto `device`: the saved model's logits, embeddings tied, the rotary buffer computed;
    the strategies' `materialize` afterwards draws nothing over the loaded values."""
    model = meta_model_from_pretrained(folder.path, attn_implementation="eager")
    assert load_pretrained(model, folder.path, device=device) is model
    materialize(model, device)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == device.type
    with torch.no_grad():
        logits = model.eval()(folder.ids.to(device)).logits.cpu()
    # one float32 forward on another backend: a few ulps (eps 1.2e-7) of the RMS-normed activations (~1) per layer,
    # ~1e-6 at the logits (~0.1: unit states times std-0.02 weights), under 1e-5
    torch.testing.assert_close(logits, folder.logits, atol=1e-5, rtol=0)


def test_single_device_logits_equal_the_saved_models(tiny: Folder) -> None:
    check_single_device(tiny, get_runtime().device())


class Wrapper(nn.Module):
    """The Hugging Face model held under a prefix, as a LightningModule's `self.model`."""

    def __init__(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        super().__init__()
        self.model = LlamaForCausalLM(LlamaConfig(attn_implementation="eager", **TINY))


def test_host_built_module_under_a_prefix_from_one_file(tmp_path: Path) -> None:
    """One `model.safetensors`, a host-built wrapper: the prefix `model.` is found, or given; the values (fp32 file)
    are cast to a bf16 module's dtype."""
    folder = save_llama(tmp_path, max_shard_size="1GB")
    assert (tmp_path / "model.safetensors").is_file()
    for prefix in (None, "model."):
        wrapper = Wrapper()
        load_pretrained(wrapper, tmp_path, prefix=prefix)
        with torch.no_grad():  # the reference's weights through the same CPU forward: the device bound above, or exact
            torch.testing.assert_close(wrapper.model.eval()(folder.ids).logits, folder.logits, atol=1e-5, rtol=0)
    wrapper = Wrapper().to(torch.bfloat16)
    load_pretrained(wrapper, tmp_path)
    assert wrapper.model.lm_head.weight.dtype == torch.bfloat16
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")["model.norm.weight"]
    assert torch.equal(wrapper.model.model.norm.weight, saved.to(torch.bfloat16))


def test_a_bf16_folder_builds_fp32_master_weights(tmp_path: Path) -> None:
    """Published folders say `dtype: bfloat16`: the model is built in torch's default dtype all the same (training
    keeps fp32 masters) and filled with the bf16 values upcast; `dtype=` builds another."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16).save_pretrained(tmp_path)
    model = meta_model_from_pretrained(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    load_pretrained(model, tmp_path, device=torch.device("cpu"))
    saved = load_file(tmp_path / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert saved.dtype == torch.bfloat16
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, saved.float())
    assert {p.dtype for p in meta_model_from_pretrained(tmp_path, dtype=torch.bfloat16).parameters()} == {
        torch.bfloat16
    }


def test_refusals_name_what_does_not_fit(tiny: Folder, tmp_path: Path) -> None:
    from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

    def refusal(**sizes: Any) -> str:
        with pytest.raises(ValueError) as error:
            load_pretrained(LlamaForCausalLM(LlamaConfig(**{**TINY, **sizes})), tiny.path)
        return str(error.value)

    assert "missing from the files (9): model.layers.2." in refusal(num_hidden_layers=3)
    assert "in the files but not in the module (9): model.layers.1." in refusal(num_hidden_layers=1)
    assert "model.embed_tokens.weight [101, 36] vs [102, 36]" in refusal(vocab_size=102)
    with pytest.raises(ValueError, match="pass `device=`"):
        load_pretrained(meta_model_from_pretrained(tiny.path), tiny.path)
    GPT2Config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2' model.*llama, mistral, qwen2, qwen3"):
        meta_model_from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(Wrapper(), tmp_path)
