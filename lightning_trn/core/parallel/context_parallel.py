"""Context parallelism: each sequence of a batch split over the mesh's `context_parallel` ranks, attention across
the split, and the loss reduced over it (TorchTitan's context-parallel dimension, docs/sharding.md).

What runs, and why this variant: torch's `context_parallel()` runs ring attention by replacing SDPA's kernels with
DTensor sharding rules, and on the CPU stand-in SDPA dispatches to a CPU flash kernel that has no such rule (nor does
torch's ring accept a document mask except through FlexAttention, which needs Inductor). So each rank's keys and
values are all-gathered over the context ranks (`all_gather_single_autograd`, whose backward is a reduce-scatter:
two collectives TorchNeuron documents, no send/recv) and its queries attend to all of them with SDPA under one boolean
mask: causal by position in the block, and documents of a packed block kept apart. That is Llama 3's
"all-gather context parallelism", chosen there for document masks too. Cost: each rank holds the whole sequence's
keys and values of one layer at a time, and the mask (local x whole sequence booleans).

Sequences are split with TorchTitan's head-tail load balancing (rank r holds chunks r and 2n-1-r of 2n), so every
rank's causal work is the same. The split happens in one place, `ContextParallel.step`, which the Trainer strategy
enters around each `training_step` / `validation_step` / `test_step` with the batch Lightning hands it, and Fabric
users enter around their forward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

#: the mesh dimension, between data parallel and tensor parallel (TorchTitan's order)
CONTEXT = "context_parallel"
#: the loss's ignored label (torch's and Hugging Face's)
IGNORE_INDEX = -100

_ACTIVE: contextvars.ContextVar[SequenceLayout | None] = contextvars.ContextVar("sequence_layout", default=None)


def head_tail_index(seq_len: int, size: int, rank: int, device: torch.device | None = None) -> Tensor:
    """The positions (in the whole sequence) of rank `rank`'s tokens: chunks `rank` and `2 size - 1 - rank` of the
    sequence cut into 2 x `size` chunks, so that under a causal mask every rank attends to as many keys."""
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])


def document_ids(position_ids: Tensor) -> Tensor:
    """Each token's document in a packed block: a new one starts where the position ids restart at 0 (Hugging
    Face's convention for packed rows, `DataCollatorWithFlattening`)."""
    return (position_ids == 0).cumsum(-1)


def document_mask(documents: Tensor, query: Tensor, key: Tensor, causal: bool = True) -> Tensor:
    """SDPA's boolean mask (True: attend), (batch, 1, queries, keys): a query attends to the keys of its own document,
    at or before its position in the block when `causal`. `query` and `key` are positions in the block; `documents`
    (batch, block) the documents of every position."""
    same = documents[:, query, None] == documents[:, None, key]
    if causal:
        same = same & (key[None, None, :] <= query[None, :, None])
    return same[:, None]


def shift_labels(labels: Tensor) -> Tensor:
    """Next-token targets on the whole sequence: `labels` moved left by one, the last position ignored (Hugging
    Face's `shift_labels`); a split sequence cannot shift its own part."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


@dataclass
class SequenceLayout:
    """Where a rank's tokens sit in the whole sequence, for the attention of one step: `local` (this rank's
    positions), `gathered` (the keys' positions in the order the all-gather lays them out), `documents` (batch,
    block). `group`: the context-parallel process group."""

    group: Any
    size: int
    local: Tensor
    gathered: Tensor
    documents: Tensor
    #: SDPA calls the layout served in this step (a module whose attention is not SDPA is refused)
    attention_calls: int = 0
    _masks: dict[bool, Tensor] = field(default_factory=dict)

    def mask(self, causal: bool) -> Tensor:
        """The (batch, 1, local, whole sequence) mask, built once per step and kind."""
        if causal not in self._masks:
            self._masks[causal] = document_mask(self.documents, self.local, self.gathered, causal)
        return self._masks[causal]

    def gather(self, tensor: Tensor) -> Tensor:
        """The whole sequence's keys or values (dim 2, in `gathered` order) from every rank's part; its backward
        reduce-scatters the gradients back."""
        from torch.distributed import _functional_collectives as funcol

        # torch 2.13's name (the native stack's); the XLA stack's torch 2.9, which type-checks this, lacks it
        gather = funcol.all_gather_single_autograd  # type: ignore[attr-defined,unused-ignore]  # see above
        return gather(tensor.contiguous(), gather_dim=2, group=self.group)


#: torch's own SDPA, which `_SplitAttention` stands in for while a split step runs
_SDPA = F.scaled_dot_product_attention


class _SplitAttention:
    """`torch.nn.functional.scaled_dot_product_attention` served from a split sequence (`SequenceLayout`) while
    entered: keys and values gathered, the module's own mask or causal flag replaced by the block's causal document
    mask. It replaces the function in `torch.nn.functional` (as torch's own `context_parallel` does by default)
    rather than entering a TorchFunctionMode, which is thread-local: the recomputation of checkpointed layers runs
    on the autograd engine's device thread, where a mode entered by the step is not active."""

    def __init__(self, layout: SequenceLayout) -> None:
        self.layout = layout

    def __enter__(self) -> None:
        F.scaled_dot_product_attention = self  # a callable of the same signature

    def __exit__(self, *exc: object) -> None:
        F.scaled_dot_product_attention = _SDPA

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        layout = self.layout
        if query.shape[-2] != layout.local.numel() or key.shape[-2] != layout.local.numel():
            raise ValueError(
                f"Context parallel: an attention's queries have {query.shape[-2]} positions and its keys "
                f"{key.shape[-2]}, where this rank holds {layout.local.numel()} of each sequence. Under context "
                "parallelism a module's attention must be self-attention over the batch's sequence (dim 1 of its "
                "tensors), through `F.scaled_dot_product_attention`."
            )
        layout.attention_calls += 1
        mask = layout.mask(causal=is_causal or attn_mask is not None)  # a module's own mask is its causal mask
        keys, values = layout.gather(key), layout.gather(value)
        return _SDPA(query, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)


def current() -> SequenceLayout | None:
    """The layout of the step running now under context parallelism, else None."""
    return _ACTIVE.get()


def token_mean(total: Tensor, count: Tensor) -> Tensor:
    """The mean loss per token of the whole sequences, from this rank's summed token losses and token count.

    Without context parallelism, `total / count`. Under it each rank holds part of every sequence: the value
    returned is the whole sequences' mean on every context rank (one all-reduce of two numbers), and its gradient is
    this rank's part, scaled so that FSDP2's mean over the data x context ranks makes the one-device gradient."""
    layout = current()
    if layout is None:
        return total / count
    whole, tokens = _whole_sequences(layout, total, count)
    own = total * layout.size / tokens
    return own + (whole / tokens - own).detach()


def sequence_sums(total: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """The whole sequences' summed token losses and token count from this rank's (evaluation: no gradient), the
    same on every context rank; unchanged without context parallelism."""
    layout = current()
    if layout is None:
        return total, count
    whole, tokens = _whole_sequences(layout, total, count)
    return whole, tokens.to(count.dtype)


def _whole_sequences(layout: SequenceLayout, total: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """The summed token losses and token count (in `total`'s dtype) over the context ranks, without gradient: one
    all-reduce of the two numbers."""
    import torch.distributed as dist

    sums = torch.stack([total.detach(), count.detach().to(total.dtype)])
    dist.all_reduce(sums, group=layout.group)
    return sums[0], sums[1]


class ContextParallel:
    """The context-parallel part of a step, held by the model-parallel strategies: the batch's split and the
    attention over it (`step`). `mesh`: the 1-D mesh of this rank's context-parallel group, or None (size 1)."""

    def __init__(self, mesh: Any = None) -> None:
        self.mesh = mesh
        self.size = 1 if mesh is None else mesh.size()
        self.rank = 0 if mesh is None else mesh.get_local_rank()
        #: the last training step's layout, for the recomputation of checkpointed layers in its backward
        self._layout: SequenceLayout | None = None

    @classmethod
    def of(cls, mesh: Any) -> ContextParallel:
        """The context-parallel group of the device `mesh` (none where it has no "context_parallel" dimension)."""
        return cls(mesh[CONTEXT] if CONTEXT in (mesh.mesh_dim_names or ()) else None)

    def split(self, batch: Any) -> tuple[dict[str, Any], SequenceLayout]:
        """This rank's part of `batch` and its layout. A dict batch (Hugging Face's: `input_ids`, `labels`, ...);
        every tensor with the sequence's length in dim 1 is split along it; before the split, `position_ids` are
        added where missing (the rank's tokens are no longer contiguous), and `shift_labels` from `labels` (the
        next-token targets must be taken on the whole sequence). Other entries pass unchanged."""
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"Context parallel over {self.size} ranks splits the sequences of a dict batch (Hugging Face's "
                f"`input_ids`, `labels`, `position_ids`, ...), and this batch is a {type(batch).__name__}. Return "
                "a dict from the dataset or collate function: the tensors of shape (batch, sequence, ...) are split "
                "along the sequence, `position_ids` and `shift_labels` added (docs/sharding.md, 'Context parallel')."
            )
        sequences = [value for value in batch.values() if isinstance(value, Tensor) and value.ndim >= 2]
        if not sequences:
            raise ValueError(f"Context parallel: the batch has no (batch, sequence) tensor to split: {list(batch)}.")
        reference = batch.get("input_ids", sequences[0])
        rows, length = reference.shape[:2]
        if length % (2 * self.size):
            raise ValueError(
                f"Context parallel over {self.size} ranks cuts each sequence into {2 * self.size} equal chunks "
                f"(head-tail load balancing for causal masks), and the batch's sequences have {length} tokens. Use "
                f"a sequence length divisible by {2 * self.size}: pad each batch's sequences to it, or pack documents "
                "into blocks of such a length."
            )
        full = dict(batch)
        device = reference.device
        if "position_ids" not in full:
            full["position_ids"] = torch.arange(length, device=device).expand(rows, length)
        if "labels" in full and "shift_labels" not in full:
            full["shift_labels"] = shift_labels(full["labels"])
        local = head_tail_index(length, self.size, self.rank, device)
        gathered = torch.cat([head_tail_index(length, self.size, rank, device) for rank in range(self.size)])
        layout = SequenceLayout(
            group=self.mesh.get_group(),
            size=self.size,
            local=local,
            gathered=gathered,
            documents=document_ids(full["position_ids"]),
        )
        split = {
            name: value.index_select(1, local)
            if isinstance(value, Tensor) and value.ndim >= 2 and value.shape[1] == length
            else value
            for name, value in full.items()
        }
        return split, layout

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around the backward of the last `step`: activation checkpointing recomputes attention there, which must
        see the split sequence as the forward did (the same layout and mask). The layout is dropped afterwards."""
        layout, self._layout = self._layout, None  # its mask is not held into the next step
        if layout is None:
            yield
            return
        with _SplitAttention(layout):
            yield

    @contextlib.contextmanager
    def step(self, batch: Any) -> Iterator[Any]:
        """Around one step's forward: yields this rank's part of `batch` (`split`), with SDPA served across the
        split and `token_mean` / `sequence_sums` reducing over it; the batch unchanged with one context rank.

        Raises:
            ValueError: the forward called no `F.scaled_dot_product_attention` (eager attention, or a model
                without attention): its sequence would be split with nothing to join it.
        """
        if self.size == 1:
            yield batch
            return
        local, layout = self.split(batch)
        self._layout = layout
        token = _ACTIVE.set(layout)
        try:
            with _SplitAttention(layout):
                yield local
        finally:
            _ACTIVE.reset(token)
        if layout.attention_calls == 0:
            raise ValueError(
                f"Context parallel over {self.size} ranks split the batch's sequences, and the step's forward called "
                "no `torch.nn.functional.scaled_dot_product_attention`, the one attention it serves across the "
                "split (each rank's queries attend to every rank's keys). Nothing was updated. A Hugging Face model "
                "needs attn_implementation='sdpa' (the recipe's model.attn_implementation); a module of your own "
                "must compute attention with SDPA and take its positions from the batch's `position_ids`; a model "
                "without attention gains nothing from context parallelism: use context_parallel_size=1."
            )
