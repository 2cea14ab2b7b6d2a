"""Worker script for tests/checkpoint/test_pretrained_sharded.py: a `save_pretrained` folder loaded into a model built
on
the meta device (`meta_model_from_pretrained`) and parallelized on stand-in `neuron` devices, `load_pretrained` called
after sharding; the strategy's `materialize`, which runs afterwards, then finds nothing to draw.

`--trainer`: the Trainer's `NeuronModelParallelStrategy`, a LightningModule holding the model as `self.model` and
loading it in `configure_model`, FSDP2 over `data_parallel` (each decoder layer and the root), logits from
`trainer.predict`. Otherwise Fabric's, loading at the end of `parallelize_fn`, tensor parallelism first when `--tp 2`
(attention and MLP projections column/row-wise: FSDP2 then shards them `_StridedShard`). Each rank writes to --out
`run-<rank>.json`: the bytes it read from the files (counted at `safetensors.safe_open`) and the bytes it holds,
its host memory while loading (`HostPeak`: the peak over VmRSS before, the largest transient of a read), whether
the embeddings are tied; and its logits for fixed token ids (`logits-<rank>.pt`).

`--warmup DIR` (with `--trainer`): first load the small folder DIR the same way (built on meta, sharded on the same
mesh), unmeasured, so that the measured load finds the process's one-time costs paid: the code pages of torch's,
transformers' and safetensors' functions that run for the first time (file-backed: VmRSS counts them) and the caches
those functions fill. That load's own peak is recorded as `warmup_peak_bytes`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import safetensors  # noqa: F401  its extension's code pages load here, before the memory measured while loading
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.core.checkpoint import pretrained, safetensors_blocks
from lightning_trn.fabric import NeuronModelParallelStrategy as FabricModelParallelStrategy
from lightning_trn.pytorch.strategies import NeuronModelParallelStrategy
from tests.standin.safetensors_reads import counting_reads


def status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def shard(model: torch.nn.Module, mesh: Any, tp: int) -> None:
    """Tensor parallel projections when `tp` > 1, then FSDP2 on each decoder layer and the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tp > 1:
        plan = {
            **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tensor_parallel"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])


class HostPeak:
    """This process's host memory while a load runs, from `/proc/self/status`: VmHWM sampled at each `sample()` (each
    read of a block) and at the end, restarted after each sample (`clear_refs`). `peak`: the highest, over VmRSS at
    the start; `transient`: the most any stretch between two samples rose above VmRSS at its end (a block read, its
    file pages and copy, freed once copied into the shard, whose pages stay)."""

    def __init__(self) -> None:
        self.restart()
        self.start = self.high = status_kib("VmRSS")
        self.transient = 0

    @staticmethod
    def restart() -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from VmRSS

    def sample(self) -> None:
        high, now = status_kib("VmHWM"), status_kib("VmRSS")
        self.high, self.transient = max(self.high, high), max(self.transient, high - now)
        self.restart()

    def finish(self) -> dict[str, int]:
        self.sample()
        return {"peak": (self.high - self.start) * 1024, "transient": self.transient * 1024}


def sampled(load: Any) -> dict[str, int]:
    """`load()` under a `HostPeak` sampling at each `safetensors_blocks.read_block`."""
    host, read_block = HostPeak(), safetensors_blocks.read_block

    def read_sampled(*args: Any) -> torch.Tensor:
        host.sample()
        return read_block(*args)

    safetensors_blocks.read_block = read_sampled
    try:
        load()
    finally:
        safetensors_blocks.read_block = read_block
    return host.finish()


def measured_load(module: torch.nn.Module, path: str, record: dict, **kwargs: Any) -> None:
    """`load_pretrained`, recording this process's host peak over its resident memory before and the largest
    transient of a read (`HostPeak`), the bytes read and held, and whether the embeddings are tied."""
    with counting_reads() as reads:
        host = sampled(lambda: pretrained.load_pretrained(module, path, **kwargs))
    record.update(load_peak_bytes=host["peak"], read_transient_bytes=host["transient"])
    record["read_bytes"] = reads.bytes
    named = dict(module.named_parameters())  # before any forward, which leaves the root's parameters unsharded
    record["held_bytes"] = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in named.values())
    model = module.model if isinstance(module, FineTune) else module
    record["tied"] = model.lm_head.weight is model.model.embed_tokens.weight


class FineTune(pl.LightningModule):
    """The documented use: the Hugging Face model built on meta in `__init__`, sharded and loaded in
    `configure_model` (prefix `model.` found, device the strategy's)."""

    def __init__(self, path: str, record: dict, warmup: str | None) -> None:
        super().__init__()
        self.path, self.record, self.warmup = path, record, warmup
        self.model = pretrained.meta_model_from_pretrained(path, attn_implementation="eager")

    def configure_model(self) -> None:
        if self.warmup:
            small = pretrained.meta_model_from_pretrained(self.warmup, attn_implementation="eager")
            shard(small, self.device_mesh, tp=1)
            device = self.trainer.strategy.root_device
            self.record["warmup_peak_bytes"] = sampled(
                lambda: pretrained.load_pretrained(small, self.warmup, device=device)
            )["peak"]
        shard(self.model, self.device_mesh, tp=1)
        measured_load(self, self.path, self.record)

    def predict_step(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--trainer", action="store_true")
    parser.add_argument("--warmup", help="a small folder loaded first, unmeasured (with --trainer)")
    args = parser.parse_args()
    out = Path(args.out)
    record: dict = {}
    ids = torch.arange(14).reshape(2, 7) * 7
    if args.trainer:
        module = FineTune(args.model, record, args.warmup)
        trainer = pl.Trainer(
            accelerator="neuron",
            devices=args.dp,
            strategy=NeuronModelParallelStrategy(data_parallel_size=args.dp, tensor_parallel_size=1),
            logger=False,
            enable_progress_bar=False,
            use_distributed_sampler=False,
        )
        ids %= module.model.config.vocab_size
        logits = trainer.predict(module, DataLoader([ids], batch_size=None))[0]
        rank = trainer.global_rank
    else:

        def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
            shard(model, mesh, args.tp)
            measured_load(model, args.model, record, device=fabric.device)
            return model

        strategy = FabricModelParallelStrategy(parallelize, data_parallel_size=args.dp, tensor_parallel_size=args.tp)
        fabric = Fabric(accelerator="neuron", devices=args.dp * args.tp, strategy=strategy)
        fabric.launch()
        meta = pretrained.meta_model_from_pretrained(args.model, attn_implementation="eager")
        model, rank = fabric.setup_module(meta).module, fabric.global_rank
        ids %= model.config.vocab_size
        with torch.no_grad():
            logits = model(ids.to(fabric.device)).logits
    torch.save(logits.cpu(), out / f"logits-{rank}.pt")
    (out / f"run-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
