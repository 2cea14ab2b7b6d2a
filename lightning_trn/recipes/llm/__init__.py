"""LLM recipe: a Llama-architecture causal language model (Hugging Face `LlamaForCausalLM`: RMSNorm, rotary
embeddings, SwiGLU, grouped-query attention) trained from scratch on offline text with a byte-level BPE tokenizer
trained at run time. `python -m recipes.llm --help`; `python -m recipes.llm preset=trn1-1b` for real hardware;
`python -m recipes.llm export ckpt=... out=...` writes a `save_pretrained` folder (model + tokenizer);
`python -m recipes.llm model.pretrained=DIR data.source=rows.jsonl` fine-tunes such a folder.

One module per part, as TorchTitan lays out a model: `config` (schema and presets), `data` (tokenizer, documents,
packing), `sft` (fine-tuning rows), `model` (`CausalLM`, its metric, mask, pipeline stages and meta-device
initialization), `parallelize` (tensor parallel, activation checkpointing, FSDP2), `lora` (PEFT adapters), `export`
(the Hugging Face folder). This module reads the config and assembles them into `RECIPE`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from omegaconf import DictConfig

from lightning_trn.recipes.common import Recipe
from lightning_trn.recipes.llm.config import PRESETS, LlmConfig, LlmData, LlmModel, LoraSettings
from lightning_trn.recipes.llm.data import (
    IGNORE_INDEX,
    SPECIAL_TOKENS,
    LMDataModule,
    document_positions,
    encode_documents,
    load_documents,
    pack,
    pretrained_tokenizer,
    sequences_in_batch,
    split_documents,
    tokens_in_batch,
    train_tokenizer,
    unigram_perplexity,
    wrap_tokenizer,
)
from lightning_trn.recipes.llm.export import export
from lightning_trn.recipes.llm.lora import check_config, lora_hparams
from lightning_trn.recipes.llm.model import (
    CausalLM,
    StageLM,
    TokenMean,
    causal_mask,
    eager_init_steps,
    pipeline_llm,
    pretrained_model,
)
from lightning_trn.recipes.llm.parallelize import (
    apply_ac,
    apply_compile,
    apply_fsdp,
    apply_tp,
    parallelize,
    refuse_stages_with,
)
from lightning_trn.recipes.llm.sft import sft_datamodule

__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "RECIPE",
    "SPECIAL_TOKENS",
    "CausalLM",
    "LMDataModule",
    "LlmConfig",
    "LlmData",
    "LlmModel",
    "LoraSettings",
    "StageLM",
    "TokenMean",
    "allow_block_graphs",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "apply_tp",
    "build_model",
    "check_pipeline",
    "causal_mask",
    "eager_init_steps",
    "encode_documents",
    "export",
    "lm_datamodule",
    "load_documents",
    "document_positions",
    "pack",
    "parallelize",
    "pipeline_llm",
    "pretrained_model",
    "pretrained_tokenizer",
    "sequences_in_batch",
    "split_documents",
    "summary",
    "tokens_in_batch",
    "train_tokenizer",
    "trainer_args",
    "unigram_perplexity",
    "wrap_tokenizer",
]

#: `trainer.strategy` names of Lightning's `ModelParallelStrategy` (`trainer_args` builds it)
_MODEL_PARALLEL = ("model_parallel", "neuron_model_parallel")
#: strategies that shard the model: `build_model` builds it on the meta device, the strategy materializes shards
_SHARDED = (*_MODEL_PARALLEL, "fsdp", "neuron_fsdp")


def lm_datamodule(cfg: DictConfig) -> pl.LightningDataModule:
    """Documents split with `seed`, the tokenizer trained on the training split (or, with `model.pretrained`, the
    folder's), each split packed; with `model.pretrained` and a `.jsonl` source, supervised fine-tuning rows
    (`sft.py`)."""
    data = cfg.data
    pretrained = cfg.model.pretrained
    if str(data.source).endswith(".jsonl"):
        if not pretrained:
            raise ValueError(
                f"data.source={data.source}: fine-tuning rows (JSON Lines) need model.pretrained=DIR, "
                "whose tokenizer and chat template encode them."
            )
        return sft_datamodule(
            pretrained_tokenizer(pretrained),
            data.source,
            data.seq_len,
            data.batch_size,
            data.val_fraction,
            data.test_fraction,
            cfg.seed,
            data.length_buckets,
            packing=data.get("packing", False),
        )
    if data.length_buckets:
        raise ValueError(
            f"data.length_buckets={list(data.length_buckets)} is for fine-tuning rows (data.source=FILE.jsonl): "
            f"packed text ({data.source}) is cut into blocks of data.seq_len already, one shape."
        )
    train, val, test = split_documents(load_documents(data.source), data.val_fraction, data.test_fraction, cfg.seed)
    tokenizer = pretrained_tokenizer(pretrained) if pretrained else train_tokenizer(train, data.vocab_size)
    eos = tokenizer.eos_token_id
    encoded = {
        name: encode_documents(tokenizer, docs) for name, docs in (("train", train), ("val", val), ("test", test))
    }
    splits = {name: pack(documents, eos, data.seq_len) for name, documents in encoded.items()}
    positions = None
    if data.get("packing", False):  # the same blocks, each document kept apart
        positions = {name: document_positions(documents, data.seq_len) for name, documents in encoded.items()}
    return LMDataModule(tokenizer, splits, data.batch_size, cfg.seed, positions)


def build_model(cfg: DictConfig) -> CausalLM:
    """`CausalLM` from `model.*`: built on the meta device under a strategy that shards it, LoRA checked first; with
    `model.compile`, Dynamo allowed the graphs the run needs (`allow_block_graphs`)."""
    m = cfg.model
    check_config(cfg)
    if m.compile:
        allow_block_graphs(cfg)
    return CausalLM(
        vocab_size=cfg.data.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        seq_len=cfg.data.seq_len,
        rope_theta=m.rope_theta,
        attn_implementation=m.attn_implementation,
        activation_checkpointing=m.activation_checkpointing,
        compile=m.compile,
        lr=m.lr,
        weight_decay=m.weight_decay,
        warmup_steps=m.warmup_steps,
        min_lr_ratio=m.min_lr_ratio,
        meta_init=cfg.trainer.get("strategy", "auto") in _SHARDED,
        pretrained=m.pretrained or None,
        lora=lora_hparams(m.lora),
    )


def allow_block_graphs(cfg: DictConfig) -> None:
    """Raise Dynamo's limit of graphs per compiled function (`torch._dynamo.config.recompile_limit`, 8) to what the
    run's compiled decoder layers build, which share one function: a graph per batch length (each length bucket and
    `data.seq_len`) and mode (training, evaluation), twice under tensor parallelism (the first layer's input is
    another tensor type than the later ones'). Past the limit a `fullgraph=True` compile fails mid-run."""
    import torch._dynamo

    graphs = (len(cfg.data.length_buckets) + 1) * 2 * (2 if cfg.model.tensor_parallel_size > 1 else 1)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)


def trainer_args(cfg: DictConfig) -> dict[str, Any]:
    """`trainer.strategy=model_parallel`: Lightning's `ModelParallelStrategy` with `model.tensor_parallel_size`
    devices per tensor-parallel group and the rest FSDP2 (native backend); with `model.replicate_size` > 1 or
    `model.pipeline_parallel_size` > 1 the plugin's `NeuronModelParallelStrategy` (Lightning's has neither dimension):
    HSDP, that many replicas with FSDP2 within each, and pipeline stages (`check_pipeline`); `fsdp`: Lightning's
    `FSDPStrategy` sharding each decoder layer, writing sharded checkpoints as `strategy="fsdp"` does; `neuron_zero1`
    with `zero1_state_dict_type=sharded`: ZeRO-1 writing sharded checkpoints. Other strategies go to the Trainer as
    they are."""
    strategy = cfg.trainer.get("strategy", "auto")
    m = cfg.model
    tp, replicas, stages = m.tensor_parallel_size, m.replicate_size, m.pipeline_parallel_size
    context = m.get("context_parallel_size", 1)
    if context > 1 and m.compile:
        raise ValueError(
            f"model.context_parallel_size={context} with model.compile=true: the attention over the split sequence "
            "runs in a Python mode around the step, which a compiled decoder layer (fullgraph) does not trace. "
            "Use model.compile=false with context parallelism."
        )
    if context > 1 and cfg.data.seq_len % (2 * context):
        raise ValueError(
            f"model.context_parallel_size={context} cuts each sequence into {2 * context} equal chunks (head-tail "
            f"load balancing), and data.seq_len={cfg.data.seq_len} does not divide into them: use a multiple of "
            f"{2 * context}."
        )
    if strategy in _MODEL_PARALLEL:
        from lightning.pytorch.strategies import ModelParallelStrategy

        devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
        if not isinstance(devices, int) or (devices * nodes) % (tp * replicas * stages * context):
            raise ValueError(
                f"trainer.strategy={strategy} needs trainer.devices (an integer; here {devices!r}) x "
                f"num_nodes divisible by model.tensor_parallel_size={tp} x model.replicate_size={replicas}"
                + (f" x model.pipeline_parallel_size={stages}" if stages > 1 else "")
                + (f" x model.context_parallel_size={context}" if context > 1 else "")
                + "."
            )
        data = data_parallel_ranks(cfg) // replicas  # FSDP2's ranks within a replica
        if replicas == 1 and stages == 1 and context == 1:
            return {"strategy": ModelParallelStrategy(data_parallel_size=data, tensor_parallel_size=tp)}
        from lightning_trn import NeuronModelParallelStrategy

        check_pipeline(cfg)
        return {
            "strategy": NeuronModelParallelStrategy(
                data_parallel_size=data,
                tensor_parallel_size=tp,
                replicate_size=replicas,
                pipeline_parallel_size=stages,
                pipeline_schedule=m.pipeline_schedule,
                pipeline_microbatches=m.pipeline_microbatches,
                context_parallel_size=context,
            )
        }
    sizes = {"tensor_parallel_size": tp, "replicate_size": replicas, "pipeline_parallel_size": stages}
    for key, size in (sizes | {"context_parallel_size": context}).items():
        if size != 1:
            raise ValueError(f"model.{key}={size} needs trainer.strategy=model_parallel (here {strategy!r}).")
    if strategy == "neuron_zero1" and cfg.zero1_state_dict_type == "sharded":
        from lightning_trn import NeuronDDPStrategy

        return {"strategy": NeuronDDPStrategy(zero1=True, state_dict_type="sharded")}
    if strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        # sharded checkpoints, as `strategy="fsdp"` writes with accelerator="neuron" (a Lightning `FSDPStrategy`
        # object's own default is one file gathered on rank 0)
        return {"strategy": FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, state_dict_type="sharded")}
    return {}


def check_pipeline(cfg: DictConfig) -> None:
    """Refuse, before anything is built, what the recipe does not run with pipeline stages (`refuse_stages_with`; a
    folder's tied head under tensor parallel is refused once the folder is read, in `configure_model`)."""
    m = cfg.model
    refuse_stages_with(m.pipeline_parallel_size, lora=bool(m.lora.r))
    if m.pipeline_parallel_size > 1 and cfg.data.get("packing", False):
        raise ValueError(
            f"data.packing=true with model.pipeline_parallel_size={m.pipeline_parallel_size}: the recipe's pipeline "
            "stages take token ids alone, without the position ids that keep packed documents apart. Use "
            "data.packing=false with stages, or FSDP2, tensor and context parallel without them."
        )


def data_parallel_ranks(cfg: DictConfig) -> int:
    """The ranks that read different batches: all of them, less the tensor-parallel groups and pipeline stages under
    `trainer.strategy=model_parallel` (HSDP replicas read different batches too): `data.global_batch_size` is divided
    over them, and `trainer_args` divides them into the replicas' FSDP2 groups."""
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    if not isinstance(devices, int) or not isinstance(nodes, int):
        raise ValueError(
            f"data.global_batch_size={cfg.data.global_batch_size} needs trainer.devices and trainer.num_nodes as "
            f"integers (here {devices!r} and {nodes!r}) to divide it over the data-parallel ranks; give them, or "
            "data.global_batch_size=null with data.batch_size per rank."
        )
    m = cfg.model
    if cfg.trainer.get("strategy", "auto") in _MODEL_PARALLEL:
        shared = m.tensor_parallel_size * m.pipeline_parallel_size * m.get("context_parallel_size", 1)
        return max(devices * nodes // shared, 1)
    return devices * nodes


def resolve(cfg: DictConfig, given: set[str]) -> None:
    """`data.batch_size` from `data.global_batch_size` where that is set: the global batch over the data-parallel
    ranks and the accumulated batches (TorchTitan's rule), so a layout override (`model.pipeline_parallel_size=4`)
    keeps a preset's sequences per step. Refused: both keys given, or a global batch that does not divide."""
    total = cfg.data.global_batch_size
    if total is None:
        return
    if "data.batch_size" in given:
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} and data.global_batch_size={total} are both set (a preset sets "
            "the global one): give one. data.global_batch_size=null keeps data.batch_size per rank."
        )
    ranks, accumulate = data_parallel_ranks(cfg), cfg.trainer.get("accumulate_grad_batches", 1)
    if not isinstance(accumulate, int) or total % (ranks * accumulate):
        raise ValueError(
            f"data.global_batch_size={total} does not divide into {ranks} data-parallel ranks x "
            f"trainer.accumulate_grad_batches={accumulate!r}: choose a multiple of {ranks * accumulate} (or "
            "data.global_batch_size=null with data.batch_size per rank)."
        )
    cfg.data.batch_size = total // (ranks * accumulate)


def summary(trainer: pl.Trainer, module: pl.LightningModule, data: pl.LightningDataModule) -> dict[str, float]:
    """The last validation's perplexity and the unigram perplexity of the same tokens (printed after the run)."""
    if "val_ppl" not in trainer.callback_metrics:
        trainer.validate(module, datamodule=data, verbose=False)
    if not hasattr(data, "unigram_perplexity"):  # fine-tuning rows (`sft`): no packed blocks to count
        return {"val_ppl": float(trainer.callback_metrics["val_ppl"])}
    return {"val_ppl": float(trainer.callback_metrics["val_ppl"]), "unigram_ppl": data.unigram_perplexity()}


RECIPE = Recipe(
    "llm",
    CausalLM,
    lm_datamodule,
    build_model,
    export,
    LlmConfig,
    batch_size_fn=sequences_in_batch,
    length_fn=tokens_in_batch,
    trainer_args=trainer_args,
    summary=summary,
    presets=PRESETS,
    resolve=resolve,
)
