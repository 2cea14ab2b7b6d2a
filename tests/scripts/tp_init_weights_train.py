"""Worker script for tests/strategies/test_dtensor_random.py: the shape of Lightning's
`examples/pytorch/tensor_parallel` (a small Llama-like model, TorchTitan's tensor-parallel plan with sequence
parallel norms, FSDP2 over the data-parallel mesh, `init_weights()` in `on_train_start`, i.e. random ops on DTensors
after parallelization, and `loss_parallel` around the loss and its backward), dp 2 x tp 2 on 4 processes.

`--accelerator cpu` is Lightning's own run on gloo (the reference); `--accelerator neuron` the same script on the
stand-in. Each rank writes `rank<r>.pt`: its mesh coordinate, its local shards of two initialized weights, the local
values of random ops on a (Replicate, Shard) DTensor (normal_, dropout, a user generator), a digest of its device
generator's state after them, and whether `nn.Dropout` refused a plain tensor. Rank 0 writes `run.json`: the loss of
every step and whether torch's DTensor random-op tracker was back to its original after `fit`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor import _random as dtensor_random
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.data import DataLoader

import lightning_trn  # noqa: F401  registers accelerator="neuron"

SEED = 42
VOCAB, DIM, HEADS, LAYERS, LENGTH, BATCH, STEPS = 512, 64, 4, 2, 64, 64, 6
SEQUENCES = BATCH * STEPS


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (batch, length, heads, head_dim), in real arithmetic."""
    half = x.shape[-1] // 2
    frequencies = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)[:, None] * frequencies
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (w(x).view(batch, length, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q), rotary(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(i) for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std = DIM**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: Transformer, device_mesh) -> Transformer:  # type: ignore[no-untyped-def]
    """TorchTitan's plan, as Lightning's example has it (loss_parallel: the logits stay sharded on the classes)."""
    dp_mesh, tp_mesh = device_mesh["data_parallel"], device_mesh["tensor_parallel"]
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().contiguous().numpy().tobytes()).hexdigest()


class Llama(pl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.model = Transformer()
        self.out = out
        self.losses: list[float] = []
        self.dropout = nn.Dropout(0.5)  # used only in `on_train_start`, on a DTensor and on a plain tensor

    def configure_model(self) -> None:
        parallelize(self.model, self.device_mesh)

    def on_train_start(self) -> None:
        self.model.init_weights()
        mesh = self.device_mesh
        record = {
            "coordinate": mesh.get_coordinate(),
            "wq": self.model.layers["0"].attention.wq.weight.to_local().cpu(),
            "embedding": self.model.tok_embeddings.weight.to_local().cpu(),
        }
        # random ops on a DTensor replicated over data_parallel, sharded over tensor_parallel
        placements = [Replicate(), Shard(0)]
        x = distribute_tensor(torch.zeros(8, 6, device=self.device), mesh, placements)
        record["normal"] = x.normal_().to_local().cpu()
        record["dropout"] = self.dropout(x).to_local().cpu()
        try:
            self.dropout(torch.ones(4, device=self.device))
            record["plain_dropout_refused"] = False
        except RuntimeError as error:
            record["plain_dropout_refused"] = "tensor-parallel" in str(error)
        generator = torch.Generator(self.device).manual_seed(7) if self.device.type != "cpu" else None
        if generator is not None:
            record["user_generator"] = torch.empty_like(x).uniform_(generator=generator).to_local().cpu()
            record["user_generator_state"] = _digest(generator.get_state())
            record["device_state"] = _digest(torch.get_device_module(self.device.type).get_rng_state())
        torch.save(record, self.out / f"rank{self.global_rank}.pt")

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        output = self.model(inputs)
        with loss_parallel():
            return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    def backward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with loss_parallel():
            super().backward(*args, **kwargs)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        loss = outputs["loss"].detach()
        self.losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="neuron")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    pl.seed_everything(SEED)
    tokens = torch.randint(0, VOCAB, (SEQUENCES, LENGTH + 1), generator=torch.Generator().manual_seed(SEED))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=4,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
    )
    with trainer.init_module(empty_init=True):
        model = Llama(out)
    trainer.fit(model, DataLoader(tokens, batch_size=BATCH // 2, shuffle=True))
    if trainer.global_rank == 0:
        run = {
            "losses": model.losses,
            "strategy": type(trainer.strategy).__name__,
            "tracker_restored": dtensor_random._rng_tracker is None,
        }
        (out / "run.json").write_text(json.dumps(run))


if __name__ == "__main__":
    main()
