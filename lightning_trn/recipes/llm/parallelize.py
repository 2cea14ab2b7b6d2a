"""How the LLM recipe's model is split over devices under `ModelParallelStrategy`: TorchTitan's `parallelize_llama`
for the Hugging Face model, as one `apply_*` step after another (tensor parallel, activation checkpointing, compile,
FSDP2)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaForCausalLM

from lightning_trn.core.parallel.parallel_dims import ParallelDims
from lightning_trn.torch_compile import compile_blocks


def parallelize(
    net: LlamaForCausalLM,
    device_mesh: Any,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    compiled: bool = False,
) -> LlamaForCausalLM:
    """TorchTitan's `parallelize_llama` for the Hugging Face model, one visible step after another: tensor parallel
    over the mesh's `tensor_parallel` dimension, then activation checkpointing, then (`compiled`) `torch.compile` per
    decoder layer, then FSDP2 over `data_parallel` (TorchTitan's units: `apply_fsdp`), HSDP over `("replicate",
    "data_parallel")` where the mesh has replicas (`NeuronModelParallelStrategy(replicate_size=...)`), data x context
    under context parallelism (`ParallelDims.fsdp_mesh`). Afterwards
    every parameter is a DTensor on one mesh, so AdamW takes its default `foreach` path. `param_dtype`: FSDP2's
    compute dtype (bf16 under bf16 precision; gradients are still reduced in fp32)."""
    tp, dp = device_mesh["tensor_parallel"], ParallelDims.fsdp_mesh(device_mesh)
    if tp.size() > 1:
        apply_tp(net, tp)
    if activation_checkpointing:
        apply_ac(net)
    if compiled:
        apply_compile(net)
    if dp.size() > 1:
        apply_fsdp(net, dp, param_dtype)
    return net


def refuse_stages_with(stages: int, tied_tensor_parallel: bool = False, lora: bool = False) -> None:
    """Refuse, with what to do instead, what the recipe's pipeline stages do not run: LoRA adapters, and an output
    head tied to the embedding (`tie_word_embeddings`) under tensor parallel, whose copies on the first and last
    stage the conformance sweep has not proven equal (docs/sharding.md, "Conformance")."""
    if stages == 1 or not (tied_tensor_parallel or lora):
        return
    what = "model.lora.r set" if lora else "model.tensor_parallel_size > 1 and a pretrained folder that ties its head"
    raise ValueError(
        f"model.pipeline_parallel_size={stages} does not run with {what}: the recipe's pipeline stages take FSDP2, "
        "HSDP and tensor parallel within each stage, from scratch or from a pretrained folder, without LoRA, and "
        "tie the head to the embedding across stages without tensor parallel only. Use "
        "model.pipeline_parallel_size=1 for LoRA, or model.tensor_parallel_size=1 with stages for a tied folder "
        '(docs/sharding.md, "Conformance", lists what each layout runs).'
    )


def apply_tp(net: LlamaForCausalLM, tp_mesh: Any) -> None:
    """TorchTitan's whole tensor-parallel plan: the embedding row-wise (vocabulary split) with its output split along
    the sequence; sequence-parallel RMSNorms; each block's attention and MLP inputs gathered, q/k/v and gate/up
    column-wise, o and down row-wise back to sequence shards; the output projection column-wise with the logits left
    split over the vocabulary (a DTensor, `Shard(-1)`), for the cross entropy under `loss_parallel`.

    As in TorchTitan, attention and the MLP take their gathered input as a DTensor (`use_local_output=False`): q, k
    and v (gate and up) read the one replicated input, their input gradients add up as one `Partial` DTensor, and a
    single reduce-scatter takes it back to sequence shards. Handed a local tensor, each column-wise layer would wrap
    its own copy and all-reduce its own input gradient: five all-reduces of a whole activation per block instead of
    two reduce-scatters (5.00 GiB per rank and step at trn2-8b). Hugging Face's attention reads the batch and sequence
    sizes off that input and views the column-wise outputs (local tensors of this rank's heads) with `-1` heads, so it
    takes the DTensor unchanged.

    Unlike TorchTitan, activations between blocks stay DTensors too (`use_local_output=False` on the embedding, o and
    down; a layout, no communication): Hugging Face's model reads the sequence length off the embedding's output for
    the rotary positions, so it must see the global shape.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    config = net.config
    if config.num_attention_heads % tp_mesh.size() or config.num_key_value_heads % tp_mesh.size():
        raise ValueError(
            f"Tensor parallel over {tp_mesh.size()} devices needs num_heads ({config.num_attention_heads})"
            f" and num_kv_heads ({config.num_key_value_heads}) divisible by it."
        )
    embedding, head = net.model.embed_tokens, getattr(net.lm_head, "weight", None)
    tied = embedding is not None and head is embedding.weight  # pretrained folders may tie them
    plan: dict[str, Any] = {}
    # a pipeline stage (`pipeline_llm`) has the embedding on the first stage only, the norm and head on the last
    if embedding is not None:
        plan["model.embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if head is not None:
        plan["model.norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(net, tp_mesh, plan)
    if tied:  # each plan distributed its own copy; both split the vocabulary (Shard(0)), so one serves both again
        net.lm_head.weight = net.model.embed_tokens.weight
    # attention takes its input by keyword (`hidden_states=`), the MLP positionally
    gather_attention = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=False,
    )
    gather_mlp = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    to_sequence_shards = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    block_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": gather_attention,
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": to_sequence_shards,
        "post_attention_layernorm": SequenceParallel(),
        "mlp": gather_mlp,
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": to_sequence_shards,
    }
    if hasattr(next(iter(net.model.layers)).self_attn, "q_norm"):
        # Qwen3: an RMSNorm over each head's query and key (input: batch, sequence, this rank's heads, head_dim), as
        # TorchTitan's Qwen3 plan: its weight replicated, its input split over the heads, so its gradient is summed
        # over the ranks' heads
        per_head = SequenceParallel(sequence_dim=2, use_local_output=True)
        block_plan |= {"self_attn.q_norm": per_head, "self_attn.k_norm": per_head}
    for layer in net.model.layers:
        parallelize_module(layer, tp_mesh, block_plan)


def apply_ac(net: LlamaForCausalLM) -> None:
    """Checkpoint each decoder layer (Hugging Face's non-reentrant gradient checkpointing: it keeps the module names,
    so checkpoints load into a model without it)."""
    net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def apply_compile(net: LlamaForCausalLM) -> None:
    """TorchTitan's `apply_compile`: each decoder layer compiled in place, its checkpointing inside, with
    `fullgraph=True` (`lightning_trn.compile_blocks`; unchanged on XLA)."""
    compile_blocks(net.model.layers)


def apply_fsdp_stage(stage: torch.nn.Module, device_mesh: Any, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 on a pipeline stage's module (`StageLM`, around the stage's sharded `net`): torch's schedules reduce the
    gradients of all microbatches once, at the step's end, only when the stage's module is itself an FSDP module
    (TorchTitan shards each model part so); otherwise every microbatch's backward reduce-scatters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp = ParallelDims.fsdp_mesh(device_mesh)
    if dp.size() == 1:
        return
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    fully_shard(stage, mesh=dp, mp_policy=mp_policy or MixedPrecisionPolicy())


def apply_fsdp(net: LlamaForCausalLM, dp_mesh: Any, param_dtype: torch.dtype | None = None) -> None:
    """TorchTitan's FSDP2 units: the embedding, each decoder layer, the final norm with the output projection, then
    the root; with `param_dtype`, TorchTitan's `MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`. `dp_mesh`:
    the data-parallel dimension (FSDP2), or the (replicate, data-parallel) pair (HSDP), either with data x context
    flattened under context parallelism (`ParallelDims.fsdp_mesh`).

    The embedding is its own unit so that its gathered weight is freed after the forward (left in the root, it stays
    gathered from the forward to the end of the backward: 0.5 GiB per rank at 70 B); the norm and output projection
    are not resharded after the forward, since the backward needs them at once. Tied embedding and output weights
    (pretrained folders) stay in the root: one parameter belongs to one unit. A pipeline stage (`pipeline_llm`) has
    the units it holds: no embedding (None) past the first stage, no norm and output projection (identities) before
    the last."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": dp_mesh} if mp_policy is None else {"mesh": dp_mesh, "mp_policy": mp_policy}
    embedding = net.model.embed_tokens
    tied = embedding is not None and getattr(net.lm_head, "weight", None) is embedding.weight
    if embedding is not None and not tied:
        fully_shard(embedding, **kwargs)
    for layer in net.model.layers:
        fully_shard(layer, **kwargs)
    ends = [module for module in (net.model.norm, net.lm_head) if next(module.parameters(), None) is not None]
    if ends and not tied:
        fully_shard(ends, **kwargs, reshard_after_forward=False)
    fully_shard(net, **kwargs)
