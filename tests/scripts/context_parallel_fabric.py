"""A Fabric loop with context parallelism (`NeuronModelParallelStrategy(context_parallel_size=2)`) on a Hugging Face
Qwen2 model, or its one-device reference: a few SGD steps on dict batches, the loop splitting each batch around its
forward and backward (`fabric.strategy.context_parallel.step`), the final weights saved to `--out`.

    torchrun --nproc_per_node=2 context_parallel_fabric.py --out W.pt                # 2 stand-in ranks, float32
    python context_parallel_fabric.py --reference --out W.pt [--float64]              # one CPU device
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

import lightning_trn
from lightning_trn.core.parallel.context_parallel import shift_labels
from lightning_trn.fabric.strategies import NeuronModelParallelStrategy

STEPS, ROWS, LENGTH, VOCAB = 3, 4, 16, 96


def build(dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).to(dtype)


def shard(model: Qwen2ForCausalLM, mesh: object) -> Qwen2ForCausalLM:
    fsdp = lightning_trn.ParallelDims.fsdp_mesh(mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp)
    fully_shard(model, mesh=fsdp)
    return model


def batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
        labels = tokens.masked_fill(torch.rand(ROWS, LENGTH, generator=generator) < 0.3, -100)  # uneven per rank
        out.append({"input_ids": tokens, "labels": labels})
    return out


def loss_of(model: Qwen2ForCausalLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    targets = batch["shift_labels"]
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return lightning_trn.token_mean(total, (targets != -100).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--float64", action="store_true")
    args = parser.parse_args()
    dtype = torch.float64 if args.float64 else torch.float32
    if args.reference:
        fabric = Fabric(accelerator="cpu", devices=1, precision="64-true" if args.float64 else "32-true")
    else:
        strategy = NeuronModelParallelStrategy(
            shard, data_parallel_size=1, tensor_parallel_size=1, context_parallel_size=2
        )
        fabric = Fabric(accelerator="neuron", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(build(dtype))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    losses = []
    for batch in batches():
        batch = {name: value.to(fabric.device) for name, value in batch.items()}
        if args.reference:  # what the split adds, taken on the whole sequence
            batch["shift_labels"] = shift_labels(batch["labels"])
            batch["position_ids"] = torch.arange(LENGTH, device=fabric.device).expand(ROWS, LENGTH)
            loss = loss_of(model, batch)
            fabric.backward(loss)
        else:
            with fabric.strategy.context_parallel.step(batch) as local:
                loss = loss_of(model, local)
                fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if fabric.global_rank == 0:
        torch.save({"weights": {k: v.detach().cpu() for k, v in state.items()}, "losses": losses}, args.out)


if __name__ == "__main__":
    main()
