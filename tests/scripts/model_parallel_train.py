"""Worker script for tests/strategies/test_model_parallel.py: a small decoder-style token model sharded with FSDP2
(`fully_shard` on the data-parallel mesh) and tensor parallelism (`parallelize_module`, `loss_parallel`) in
`configure_model`, written as for GPUs with Lightning's `ModelParallelStrategy`; `--accelerator cpu` is Lightning's
own run on gloo (the reference), `--accelerator neuron` the same script on the `neuron` device. `--api fabric`: the
same job as a Fabric loop (`ModelParallelStrategy(parallelize_fn)`, `fabric.clip_gradients`, `fabric.save`).
`--fsdp FULL_SHARD` (or another sharding strategy): the job as a Lightning FSDP script, `FSDPStrategy` with the
blocks as auto-wrap and activation-checkpointing units, no `configure_model` sharding; what its setup sends to the
device is recorded (`setup_transfer`).

AdamW, gradient clipping (active), accumulation 2 and a per-step LR schedule; 8 sequences per optimizer step in
total whatever the mesh (each data-parallel rank takes 8 / dp), so every mesh computes the same steps. Writes to
--out from rank 0: `run.json` (the loss of every micro-batch, the strategy's class, the parameters' dtypes as seen in
training) and `weights.pt` (the full state dict at the end); with --save, a checkpoint after optimizer step 3
(`step=3.ckpt`, a torch.distributed.checkpoint directory unless --full).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_trn  # noqa: F401  registers accelerator="neuron"

SEED = 1234
VOCAB, WIDTH, LENGTH, BLOCKS = 64, 32, 12, 2
SEQUENCES, GLOBAL_BATCH, ACCUMULATE, CLIP = 64, 8, 2, 0.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.w1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.w2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    """What a GPU user writes: tensor parallel inside the TP group, then FSDP2 over the data-parallel group."""
    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]  # type: ignore[index]
    if tp.size() > 1:
        parallelize_module(
            model,
            tp,
            {
                "embedding": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
            },
        )
        for block in model.blocks:  # type: ignore[union-attr]
            parallelize_module(block, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if dp.size() > 1:
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)  # the same initial weights whatever the API drew from the generator before
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def optimizer_and_schedule(module: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    # foreach=False: with tensor parallel only, norms stay plain tensors beside DTensors, which the foreach kernels
    # cannot mix (on GPUs as well); clipping mixes them (lightning_trn.core.parallel.gradients)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def layout(model: nn.Module) -> dict:
    """How many FSDP units and activation-checkpointed modules the model ended with."""
    return {
        "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
    }


def as_number(loss: torch.Tensor) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


class TokenModel(pl.LightningModule):
    """Built in `__init__` (on the meta device under `trainer.init_module(empty_init=True)`), parallelized in
    `configure_model`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TokenNet()
        self.losses: list[float] = []
        self.dtypes: set[str] = set()

    def configure_model(self) -> None:
        mesh = self.device_mesh  # None with a single-device strategy (--single)
        if mesh is not None and mesh.size() > 1 and not isinstance(self.net.head.weight, DTensor):
            parallelize(self.net, mesh)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        self.dtypes.add(str(logits.dtype))
        loss = next_token_loss(logits, tokens)
        self.log("train_loss", loss.full_tensor() if hasattr(loss, "full_tensor") else loss, sync_dist=True)
        return loss

    def backward(self, loss, *args, **kwargs):  # type: ignore[no-untyped-def]
        with loss_parallel():  # its backward too, as torch documents
            super().backward(loss, *args, **kwargs)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(as_number(outputs["loss"]))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer, scheduler = optimizer_and_schedule(self)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SetupTransfer:
    """What a setup sends to this rank's `neuron` device (stand-in counters): started before the model is sharded,
    `record()` after it is set up gives the bytes copied host->device, the allocator's peak over what was allocated
    at the start, and the bytes of the tensors the rank then holds (local shards of DTensors)."""

    def __init__(self, device: torch.device) -> None:
        from lightning_trn import standin

        self.device = device
        standin.reset_counters()
        torch.neuron.reset_peak_memory_stats(device)
        self.allocated = torch.neuron.memory_allocated(device)

    def record(self, model: nn.Module) -> dict:
        from lightning_trn import standin

        tensors = [*model.parameters(), *model.buffers()]
        held = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)
        return {
            "host_to_device_bytes": standin.counters()["host_to_device_bytes"],
            "peak_bytes": torch.neuron.max_memory_allocated(self.device) - self.allocated,
            "held_bytes": held,
        }


class FSDPTokenModel(TokenModel):
    """As a Lightning FSDP script has it: no sharding of its own, the strategy's arguments say what to shard. On
    the stand-in, what the setup sends to the device is recorded (`SetupTransfer`), from the `setup` hook, which
    runs before the strategy shards the model, to `on_fit_start`, after it is set up."""

    def configure_model(self) -> None:
        pass

    def setup(self, stage: str) -> None:
        self.transfer = SetupTransfer(self.trainer.strategy.root_device)

    def on_fit_start(self) -> None:
        self.setup_transfer = self.transfer.record(self)


def fsdp_arguments(args: argparse.Namespace) -> dict:
    """`FSDPStrategy` arguments: each block a unit of its own, recomputed in backward."""
    mesh = {"device_mesh": (args.dp // 2, 2)} if "HYBRID" in args.fsdp else {}
    return {
        "auto_wrap_policy": {Block},
        "activation_checkpointing_policy": {Block},
        "sharding_strategy": args.fsdp,
        **mesh,
    }


def train_with_fabric(args: argparse.Namespace, loader: DataLoader) -> tuple[dict, dict]:
    """The Trainer's job as a Fabric loop: `fabric.setup` parallelizes, the loop accumulates and clips."""
    strategy = (
        FabricFSDPStrategy(**fsdp_arguments(args))
        if args.fsdp
        else FabricModelParallelStrategy(parallelize, args.dp, args.tp)
    )
    fabric = Fabric(
        accelerator=args.accelerator, devices=args.dp * args.tp, precision=args.precision, strategy=strategy
    )
    fabric.launch()
    fabric.seed_everything(SEED)
    with fabric.init_module(empty_init=args.meta):
        model = TokenNet().to(torch.float64 if args.float64 else torch.float32)
    transfer = SetupTransfer(fabric.device) if args.fsdp else None
    model = fabric.setup_module(model)  # sharding replaces the parameters: the optimizer comes after
    setup_transfer = {"setup_transfer": transfer.record(model)} if transfer else {}
    optimizer, scheduler = optimizer_and_schedule(model)
    optimizer = fabric.setup_optimizers(optimizer)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    losses, dtypes = [], set()
    for index, (tokens,) in enumerate(loader):
        if index == args.steps * ACCUMULATE:
            break
        if args.dp > 1:  # each data-parallel rank takes its share of the batch
            rank = fabric.global_rank if args.fsdp else fabric.strategy.device_mesh["data_parallel"].get_local_rank()
            tokens = tokens[rank :: args.dp]
        logits = model(tokens[:, :-1])
        dtypes.add(str(logits.dtype))
        loss = next_token_loss(logits, tokens)
        with loss_parallel():
            fabric.backward(loss / ACCUMULATE)
        losses.append(as_number(loss) / ACCUMULATE)  # as the Trainer reports it
        if (index + 1) % ACCUMULATE == 0:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    fabric.save(Path(args.out) / "fabric.ckpt", {"model": model, "optimizer": optimizer})
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = {f"net.{name}": value for name, value in state.items()}  # the LightningModule's names
    return state, {
        "losses": losses,
        "strategy": type(fabric.strategy).__name__,
        "dtypes": sorted(dtypes),
        "rank": fabric.global_rank,
        **layout(model),
        **setup_transfer,
    }


def train_with_trainer(args: argparse.Namespace, loader: DataLoader) -> tuple[dict, dict]:
    strategy = (
        "auto"
        if args.single
        else ModelParallelStrategy(
            data_parallel_size=args.dp, tensor_parallel_size=args.tp, save_distributed_checkpoint=not args.full
        )
    )
    if args.fsdp:
        strategy = FSDPStrategy(**fsdp_arguments(args), state_dict_type="full" if args.full else "sharded")
    callbacks = (
        [
            ModelCheckpoint(
                args.out, filename="step={step}", every_n_train_steps=3, save_top_k=-1, auto_insert_metric_name=False
            )
        ]
        if args.save
        else []
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.dp * args.tp,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=args.save,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module(empty_init=args.meta):
        model = FSDPTokenModel() if args.fsdp else TokenModel()
    # float64: Lightning's ModelParallelStrategy refuses precision="64-true"; the cast is what that plugin would do
    model = model.to(torch.float64 if args.float64 else torch.float32)
    per_rank = GLOBAL_BATCH // args.dp // ACCUMULATE
    # sharded: Lightning's DistributedSampler (shuffled with the global seed); one device: the same sampler, given
    train = loader if args.single else DataLoader(loader.dataset, batch_size=per_rank, shuffle=True)
    trainer.fit(model, train, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(Path(args.out) / "final.ckpt")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    setup_transfer = {"setup_transfer": model.setup_transfer} if args.fsdp else {}
    return state, {
        "losses": model.losses,
        "strategy": type(trainer.strategy).__name__,
        "dtypes": sorted(model.dtypes),
        "rank": trainer.global_rank,
        **layout(model),
        **setup_transfer,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("trainer", "fabric"), default="trainer")
    parser.add_argument("--accelerator", default="neuron")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps in all")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--float64", action="store_true", help="the reference's float64 twin (tests/tolerance.py)")
    parser.add_argument(
        "--save",
        action="store_true",
        help="Trainer: checkpoints after optimizer steps 3 and 6 and at the end (final.ckpt)",
    )
    parser.add_argument("--full", action="store_true", help="full (one-file) checkpoints")
    parser.add_argument("--resume", default=None, help="Trainer: the checkpoint to resume")
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device")
    parser.add_argument("--single", action="store_true", help="Trainer: one device, the single-device strategy")
    parser.add_argument("--fsdp", default=None, help="FSDPStrategy with this sharding strategy (over --dp devices)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    pl.seed_everything(SEED)
    tokens = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(SEED))
    # the Trainer splits a global batch over the data-parallel ranks by its sampler (Lightning's DistributedSampler,
    # shuffled with the global seed: every mesh sees the same global batches), the Fabric loop by slicing
    data = TensorDataset(tokens)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // ACCUMULATE, sampler=sampler)
    state, run = (train_with_trainer if args.api == "trainer" else train_with_fabric)(args, loader)
    if run.pop("rank") == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "weights.pt")
        (out / "run.json").write_text(json.dumps(run))


if __name__ == "__main__":
    main()
