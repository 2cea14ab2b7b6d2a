"""Worker script for tests/strategies/test_compile_blocks.py, run under torchrun with 4 processes on the stand-in: a
2-layer Hugging Face Llama parallelized by the LLM recipe's `parallelize` in TorchTitan's order (tensor parallel,
activation checkpointing, `torch.compile` per decoder layer, FSDP2) on three meshes, FSDP2 over 4 (`fsdp`), tensor
parallel over 4 (`tp`) and FSDP2 over 2 x tensor parallel over 2 (`dp_tp`), each trained eagerly and compiled from
the same weights on the same batches (AdamW, 2 steps).

Rank 0 writes argv[1] (JSON), per mesh: both runs' losses, the largest weight difference between them, whether their
state_dict keys are the same, the graphs Dynamo built during the first compiled step and during the later ones, and
the graph breaks during the compiled run.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_trn import standin  # noqa: F401  the `neuron` device and its process group
from lightning_trn.recipes.llm import causal_mask, parallelize

MESHES = {"fsdp": (4, 1), "tp": (1, 4), "dp_tp": (2, 2)}
VOCAB, LENGTH, BATCH, STEPS = 64, 16, 4, 2

dist.init_process_group("neuron", timeout=timedelta(seconds=120))
LOCAL_RANK = int(os.environ["LOCAL_RANK"])
DEVICE = torch.device("neuron", LOCAL_RANK)
torch.neuron.set_device(LOCAL_RANK)  # type: ignore[attr-defined]  # the stand-in's device module
CONFIG = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=LENGTH,
    tie_word_embeddings=False,
)
CONFIG._attn_implementation = "sdpa"


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()


def train(shape: tuple[int, int], compiled: bool) -> dict:
    torch.manual_seed(0)
    net = LlamaForCausalLM(CONFIG).to(DEVICE)
    mesh = init_device_mesh("neuron", shape, mesh_dim_names=("data_parallel", "tensor_parallel"))
    parallelize(net, mesh, activation_checkpointing=True, compiled=compiled)
    dp, tp = mesh["data_parallel"], mesh["tensor_parallel"]
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    mask = causal_mask(LENGTH, "sdpa", torch.float32, DEVICE)
    losses, graphs_at = [], [graphs()]
    breaks = sum(counters["graph_break"].values())
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=data)
        ids = ids.chunk(dp.size())[dp.get_local_rank()].to(DEVICE)  # this rank's share of the global batch
        logits = net(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with loss_parallel() if tp.size() > 1 else contextlib.nullcontext():
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(full(loss).item())
        graphs_at.append(graphs())
    return {
        "losses": losses,
        "weights": {name: full(value) for name, value in net.state_dict().items()},
        "first_step_graphs": graphs_at[1] - graphs_at[0],
        "later_graphs": graphs_at[-1] - graphs_at[1],
        "graph_breaks": sum(counters["graph_break"].values()) - breaks,
    }


report = {}
for name, shape in MESHES.items():
    eager, compiled = train(shape, compiled=False), train(shape, compiled=True)
    report[name] = {
        "eager_losses": eager["losses"],
        "compiled_losses": compiled["losses"],
        "same_keys": list(eager["weights"]) == list(compiled["weights"]),
        "max_weight_difference": max(  # in state_dict order: the keys are compared above
            (e - c).abs().max().item()
            for e, c in zip(eager["weights"].values(), compiled["weights"].values(), strict=True)
        ),
        "eager_graphs": eager["first_step_graphs"] + eager["later_graphs"],
        **{key: compiled[key] for key in ("first_step_graphs", "later_graphs", "graph_breaks")},
    }
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
dist.destroy_process_group()
