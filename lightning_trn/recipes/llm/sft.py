"""Supervised fine-tuning data for the LLM recipe (`model.pretrained=DIR data.source=FILE.jsonl`): rows of
`{"prompt", "response"}` or `{"messages": [...]}` (rendered with the folder tokenizer's chat template), tokenized with
the pretrained tokenizer, the loss masked to the response (assistant) tokens.

Static shapes without packing: one row per block of `seq_len` tokens, right-padded (and cut at `seq_len`). Under a
causal mask a padding token sits after every real one, so it changes no real token's logits: the recipe's causal
mask, built on the device, serves as it is, and the positions are the default `0..seq_len-1` of each row.

Packing (`data.packing=true`, `packed_blocks`): rows are laid one after another into blocks of `seq_len` (a row that
does not fit starts the next block), with position ids restarting at each row, from which the recipe's mask keeps the
rows apart (`document_mask`): each row's token losses are those it has alone, no compute is spent on padding but a
block's tail, and every batch has one shape.

Length buckets (`data.length_buckets`): a few fixed lengths instead of one, so short rows are not all padded to
`seq_len` while a compiled model (`model.compile`) still sees a few shapes only, each compiled once (`bucket_batches`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_trn.recipes.llm.data import IGNORE_INDEX, padded_rows
from lightning_trn.recipes.tensor_datamodule import evaluation_multiple, shuffled_split


def load_rows(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON Lines file, one per non-empty line, each with `prompt` and `response` strings or a
    `messages` list.

    Raises:
        ValueError: the file is missing, or a row has neither form.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"data.source={path!r}: no such file (expected JSON Lines of prompt/response or messages).")
    rows = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    for number, row in enumerate(rows, 1):
        if not (isinstance(row.get("messages"), list) or {"prompt", "response"} <= set(row)):
            raise ValueError(
                f'{path}:{number}: expected {{"prompt", "response"}} or {{"messages": [...]}}, got keys {sorted(row)}.'
            )
    return rows


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_row(tokenizer: Any, row: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """Token ids of a row and their labels: the ids themselves on response tokens, `IGNORE_INDEX` elsewhere.

    `prompt`/`response`: the prompt as the tokenizer encodes text (its BOS, if it adds one), then the response and
    EOS, which is labelled too so the model learns to stop. `messages`: the chat template's text, tokenized as
    `apply_chat_template` does; each assistant message's span is the text its turn adds to the rendering of the
    conversation before it with the generation prompt (the assistant header stays unlabelled), and the tokens
    overlapping a span are labelled. Characters, not tokens, are compared: a turn's tokens can merge across its
    boundary (a header's trailing space with the reply's first word), its text cannot.

    Raises:
        ValueError: the chat template renders a conversation's start differently once more turns follow.
    """
    if "messages" not in row:
        prompt = tokenizer(row["prompt"])["input_ids"]
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt + response, [IGNORE_INDEX] * len(prompt) + response
    messages = row["messages"]
    text = _render(tokenizer, messages)
    spans = []
    for turn, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:turn], add_generation_prompt=True) if turn else ""
        through = _render(tokenizer, messages[: turn + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                "The tokenizer's chat template renders the start of a conversation differently once "
                "more turns follow, so the assistant turns cannot be found: use prompt/response rows."
            )
        spans.append((len(before), len(through)))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoding["input_ids"]
    labels = [
        token if any(start < span_end and end > span_start for span_start, span_end in spans) else IGNORE_INDEX
        for token, (start, end) in zip(ids, encoding["offset_mapping"], strict=True)
    ]
    return ids, labels


def bucket_batches(
    split: dict[str, torch.Tensor],
    buckets: Sequence[int],
    batch_size: int,
    pad_id: int,
    generator: torch.Generator | None = None,
) -> list[dict[str, torch.Tensor]]:
    """The rows of a split of blocks (`blocks`) in batches of one length each: a row goes to the first of `buckets`
    (increasing, the last at least the blocks' length) that holds it up to its last labelled token, and is cut to that
    length (the tokens after the last label change no loss: they predict nothing that is labelled). With `generator`
    (training), each bucket's rows are shuffled with it and its last partial batch dropped; without (evaluation),
    rows stay in order and each bucket's last batch is padded with unlabelled rows."""
    labels = split["labels"]
    labelled = (labels != IGNORE_INDEX) * torch.arange(1, labels.shape[1] + 1)
    which = torch.bucketize(labelled.amax(dim=1), torch.tensor(list(buckets)))
    batches = []
    for index, length in enumerate(buckets):
        rows = (which == index).nonzero().flatten()
        if generator is not None:
            rows = rows[torch.randperm(len(rows), generator=generator)]
            rows = rows[: len(rows) - len(rows) % batch_size]
        batches += [
            padded_rows(
                {key: value[rows[start : start + batch_size], :length] for key, value in split.items()},
                batch_size,
                pad_id,
            )
            for start in range(0, len(rows), batch_size)
        ]
    return batches


def _cut_rows(encoded: Sequence[tuple[list[int], list[int]]], seq_len: int) -> Iterator[tuple[list[int], list[int]]]:
    """Each row's ids and labels cut at `seq_len`; rows left with no labelled token after the first (nothing to
    predict once the labels are shifted) are dropped."""
    for ids, row_labels in encoded:
        if any(label != IGNORE_INDEX for label in row_labels[1:seq_len]):
            yield ids[:seq_len], row_labels[:seq_len]


def blocks(encoded: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One (rows, seq_len) block per row: cut at `seq_len`, right-padded with `pad_id` (labels `IGNORE_INDEX`). Rows
    left with no labelled token after the first (nothing to predict once the labels are shifted) are dropped."""
    input_ids, labels = [], []
    for ids, row_labels in _cut_rows(encoded, seq_len):
        pad = seq_len - len(ids)
        input_ids.append(ids + [pad_id] * pad)
        labels.append(row_labels + [IGNORE_INDEX] * pad)
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long).view(-1, seq_len),
        "labels": torch.tensor(labels, dtype=torch.long).view(-1, seq_len),
    }


def packed_blocks(encoded: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The rows (`_cut_rows`) laid one after another into (blocks, seq_len) rows in their order, a row that does not
    fit the current block starting the next; the tail padded. `position_ids` restart at 0 at each row (and the
    padding), and a row's first token is not labelled: it is never predicted when the row is alone either."""
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    current: list[list[int]] = [[], [], []]
    for ids, row_labels in _cut_rows(encoded, seq_len):
        if len(current[0]) + len(ids) > seq_len:
            _close_block(current, seq_len, pad_id, (input_ids, labels, positions))
        current[0] += ids
        current[1] += [IGNORE_INDEX, *row_labels[1:]]
        current[2] += range(len(ids))
    if current[0]:
        _close_block(current, seq_len, pad_id, (input_ids, labels, positions))
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long).view(-1, seq_len),
        "labels": torch.tensor(labels, dtype=torch.long).view(-1, seq_len),
        "position_ids": torch.tensor(positions, dtype=torch.long).view(-1, seq_len),
    }


def _close_block(current: list[list[int]], seq_len: int, pad_id: int, out: tuple[list, list, list]) -> None:
    """Pad the block being filled to `seq_len` (unlabelled, positions from 0: a document of its own), move it to
    `out` and start the next."""
    pad = seq_len - len(current[0])
    for column, values, filler in zip(
        out, current, ([pad_id] * pad, [IGNORE_INDEX] * pad, list(range(pad))), strict=True
    ):
        column.extend(values + filler)
    for values in current:
        values.clear()


class _Rows(Dataset):
    def __init__(self, split: dict[str, torch.Tensor]) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.split.items()}


class SFTDataModule(pl.LightningDataModule):
    """Splits of padded (rows, seq_len) blocks; batches are dicts of `input_ids` and `labels` (unshifted: the
    model shifts them). Training batches are shuffled with `seed`, the last partial one dropped; the evaluation
    splits are padded to whole batches on every rank (`evaluation_multiple`) with rows labelled `IGNORE_INDEX`, so
    every batch has one shape and no row counts twice.

    With `length_buckets` (lengths below seq_len), each batch has the shape of one bucket (`bucket_batches`): the
    training rows are grouped into batches once, with `seed`, and the order of those batches shuffled each epoch."""

    def __init__(
        self,
        tokenizer: Any,
        splits: dict[str, dict[str, torch.Tensor]],
        batch_size: int,
        seed: int,
        length_buckets: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.splits = splits
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id(tokenizer)
        seq_len = splits["train"]["input_ids"].shape[1]
        if any(length >= seq_len for length in length_buckets):
            raise ValueError(
                f"data.length_buckets={list(length_buckets)}: each bucket must be shorter than data.seq_len={seq_len}, "
                "which is always the last bucket."
            )
        #: the lengths batches are cut to, seq_len last; empty: every batch (rows, seq_len)
        self.buckets = sorted({*length_buckets, seq_len}) if length_buckets else []
        for name, split in splits.items():
            rows = len(split["input_ids"])
            if rows == 0 or (name == "train" and rows < batch_size):
                raise ValueError(
                    f"The {name} split has {rows} rows with response tokens, fewer than one batch of "
                    f"{batch_size}: add rows, raise data.seq_len or lower data.batch_size."
                )

    @override
    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        if self.buckets:  # whole batches as the items: each keeps its one shape through any sampler
            batches = bucket_batches(self.splits["train"], self.buckets, self.batch_size, self.pad_id, generator)
            if not batches:
                raise ValueError(
                    f"data.length_buckets={self.buckets[:-1]}: no bucket holds a whole batch of {self.batch_size} "
                    "training rows: use fewer buckets or lower data.batch_size."
                )
            return DataLoader(batches, batch_size=None, shuffle=True, generator=generator)  # type: ignore[arg-type]  # a list of batches is a map-style dataset
        return DataLoader(
            _Rows(self.splits["train"]), batch_size=self.batch_size, shuffle=True, generator=generator, drop_last=True
        )

    def _eval_loader(self, name: str) -> DataLoader:
        split = self.splits[name]
        if self.buckets:  # whole batches, with unlabelled ones up to a multiple of the ranks (`evaluation_multiple`)
            batches = bucket_batches(split, self.buckets, self.batch_size, self.pad_id)
            empty = {key: value[:0] for key, value in batches[0].items()}
            batches += [padded_rows(empty, self.batch_size, self.pad_id)] * (
                -len(batches) % evaluation_multiple(self, 1)
            )
            return DataLoader(batches, batch_size=None)  # type: ignore[arg-type]  # a list is a map-style dataset
        rows = len(split["input_ids"])
        padded = padded_rows(split, rows - rows % -evaluation_multiple(self, self.batch_size), self.pad_id)
        return DataLoader(_Rows(padded), batch_size=self.batch_size)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    @override
    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's padding id, else its EOS (Llama 3 has no padding token): padding is never attended to by a
    real token nor labelled, so any id serves."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def sft_datamodule(
    tokenizer: Any,
    source: str,
    seq_len: int,
    batch_size: int,
    val_fraction: float,
    test_fraction: float,
    seed: int,
    length_buckets: Sequence[int] = (),
    packing: bool = False,
) -> SFTDataModule:
    """The rows of `source` split with `seed` (train, val, test), each encoded (`encode_row`) into blocks, one row
    each or, with `packing`, several (`packed_blocks`); batched by `length_buckets` if any (`SFTDataModule`)."""
    if packing and length_buckets:
        raise ValueError(
            f"data.packing=true with data.length_buckets={list(length_buckets)}: packing fills every block to "
            "data.seq_len (one shape), which is what buckets approximate; use one of the two."
        )
    layout = packed_blocks if packing else blocks
    rows = load_rows(source)
    parts = shuffled_split({"i": torch.arange(len(rows))}, (val_fraction, test_fraction), seed)
    splits = {
        name: layout([encode_row(tokenizer, rows[i]) for i in part["i"].tolist()], seq_len, pad_id(tokenizer))
        for name, part in zip(("train", "val", "test"), parts, strict=True)
    }
    return SFTDataModule(tokenizer, splits, batch_size, seed, length_buckets)
