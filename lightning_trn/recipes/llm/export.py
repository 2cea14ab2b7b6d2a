"""The LLM recipe's export: a Hugging Face folder that GPU and CPU users load without lightning_trn."""

from __future__ import annotations

from pathlib import Path

from lightning_trn.recipes.llm.lora import merge_adapters
from lightning_trn.recipes.llm.model import CausalLM


def export(module: CausalLM, out_dir: Path) -> None:
    """A Hugging Face folder: `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer` (no lightning_trn
    needed), ready for `generate`; LoRA adapters merged into the weights they adapt."""
    merge_adapters(module.net).save_pretrained(out_dir)
    module.tokenizer().save_pretrained(out_dir)
