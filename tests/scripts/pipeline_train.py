"""Worker script for tests/strategies/test_pipeline.py: a small decoder-style token model trained with pipeline
parallelism (`lightning_trn.pipeline_split` in `configure_model`, `Pipeline.step` in `training_step`), optionally
with FSDP2 or tensor parallelism inside each stage, or with HSDP replicas; `--accelerator cpu` is the reference,
the same LightningModule under Lightning's own `ModelParallelStrategy` in one process (no stages: `Pipeline.step` is
the forward and the loss, Lightning's backward follows).

AdamW, gradient clipping (active), accumulation 2 and a per-step LR schedule; 8 sequences per optimizer step in
total whatever the mesh, so every layout computes the same steps. Writes to --out from rank 0: `run.json` (the loss
of every batch and of every validation batch) and `weights.pt` (the full state dict at the end); with --save, a
checkpoint after optimizer step 3 (`step=3.ckpt`, a torch.distributed.checkpoint directory); with --kill as well, the
job then dies by SIGKILL (rank 0 kills the process group once the checkpoint is committed, as a node failure would),
one step before its end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from model_parallel_train import ACCUMULATE, CLIP, GLOBAL_BATCH, LENGTH, SEED, SEQUENCES, VOCAB, WIDTH, Block
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_trn
from lightning_trn import NeuronModelParallelStrategy
from lightning_trn.fabric import NeuronModelParallelStrategy as FabricNeuronModelParallelStrategy

# `Block` and the data and optimizer settings are those of tests/scripts/model_parallel_train.py (one token model
# family for both scripts); here with 4 blocks, to divide over up to 4 stages
BLOCKS = 4


class PipeNet(nn.Module):
    """TorchTitan's convention: the forward runs the children and layers this stage holds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embedding(x) if self.embedding is not None else x
        for block in self.blocks:
            x = block(x)
        x = self.norm(x) if self.norm is not None else x
        return self.head(x) if self.head is not None else x


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def parallelize(part: nn.Module, mesh: object) -> None:
    """Tensor parallel inside the TP group, then FSDP2 over the data-parallel ranks (HSDP with replicas)."""
    names = mesh.mesh_dim_names  # type: ignore[attr-defined]
    tp = mesh["tensor_parallel"]  # type: ignore[index]
    dp = mesh["replicate", "data_parallel"] if "replicate" in names else mesh["data_parallel"]  # type: ignore[index]
    if tp.size() > 1:
        plan = {}
        if part.embedding is not None:
            plan["embedding"] = RowwiseParallel(input_layouts=Replicate())
        if part.head is not None:
            plan["head"] = ColwiseParallel(output_layouts=Replicate())
        if plan:
            parallelize_module(part, tp, plan)
        for block in part.blocks:
            parallelize_module(block, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if dp.size() > 1:
        for block in part.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(part, mesh=dp)


class PipelineModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = PipeNet()
        self.pipeline: lightning_trn.Pipeline | None = None
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def configure_model(self) -> None:
        if self.pipeline is not None:
            return
        self.pipeline = lightning_trn.pipeline_split(self.net, next_token_loss, self.trainer.strategy)
        mesh = self.device_mesh
        if mesh.size() > 1:
            for part in self.pipeline.parts:
                parallelize(part, mesh)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (tokens,) = batch
        assert self.pipeline is not None
        return self.pipeline.step(tokens[:, :-1], target=tokens[:, 1:])

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (tokens,) = batch
        assert self.pipeline is not None
        self.val_losses.append(float(self.pipeline.eval(tokens[:, :-1], target=tokens[:, 1:])))

    def predict_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (tokens,) = batch
        assert self.pipeline is not None
        return self.pipeline.predict(tokens[:, :-1])

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def mesh_arguments(args: argparse.Namespace) -> dict:
    return {
        "data_parallel_size": args.dp,
        "tensor_parallel_size": args.tp,
        "pipeline_parallel_size": args.pp,
        "replicate_size": args.replicate,
        "pipeline_schedule": args.schedule,
    }


def strategy(args: argparse.Namespace) -> object:
    if args.accelerator == "cpu":
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    return NeuronModelParallelStrategy(**mesh_arguments(args))


def train_with_fabric(args: argparse.Namespace, data: TensorDataset) -> tuple[dict, dict, int]:
    """The Trainer's job as a Fabric loop: `parallelize_fn` splits the model; the loop calls `pipeline.step` and
    `fabric.backward` (which the pipeline's step makes a no-op), clips and steps every ACCUMULATE batches."""
    pipelines: list[lightning_trn.Pipeline] = []

    def accumulated_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return next_token_loss(logits, target) / ACCUMULATE

    def parallelize_fn(module: nn.Module, mesh: object) -> nn.Module:
        pipelines.append(lightning_trn.pipeline_split(module, accumulated_loss, fabric.strategy))
        if mesh.size() > 1:  # type: ignore[attr-defined]
            for part in pipelines[0].parts:
                parallelize(part, mesh)
        return module

    fabric_strategy = (
        FabricModelParallelStrategy(parallelize_fn, 1, 1)
        if args.accelerator == "cpu"
        else FabricNeuronModelParallelStrategy(parallelize_fn, **mesh_arguments(args))
    )
    devices = args.pp * args.dp * args.replicate * args.tp
    fabric = Fabric(accelerator=args.accelerator, devices=devices, strategy=fabric_strategy)
    fabric.launch()
    fabric.seed_everything(SEED)
    model = fabric.setup_module(PipeNet().to(torch.float64 if args.float64 else torch.float32))
    (pipeline,) = pipelines
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    optimizer = fabric.setup_optimizers(optimizer)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // ACCUMULATE, sampler=sampler)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    losses = []
    for index, (tokens,) in enumerate(loader):
        if index == args.steps * ACCUMULATE:
            break
        loss = pipeline.step(tokens[:, :-1], target=tokens[:, 1:])
        fabric.backward(loss)
        losses.append(float(loss))
        if (index + 1) % ACCUMULATE == 0:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {f"net.{name}": value.cpu() for name, value in state.items()}  # the LightningModule's names
    return state, {"losses": losses}, fabric.global_rank


def kill_after_the_save(trainer: pl.Trainer) -> None:
    """SIGKILL the job's processes once the checkpoint is committed: `Trainer.save_checkpoint` returns on rank 0 after
    its commit (a synchronous save)."""
    save = trainer.save_checkpoint

    def save_then_kill(*args: Any, **kwargs: Any) -> None:
        save(*args, **kwargs)
        if trainer.global_rank == 0:
            os.killpg(os.getpgrp(), signal.SIGKILL)

    trainer.save_checkpoint = save_then_kill  # type: ignore[method-assign]  # wraps this Trainer's save only


def train_with_trainer(args: argparse.Namespace, data: TensorDataset) -> tuple[dict, dict, int]:
    data_ranks = args.dp * args.replicate
    callbacks = (
        [ModelCheckpoint(args.out, filename="{step}", every_n_train_steps=3, save_top_k=-1)] if args.save else []
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.pp * data_ranks * args.tp,
        strategy=strategy(args),
        max_steps=args.steps,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        limit_val_batches=2 if args.validate else 0,
        val_check_interval=4,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=args.save,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if args.kill:
        kill_after_the_save(trainer)
    # float64: Lightning's ModelParallelStrategy refuses precision="64-true"; the cast is what that plugin would do
    model = PipelineModel().to(torch.float64 if args.float64 else torch.float32)
    per_rank = GLOBAL_BATCH // data_ranks // ACCUMULATE
    train = DataLoader(data, batch_size=per_rank, shuffle=True)
    val = DataLoader(TensorDataset(data.tensors[0][:16]), batch_size=GLOBAL_BATCH // data_ranks)
    trainer.fit(model, train, val, ckpt_path=args.resume)
    predictions = []
    if args.predict:  # the logits of 8 sequences, in 2 batches, summed (every rank gets the last stage's)
        outputs = trainer.predict(model, DataLoader(TensorDataset(data.tensors[0][:8]), batch_size=4))
        predictions = [float(logits.double().sum()) for logits in outputs]
    # full tensors on every rank (not only rank 0: a pipeline rank holds its stages' parameters only)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {name: value.cpu() for name, value in state.items()}
    run = {"losses": model.losses, "val_losses": model.val_losses, "predictions": predictions}
    return state, run, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("trainer", "fabric"), default="trainer")
    parser.add_argument("--accelerator", default="neuron")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--float64", action="store_true", help="the reference's float64 twin (tests/tolerance.py)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps in all")
    parser.add_argument("--validate", action="store_true", help="2 validation batches at the end")
    parser.add_argument("--save", action="store_true", help="a checkpoint after optimizer step 3")
    parser.add_argument("--kill", action="store_true", help="with --save: SIGKILL the job once it is committed")
    parser.add_argument("--predict", action="store_true", help="Trainer: `trainer.predict` on 8 sequences after fit")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    pl.seed_everything(SEED)
    tokens = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(SEED))
    state, run, rank = (train_with_trainer if args.api == "trainer" else train_with_fabric)(args, TensorDataset(tokens))
    if args.pp > 1:  # every stage's parameters, gathered
        gathered: list[dict] = [{} for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(gathered, state)
        state = {name: value for part in gathered for name, value in part.items()}
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "weights.pt")
        (out / "run.json").write_text(json.dumps(run))


if __name__ == "__main__":
    main()
