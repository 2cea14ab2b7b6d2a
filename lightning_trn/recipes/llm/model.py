"""The LLM recipe's LightningModule (`CausalLM`: a Llama-architecture model, its loss, metrics and optimizer), its
token-weighted metric, the causal mask built on the device, the model's split into pipeline stages (`pipeline_llm`),
and the eager initialization replayed on a model built on the meta device."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch.distributed.tensor import DTensor
from torchmetrics import Metric
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast
from typing_extensions import override

from lightning_trn.core.parallel.context_parallel import (
    document_ids,
    document_mask,
    sequence_sums,
    shift_labels,
    token_mean,
)
from lightning_trn.core.parallel.pipeline import LossFn, Pipeline, pipeline_split
from lightning_trn.hooks.throughput import tensor_parallel_size
from lightning_trn.recipes.llm.data import IGNORE_INDEX, SPECIAL_TOKENS, pretrained_tokenizer, wrap_tokenizer
from lightning_trn.recipes.llm.lora import add_adapters, base_layers, init_adapters
from lightning_trn.recipes.llm.parallelize import (
    apply_ac,
    apply_compile,
    apply_fsdp_stage,
    parallelize,
    refuse_stages_with,
)


class TokenMean(Metric):
    """Mean loss per predicted token over a whole split (`exp=True`: its perplexity), summed on the device.

    Batches differ in real tokens (padding rows count 0), so the split's mean weights each by its token count, not
    each batch alike as `self.log`'s epoch mean would.
    """

    is_differentiable = False
    full_state_update = False
    total: torch.Tensor  # the states `add_state` registers
    count: torch.Tensor

    def __init__(self, exp: bool = False) -> None:
        super().__init__()
        self.exp = exp
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0), dist_reduce_fx="sum")

    @override
    def update(self, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
        """Add a batch's summed token losses and its number of predicted tokens."""
        self.total += loss_sum.to(self.total.dtype)
        self.count += count.to(self.count.dtype)

    @override
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
    return _as_attention_mask(keep, attn_implementation, dtype)


def _as_attention_mask(keep: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the attention takes it: SDPA the booleans, eager attention a mask it adds to
    the scores (0 / the dtype's minimum)."""
    if attn_implementation != "eager":
        return keep
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def packed_mask(position_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The (batch, 1, seq_len, seq_len) mask of packed blocks (`data.packing=true`): causal within each document,
    the documents read off the position ids (`document_mask`); booleans for SDPA, additive for eager attention.
    Under context parallelism the attention replaces it by the whole sequence's (`ContextParallel`)."""
    seq = torch.arange(position_ids.shape[1], device=position_ids.device)
    return _as_attention_mask(document_mask(document_ids(position_ids), seq, seq), attn_implementation, dtype)


def causal_lm_logits(
    net: LlamaForCausalLM,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """`net`'s next-token logits (batch, seq_len, vocab) of causal blocks, from token ids or from hidden states
    (`inputs_embeds`: what a later pipeline stage takes, `StageLM`); with `position_ids` (packed documents, or a
    context-parallel rank's part of each sequence), at those positions, the documents kept apart (`packed_mask`)."""
    given = input_ids if input_ids is not None else inputs_embeds
    assert given is not None
    implementation = net.config._attn_implementation
    if position_ids is None:
        mask = causal_mask(given.shape[1], implementation, net.dtype, given.device)
    else:
        mask = packed_mask(position_ids, implementation, net.dtype)
    return net(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=False,
    ).logits


class StageLM(torch.nn.Module):
    """The forward of a pipeline stage of a Hugging Face causal LM (`net`) that `pipeline_split` pruned to the stage's
    modules (`pipeline_llm`): the first stage takes token ids, a later one the previous stage's hidden states, which
    Hugging Face's model takes as `inputs_embeds` (it embeds only without them); a stage without the final norm and the
    output projection returns hidden states.

    It holds `net` as `net`, so its parameter names are `CausalLM`'s; `CausalLM` does not register it (its
    checkpoints hold `net` once)."""

    def __init__(self, net: LlamaForCausalLM) -> None:
        super().__init__()
        self.net = net
        #: under tensor parallel (`apply_tp`), the mesh over which hidden states are split along the sequence
        self.sequence_mesh: Any = None

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (the last stage) or hidden states (the others) of token ids (the first stage) or hidden states.

        Under tensor parallel the hidden states between decoder layers are DTensors split along the sequence; stages
        hand over their local parts (tensors): a later stage takes its part back as that DTensor, and a stage that
        is not the last sends its own part."""
        if self.net.model.embed_tokens is not None:
            out = causal_lm_logits(self.net, input_ids=x)
        else:
            if self.sequence_mesh is not None:
                from torch.distributed.tensor import Shard

                x = DTensor.from_local(x, self.sequence_mesh, [Shard(1)], run_check=False)
            out = causal_lm_logits(self.net, inputs_embeds=x)
        if isinstance(self.net.lm_head, torch.nn.Identity):  # not the last stage: hidden states to hand over
            out = out.to_local() if isinstance(out, DTensor) else out
            # the head's input is `hidden_states[:, slice]`, a view; torch's split backward (ZBVZeroBubble)
            # detaches a stage's output in place, which a view refuses
            out = out.clone() if out._is_view() else out
        return out


def pipeline_llm(net: LlamaForCausalLM, loss_fn: LossFn, strategy: Any) -> Pipeline:
    """TorchTitan's `pipeline_llm` for a Hugging Face causal LM: `net` split in place into the strategy's pipeline
    stages (`lightning_trn.pipeline_split` along `model.layers`: the embedding with the first stage, the decoder layers
    divided evenly, the final norm and output projection with the last, the rotary embeddings, which hold no state, on
    every stage), and the `Pipeline` of `StageLM`s that runs them; `loss_fn` runs on the last stage.

    A stage without the final norm or the output projection gets an identity in its place: Hugging Face's forward
    calls both, and an identity holds nothing, so the stage's checkpoint keys stay those of the unsplit model."""
    pipeline = pipeline_split(StageLM(net), loss_fn, strategy, layers="net.model.layers")
    for part in pipeline.parts:
        stage_net = cast(LlamaForCausalLM, part.net)
        for owner, name in ((stage_net.model, "norm"), (stage_net, "lm_head")):
            if getattr(owner, name) is None:
                setattr(owner, name, torch.nn.Identity())
    return pipeline


def _post_order(module: torch.nn.Module) -> list[torch.nn.Module]:
    """`module` and its submodules, children before their parents (the order `nn.Module.apply` visits)."""
    return [*(sub for child in module.children() for sub in _post_order(child)), module]


def _has_own_tensors(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def eager_init_steps(net: torch.nn.Module) -> list[tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]]:
    """The initialization that building `net` eagerly runs, as `(submodule, init)` steps in the same order, for
    `lightning_trn.core.parallel.model_parallel.materialize` (`CausalLM.materialization_steps`): run on full-size host
    tensors from the same generator state, they reproduce the eager weights and buffers bit for bit.

    A module's `__init__` ends after its children's: each `torch.nn` module with `reset_parameters` (Linear,
    Embedding) draws torch's default init when built, and each Hugging Face `PreTrainedModel` ends with `post_init`,
    whose `_init_weights` re-initializes, children first, what no inner model's `post_init` did (normal(0, 0.02)
    matrices, a zero padding row, ones for RMSNorm, the rotary `inv_freq` / `original_inv_freq`, which are
    non-persistent buffers: no checkpoint restores them). The default draws are kept although overwritten: they move
    the generator as eager construction does. Tied weights are not replayed (the recipe does not tie).
    """
    steps: list[tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]] = []
    done: set[torch.nn.Module] = set()
    for module in _post_order(net):
        if _built_class(module).__module__.startswith("torch.nn.") and callable(
            getattr(module, "reset_parameters", None)
        ):
            steps.append((module, lambda sub: sub.reset_parameters()))  # type: ignore[operator]  # checked above
        if isinstance(module, PreTrainedModel):
            for sub in _post_order(module):
                if sub not in done and _has_own_tensors(sub):
                    steps.append((sub, module._init_weights))
                done.add(sub)
    return steps


def _built_class(module: torch.nn.Module) -> type:
    """The class `module` was built as: FSDP2's `fully_shard` gives a sharded module a subclass of it (`FSDPLinear`,
    defined in torch.distributed), so the embedding and output projection as units of their own keep their init."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def _embedding_weight(net: PreTrainedModel) -> torch.Tensor:
    """The weight of a Hugging Face model's input embedding (`get_input_embeddings` is typed as any module)."""
    return cast(torch.Tensor, net.get_input_embeddings().weight)


class CausalLM(pl.LightningModule):
    """`LlamaForCausalLM(LlamaConfig(...))` from scratch, next-token cross-entropy, AdamW with linear warm-up and
    cosine decay per step. Logs `train_loss` (per step), `val_loss` / `val_ppl` and `test_loss` / `test_ppl`
    (per split, token-weighted, accumulated on the device). The run-time tokenizer rides in the checkpoint
    (`checkpoint["tokenizer"]`) so `export` can save it next to the model. With `pretrained` (a `save_pretrained`
    folder; docs/recipes.md, "Fine-tuning a pretrained model") the model is the folder's architecture (the shape
    arguments are unused), filled from its weights in `configure_model`, and the tokenizer is the folder's; with
    `lora` as well (`model.lora.*`: r, alpha, dropout, target), only LoRA adapters on its frozen weights train
    (`lora.py`). With `compile`, each decoder layer is compiled in place for the backend (`model.compile`;
    `lightning_trn.compile_blocks`), keeping the checkpoint's keys."""

    #: a `LlamaForCausalLM`, or a pretrained folder's Mistral / Qwen2 / Qwen3 model: the same layout, which
    #: `parallelize` and the PEFT adapters address by name
    net: LlamaForCausalLM

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
        pretrained: str | None = None,
        lora: dict[str, Any] | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["meta_init"])  # loading a checkpoint builds the model on the host
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"model.hidden_size={hidden_size} must be a multiple of model.num_heads={num_heads}, and "
                f"num_heads of model.num_kv_heads={num_kv_heads} (grouped-query attention)."
            )
        bos, eos, pad = range(len(SPECIAL_TOKENS))  # the tokenizer's first ids (train_tokenizer)
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=seq_len,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
            tie_word_embeddings=False,
        )
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"model.attn_implementation={attn_implementation!r}: expected sdpa or eager.")
        config._attn_implementation = attn_implementation
        #: meta_init: the CPU generator state the eager build would have drawn from (`materialization_steps`)
        self._init_rng_state: torch.Tensor | None = None
        self._meta_init = meta_init
        if pretrained:  # the folder's architecture; its weights are read in `configure_model`, after parallelizing
            self.net = pretrained_model(pretrained, attn_implementation, meta_init)
        elif meta_init:  # no memory: the sharding strategy materializes each rank's shards (`materialization_steps`)
            self._init_rng_state = torch.random.get_rng_state()
            with torch.device("meta"):
                self.net = LlamaForCausalLM(config)
        else:
            self.net = LlamaForCausalLM(config)
        if lora:  # adapters replace the targeted Linears before anything wraps or shards them (`lora.py`)
            self.net = add_adapters(self.net, lora, meta=_embedding_weight(self.net).is_meta)
        if activation_checkpointing and not meta_init:  # built on meta: `configure_model` applies it in order
            apply_ac(self.net)
        self.val_loss, self.val_ppl = TokenMean(), TokenMean(exp=True)
        self.test_loss, self.test_ppl = TokenMean(), TokenMean(exp=True)
        self.tokenizer_json: str | None = None
        self._parallelized = False
        #: the model's parameters less the embedding, for `flops_per_batch` (`setup`)
        self._dense_parameters: int | None = None
        #: the pipeline stages this rank runs (`model.pipeline_parallel_size` > 1, `configure_model`), else None
        self._pipeline: Pipeline | None = None
        #: with pipeline stages, the predicted tokens of the batch the schedule runs (`_stage_loss` divides by them)
        self._batch_tokens: torch.Tensor | None = None
        #: inside `_loss_parallel` (it is entered once)
        self._in_loss_parallel = False
        #: with stages and meta_init: the whole model's initialization, taken before the split (`materialization_steps`)
        self._init_steps: list[tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]] | None = None

    @override
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits (batch, seq_len, vocab) of causal blocks (`causal_lm_logits`)."""
        return causal_lm_logits(self.net, input_ids=input_ids, position_ids=position_ids)

    @contextlib.contextmanager
    def _loss_parallel(self) -> Iterator[None]:
        """`loss_parallel()` where the logits are split over the vocabulary (`apply_tp`), else nothing: the cross
        entropy's forward and its backward both need it. Entered once: torch's context does not nest (leaving an
        inner one turns it off), and a pipeline step runs the loss's forward and backward inside its schedule."""
        if tensor_parallel_size(self) == 1 or self._in_loss_parallel:
            yield
            return
        from torch.distributed.tensor.parallel import loss_parallel

        self._in_loss_parallel = True
        try:
            with loss_parallel():
                yield
        finally:
            self._in_loss_parallel = False

    def _summed_cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of every predicted token (`targets`: the next tokens, `IGNORE_INDEX` skipped). Under
        tensor parallel the logits stay split over the vocabulary and the sum is computed under `loss_parallel`; it
        comes back as a plain tensor (its backward is `backward`'s)."""
        predicted = logits
        # at least float32 (bfloat16 logits are upcast for the softmax); a float64 model keeps float64
        predicted = predicted.to(torch.promote_types(predicted.dtype, torch.float32))
        with self._loss_parallel():
            total = F.cross_entropy(
                predicted.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        if isinstance(total, DTensor):  # replicated after loss_parallel's all-reduce: no communication
            total = total.full_tensor()
        return total

    @staticmethod
    def _targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each position's next token: the batch's `shift_labels` where given (a context-parallel split takes them on
        the whole sequence, `ContextParallel.split`), else `labels` shifted here."""
        return batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])

    @staticmethod
    def _predicted_tokens(targets: torch.Tensor) -> torch.Tensor:
        """How many tokens of the batch the loss covers (`IGNORE_INDEX` skipped), on the device."""
        return (targets != IGNORE_INDEX).sum()

    def _stage_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The pipeline's loss of a microbatch, on the last stage: its summed cross-entropy over its predicted tokens
        divided by the whole batch's predicted tokens (`_batch_tokens`, set by the step) over the microbatches. The
        pipeline's mean over the microbatches is then the batch's token mean, as one device's `total / count`, however
        the predicted tokens fall between the microbatches (fine-tuning rows: prompt and padding are not predicted)."""
        assert self._pipeline is not None and self._batch_tokens is not None
        summed = self._summed_cross_entropy(logits, labels)
        return summed * self._pipeline.microbatches / self._batch_tokens

    def loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy of every predicted token (`_summed_cross_entropy`) and their count, both on the
        device; with pipeline stages, from the forward-only schedule's loss (`_stage_loss`), on every rank. Under
        context parallelism, of this rank's part of the sequences (`lightning_trn.token_mean` joins them)."""
        targets = self._targets(batch)
        count = self._predicted_tokens(targets)
        if self._pipeline is not None:
            self._batch_tokens = count
            return self._pipeline.eval(batch["input_ids"], target=targets) * count, count
        logits = self(batch["input_ids"], batch.get("position_ids"))
        return self._summed_cross_entropy(logits, targets), count

    @override
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The Trainer's backward (automatic optimization) under `loss_parallel`, which the cross entropy's backward
        over vocabulary-split logits needs as much as its forward: entering it in `training_step` alone would be
        left before the Trainer runs backward."""
        with self._loss_parallel():
            super().backward(loss, *args, **kwargs)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self._pipeline is not None:  # the schedule ran the backward too; the last stage's loss, on every rank
            targets = self._targets(batch)
            self._batch_tokens = self._predicted_tokens(targets)
            with self._loss_parallel():  # around the schedule, which runs the loss's backward
                loss = self._pipeline.step(batch["input_ids"], target=targets)
        else:
            loss = token_mean(*self.loss_sum(batch))  # over the whole sequences under context parallelism
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def _evaluate(self, batch: dict[str, torch.Tensor], stage: str) -> None:
        total, count = sequence_sums(*self.loss_sum(batch))
        mean, ppl = getattr(self, f"{stage}_loss"), getattr(self, f"{stage}_ppl")
        mean.update(total, count)
        ppl.update(total, count)
        self.log(f"{stage}_loss", mean, on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}_ppl", ppl, on_step=False, on_epoch=True, prog_bar=True)

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    @override
    def setup(self, stage: str) -> None:
        """Take the data module's tokenizer (saved with the checkpoints) and set `flops_per_batch` for
        `ThroughputMonitor`: 6 x (parameters except the embedding) + 12 x layers x hidden x seq_len per token,
        forward and backward (PaLM's count; recomputation under activation checkpointing not included). The
        parameters are counted at the first call, before `configure_model` (a pipeline stage holds only its own)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None:
            return
        self.tokenizer_json = getattr(datamodule, "tokenizer_json", self.tokenizer_json)
        if self._dense_parameters is None:
            self._dense_parameters = sum(p.numel() for p in self.net.parameters()) - _embedding_weight(self.net).numel()
        seq_len, config = self.hparams["seq_len"], self.net.config
        per_token = 6 * self._dense_parameters + 12 * config.num_hidden_layers * config.hidden_size * seq_len
        self.flops_per_batch = per_token * datamodule.batch_size * seq_len

    @override
    def configure_model(self) -> None:
        """Under `ModelParallelStrategy` (`trainer.strategy=model_parallel`): `parallelize` over its device mesh
        (tensor parallel, activation checkpointing, `compile`, FSDP2 with bf16 parameters under bf16 precision), with
        pipeline stages (`model.pipeline_parallel_size`) after splitting the model (`pipeline_llm`), each stage. FSDP
        strategies (`trainer.strategy=fsdp`) shard by their `auto_wrap_policy` after this hook: here only the
        checkpointing of a model built on meta, which `__init__` leaves to this hook, and `compile`. With `compile`,
        each decoder layer is compiled in place (`apply_compile`; not when loading a checkpoint without a Trainer)."""
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_trn.pytorch.strategies import NeuronFSDPStrategy

        if self._parallelized:
            return
        if self.device_mesh is None and self._init_rng_state is not None:  # meta_init, nothing to shard: all here
            from lightning_trn.core.parallel.model_parallel import materialize

            materialize(self, self.trainer.strategy.root_device)
        checkpointing = self.hparams["activation_checkpointing"] and self._meta_init
        compiled = self.hparams.get("compile", False) and self._trainer is not None  # not for export's load
        if self.device_mesh is not None and not isinstance(self.trainer.strategy, (FSDPStrategy, NeuronFSDPStrategy)):
            bf16 = str(self.trainer.precision).startswith("bf16")
            nets = [self.net]
            if getattr(self.trainer.strategy, "pipeline_parallel_size", 1) > 1:
                stages = getattr(self.trainer.strategy, "pipeline_parallel_size", 1)
                tied = self.net.config.tie_word_embeddings and self.device_mesh["tensor_parallel"].size() > 1
                refuse_stages_with(stages, tied_tensor_parallel=tied, lora=bool(self.hparams["lora"]))
                # other stages' modules leave `net`, but their initialization still draws from the generator
                if self._init_rng_state is not None:
                    self._init_steps = eager_init_steps(self.net)
                self._pipeline = pipeline_llm(self.net, self._stage_loss, self.trainer.strategy)
                nets = [cast(LlamaForCausalLM, part.net) for part in self._pipeline.parts]
            for net in nets:
                parallelize(net, self.device_mesh, checkpointing, torch.bfloat16 if bf16 else None, compiled)
            for part in self._pipeline.parts if self._pipeline is not None else ():
                if self.device_mesh["tensor_parallel"].size() > 1:
                    cast(StageLM, part).sequence_mesh = self.device_mesh["tensor_parallel"]
                apply_fsdp_stage(part, self.device_mesh, torch.bfloat16 if bf16 else None)
        else:
            if checkpointing:
                apply_ac(self.net)
            if compiled:
                apply_compile(self.net)
        # each rank reads the blocks it keeps, meta tensors getting storage; without a Trainer this is
        # `load_from_checkpoint` (export), whose checkpoint holds the weights
        if self.hparams.get("pretrained") and self._trainer is not None:
            from lightning_trn.core.checkpoint.pretrained import load_pretrained

            device = self.trainer.strategy.root_device
            stage = None
            if self._pipeline is not None:  # this rank's stages; their tied names as `net`'s
                stage = [[name.removeprefix("net.") for name in tie] for tie in self._pipeline.tied_names]
            with base_layers(self.net):  # the folder's names are those of the model without adapters
                load_pretrained(self.net, self.hparams["pretrained"], prefix="", device=device, stage=stage)
            init_adapters(self.net, device)
        self._parallelized = True

    def materialization_steps(self) -> list[tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]]:
        """`eager_init_steps` of the model built on the meta device (`meta_init=True`), for the strategy's
        `materialize`: they draw from the generator state recorded when the model was built, as the eager build
        would have, and then give the CPU generator back the state it had, so the weights do not depend on what drew
        in between. Without `meta_init`, none (nothing is on the meta device)."""
        state = self._init_rng_state
        if state is None:
            return []
        # with pipeline stages, the whole model's: the modules other stages hold draw on the host as the eager build
        # did and land nowhere (they stay on the meta device, outside `net`)
        steps = list(self._init_steps) if self._init_steps is not None else eager_init_steps(self.net)
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

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        """AdamW (no weight decay on norms or other vectors), learning rate warmed up linearly from lr/warmup_steps,
        then cosine down to `min_lr_ratio` x lr at the last step; stepped every optimizer step. Frozen parameters
        (the base weights under `lora`) are left out: the optimizer holds state for the trained ones only."""
        hp = self.hparams
        trained = [p for p in self.parameters() if p.requires_grad]
        matrices = [p for p in trained if p.ndim >= 2]
        vectors = [p for p in trained if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": hp["weight_decay"]}, {"params": vectors, "weight_decay": 0.0}],
            lr=hp["lr"],
            betas=(0.9, 0.95),
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup, floor = hp["warmup_steps"], hp["min_lr_ratio"]

        def factor(step: int) -> float:  # never exactly 0: XLA would compile the special scalar separately
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokenizer"] = self.tokenizer_json

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokenizer_json = checkpoint.get("tokenizer")

    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The tokenizer the model was trained with (the `model.pretrained` folder's, or from the data module, or the
        loaded checkpoint)."""
        if self.hparams.get("pretrained"):
            return pretrained_tokenizer(self.hparams["pretrained"])
        if self.tokenizer_json is None:
            raise ValueError("This module has no tokenizer: load it from a recipe checkpoint or train it first.")
        return wrap_tokenizer(self.tokenizer_json)


def pretrained_model(path: str, attn_implementation: str, meta: bool) -> LlamaForCausalLM:
    """`AutoModelForCausalLM` built from the config of the `save_pretrained` folder `path` (a supported
    `model_type`, else a `ValueError` naming them), on the meta device or, with `meta=False`, on the host with
    random weights: `load_pretrained` fills either. Typed as the Llama model, whose layout every supported type has."""
    from lightning_trn.core.checkpoint.pretrained import meta_model_from_pretrained

    net = cast(LlamaForCausalLM, meta_model_from_pretrained(path, attn_implementation=attn_implementation))
    if meta:
        return net
    from transformers import AutoModelForCausalLM

    return cast(LlamaForCausalLM, AutoModelForCausalLM.from_config(net.config, attn_implementation=attn_implementation))
