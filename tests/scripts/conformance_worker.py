"""Worker of the parallel conformance sweep (`tests/conformance_parallel.py`): runs a list of cells (model family x
layout x training event) one after another in one job, and writes each cell's outcome to `--out/cells.jsonl` (rank 0)
as soon as it ends: the final weights (gathered over every rank, `weights-<cell>.pt`), the training losses, the
validation losses and the predictions per sample, or the refusal (an exception raised on every rank before the
cell's first update).

One layout per job: `--accelerator neuron` runs `--world` ranks on the stand-in (this process is rank 0 and starts
the others with Lightning's environment variables, so each Trainer takes them as launched); `--accelerator cpu` is
the one-device reference, Lightning's own `ModelParallelStrategy` in one process (no stages: `Pipeline.step` is the
forward and the loss), in float32 or, `--float64`, the float64 twin that measures the reference's own rounding error.

The data: every cell reads the same 8 sequences per optimizer step (`GLOBAL_BATCH`) whatever the layout. Lightning
gives each distributed training loader a `DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)`; data-parallel rank
r's k-th batch is positions r, r + D, ... of that sampler's permutation inside the k-th block of `GLOBAL_BATCH`, so the
data-parallel ranks together read exactly the block that the reference reads as one batch when its sampler is the same
permutation on one replica (`DistributedSampler(num_replicas=1, rank=0, shuffle=True, seed=SEED)`). Stages and
tensor-parallel ranks read their data-parallel rank's batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model_parallel_train import LENGTH, VOCAB, WIDTH, Block
from pipeline_train import PipeNet

import lightning_trn
from lightning_trn import NeuronModelParallelStrategy
from tests.conformance_parallel import EVENTS, LAYOUTS, Cell

SEED = 1234
#: what a refusal raises (on every rank, before the cell's first batch); anything else ends the job
REFUSALS = (ValueError, NotImplementedError)
#: optimizer steps the current cell has run (a refusal comes before the first update; of `predict`, before it runs)
STEPS_RUN = [0]
LAYERS = 4  # pipeline_train.PipeNet's too: 2 stages x 2 per rank
GLOBAL_BATCH = 8
LR = 0.01


#: the Hugging Face families' sequence length: a multiple of 8, so that context parallel 4 cuts it into 2 x 4 chunks
HF_LENGTH = 16


class Tokens(Dataset):
    """`count` random sequences with their index (predictions are compared per sample)."""

    def __init__(self, count: int, length: int = LENGTH) -> None:
        self.tokens = torch.randint(0, VOCAB, (count, length), generator=torch.Generator().manual_seed(SEED))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.tokens[index]


class UserNet(PipeNet):
    """The module docs/sharding.md shows (tests/scripts/pipeline_train.py's): embedding, a ModuleList of blocks,
    norm, head; the forward skips what a stage lacks."""

    layers = "blocks"

    def tensor_parallel(self, mesh: Any) -> None:
        plan = {}
        if self.embedding is not None:
            plan["embedding"] = RowwiseParallel(input_layouts=Replicate())
        if self.head is not None:
            plan["head"] = ColwiseParallel(output_layouts=Replicate())
        if plan:
            parallelize_module(self, mesh, plan)
        for block in self.blocks:
            parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)


class NanoGPT(nn.Module):
    """nanoGPT's layout: `transformer = ModuleDict(wte, wpe, h, ln_f)` and a head tied to the token embedding."""

    layers = "transformer.h"

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "wpe": nn.Embedding(LENGTH, WIDTH),
                "h": nn.ModuleList(Block() for _ in range(LAYERS)),
                "ln_f": nn.LayerNorm(WIDTH),
            }
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, as nanoGPT
        for embedding in (self.transformer.wte, self.transformer.wpe):
            nn.init.normal_(embedding.weight, std=0.02)  # nanoGPT's init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        if t["wte"] is not None:  # a stage without the embeddings takes hidden states
            positions = torch.arange(x.shape[1], device=x.device)
            x = t["wte"](x) + t["wpe"](positions)
        for block in t["h"]:
            x = block(x)
        x = t["ln_f"](x) if t["ln_f"] is not None else x
        return self.lm_head(x) if self.lm_head is not None else x

    def tensor_parallel(self, mesh: Any) -> None:
        for block in self.transformer.h:
            parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.transformer.h)


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, 1).float() if logits.dtype == torch.bfloat16 else logits.flatten(0, 1), target.flatten()
    )


class TokenLM(pl.LightningModule):
    """A user's LightningModule around `net` (`UserNet` or `NanoGPT`): `configure_model` splits it into the strategy's
    stages and shards each part; `training_step` calls the pipeline, which calls the submodule."""

    def __init__(self, net_class: type[nn.Module], dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.net = net_class().to(dtype)
        self.pipeline: lightning_trn.Pipeline | None = None
        self.record: dict[str, Any] = {"losses": [], "val_losses": [], "predictions": {}}

    def configure_model(self) -> None:
        if self.pipeline is not None:
            return
        self.pipeline = lightning_trn.pipeline_split(self.net, next_token_loss, self.trainer.strategy, self.net.layers)
        mesh = self.device_mesh
        if mesh is None:
            return
        names = mesh.mesh_dim_names
        dp = mesh["replicate", "data_parallel"] if "replicate" in names else mesh["data_parallel"]
        for part in self.pipeline.parts:
            if mesh["tensor_parallel"].size() > 1:
                part.tensor_parallel(mesh["tensor_parallel"])
            if getattr(self, "compiled", False):
                lightning_trn.compile_blocks(part.fsdp_units())
            if dp.size() > 1:
                for unit in part.fsdp_units():
                    fully_shard(unit, mesh=dp)
                fully_shard(part, mesh=dp)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, tokens = batch
        assert self.pipeline is not None
        return self.pipeline.step(tokens[:, :-1], target=tokens[:, 1:])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, tokens = batch
        assert self.pipeline is not None
        self.record["val_losses"].append(float(self.pipeline.eval(tokens[:, :-1], target=tokens[:, 1:])))

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        index, tokens = batch
        assert self.pipeline is not None
        logits = self.pipeline.predict(tokens[:, :-1])
        return {int(i): float(row.double().sum()) for i, row in zip(index, logits, strict=True)}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.record["losses"].append(float(outputs["loss"]))
        STEPS_RUN[0] = self.trainer.global_step

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def pretrained_folder(root: Path, model_type: str, tied: bool) -> Path:
    """A tiny random Hugging Face model of `model_type` saved with `save_pretrained` (made once per job)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = root / f"{model_type}{'-tied' if tied else ''}"
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 writes it whole, then renames it into place
        while not folder.exists():
            time.sleep(0.1)
        return folder
    if not folder.exists():
        config = AutoConfig.for_model(
            model_type,
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=2 * WIDTH,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=WIDTH // 4,
            max_position_embeddings=HF_LENGTH,
            tie_word_embeddings=tied,
        )
        torch.manual_seed(SEED)
        partial = folder.with_name(folder.name + ".partial")
        AutoModelForCausalLM.from_config(config).save_pretrained(partial)
        partial.rename(folder)
    return folder


def packed_positions(index: torch.Tensor, length: int) -> torch.Tensor:
    """Position ids of packed sequences (the `llama_packed` family): three documents per sequence, their boundaries
    moving with the sample's index, each document's positions from 0."""
    rows = []
    for i in index.tolist():
        first, second = 3 + i % 5, 9 + i % 4
        rows.append(torch.cat([torch.arange(first), torch.arange(second - first), torch.arange(length - second)]))
    return torch.stack(rows).to(index.device)


def hugging_face_module(folder: Path, dtype: torch.dtype, packed: bool = False) -> pl.LightningModule:
    """The LLM recipe's own LightningModule on a pretrained folder (`model.pretrained=DIR`), with a `predict_step` and
    a record of the losses (what a user's subclass adds). Its batches become the recipe's dicts once on the device
    (`on_after_batch_transfer`), before a context-parallel strategy splits them; `packed`: with position ids of
    three documents per sequence (`packed_positions`), a document's first token unlabelled."""
    from lightning_trn.recipes.llm.model import CausalLM

    class RecordedCausalLM(CausalLM):
        def __init__(self) -> None:
            super().__init__(pretrained=str(folder), seq_len=HF_LENGTH, lr=LR, warmup_steps=1)
            self.net.to(dtype)
            self.record: dict[str, Any] = {"losses": [], "val_losses": [], "predictions": {}}

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> dict[str, torch.Tensor]:
            index, tokens = batch
            if not packed:
                return {"index": index, "input_ids": tokens, "labels": tokens}
            positions = packed_positions(index, tokens.shape[1])
            labels = tokens.masked_fill(positions == 0, -100)
            return {"index": index, "input_ids": tokens, "labels": labels, "position_ids": positions}

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            total, count = lightning_trn.sequence_sums(*self.loss_sum(batch))
            self.record["val_losses"].append(float(total / count))

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            index, tokens = batch["index"], batch["input_ids"]
            if self._pipeline is not None:
                logits = self._pipeline.predict(tokens)
            else:
                logits = self(tokens, batch.get("position_ids"))
                logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
            return {int(i): float(row.double().sum()) for i, row in zip(index, logits, strict=True)}

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.record["losses"].append(float(outputs["loss"]))
            STEPS_RUN[0] = self.trainer.global_step

    return RecordedCausalLM()


def build_module(cell: Cell, dtype: torch.dtype, root: Path) -> pl.LightningModule:
    pl.seed_everything(SEED, verbose=False)
    family = cell.family
    if family == "user":
        module: pl.LightningModule = TokenLM(UserNet, dtype)
    elif family == "nanogpt_tied":
        module = TokenLM(NanoGPT, dtype)
    else:
        model_type, _, variant = family.partition("_")
        folder = pretrained_folder(root, model_type, variant == "tied")
        module = hugging_face_module(folder, dtype, packed=variant == "packed")
    module.compiled = LAYOUTS.get(cell.layout, {}).get("compile", False)  # type: ignore[assignment]
    return module


def strategy_for(cell: Cell, accelerator: str) -> Any:
    if accelerator == "cpu":
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    layout = dict(LAYOUTS[cell.layout])
    if layout.get("strategy") == "ddp":
        return "ddp"
    return NeuronModelParallelStrategy(
        data_parallel_size=layout.get("dp", 1),
        tensor_parallel_size=layout.get("tp", 1),
        pipeline_parallel_size=layout.get("pp", 1),
        replicate_size=layout.get("replicate", 1),
        pipeline_schedule=layout.get("schedule", "1F1B"),
        context_parallel_size=layout.get("cp", 1),
    )


def data_ranks(cell: Cell, accelerator: str) -> int:
    if accelerator == "cpu":
        return 1
    layout = LAYOUTS[cell.layout]
    if layout.get("strategy") == "ddp":
        return layout["world"]
    return layout.get("dp", 1) * layout.get("replicate", 1)


def loader(dataset: Dataset, cell: Cell, accelerator: str, batch: int, shuffle: bool = True) -> DataLoader:
    """The layout's ranks read `batch` sequences each from Lightning's sampler; the reference reads the same blocks
    (module docstring)."""
    ranks = data_ranks(cell, accelerator)
    if accelerator == "cpu":
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=SEED)
        return DataLoader(dataset, batch_size=batch, sampler=sampler)
    return DataLoader(dataset, batch_size=batch // ranks, shuffle=shuffle)


class AdamInputs(pl.Callback):
    """What AdamW was given at each step of a reference run (`--accelerator cpu`): every parameter's gradient, as the
    optimizer saw it (accumulated, clipped), and its group's settings, by the state dict's names. The sweep derives
    from them how much Adam amplifies each element's gradient rounding (`tests.tolerance.adam_allowance`)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        names: dict[int, list[str]] = {}
        for name, parameter in pl_module.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), []).append(name)

        def record(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            gradients, settings = {}, {}
            for group in optimizer.param_groups:
                setting = (float(group["lr"]), *map(float, group["betas"]), float(group["eps"]))
                setting += (float(group["weight_decay"]),)
                for parameter in group["params"]:
                    if parameter.grad is None:
                        continue
                    for name in names.get(id(parameter), ()):
                        gradients[name] = parameter.grad.detach().to(torch.float64, copy=True)
                        settings[name] = setting
            self.steps.append({"gradients": gradients, "settings": settings})

        optimizer.register_step_pre_hook(record)


class StopAndSave(pl.Callback):
    """Saves a checkpoint after optimizer step `step` and stops the fit there (the `resume` event's interruption)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not self.path.exists():
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def run_cell(cell: Cell, accelerator: str, dtype: torch.dtype, out: Path) -> dict[str, Any]:
    """Train `cell` and return its record, weights gathered on every rank (the pretrained folders in `out`'s parent,
    shared by the sweep's jobs)."""
    models = out.parent / "models"
    event = EVENTS[cell.event]
    layout = LAYOUTS[cell.layout] if accelerator != "cpu" else {"world": 1}
    devices = layout["world"]
    length = LENGTH if cell.family in ("user", "nanogpt_tied") else HF_LENGTH
    dataset = Tokens(event["sequences"], length)

    def trainer(**extra: Any) -> pl.Trainer:
        settings: dict[str, Any] = {
            "accelerator": accelerator,
            "devices": devices,
            "strategy": strategy_for(cell, accelerator),
            "max_steps": event["steps"],
            "max_epochs": event.get("epochs", -1) if "steps" not in event else -1,
            "accumulate_grad_batches": event.get("accumulate", 1),
            "gradient_clip_val": event.get("clip"),
            "limit_val_batches": 1 if event.get("validate") else 0,
            "val_check_interval": 1 if event.get("validate") else None,
            "num_sanity_val_steps": 0,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        }
        settings.update(extra)
        return pl.Trainer(**settings)

    module = build_module(cell, dtype, models)
    adam = AdamInputs()  # a reference's optimizer inputs (`--accelerator cpu`); a layout's are not compared
    recorded = [adam] if accelerator == "cpu" else []
    train = loader(dataset, cell, accelerator, GLOBAL_BATCH)
    val = (
        loader(Tokens(GLOBAL_BATCH, length), cell, accelerator, GLOBAL_BATCH, shuffle=False)
        if event.get("validate")
        else None
    )
    if event.get("resume"):
        checkpoint = out / f"{cell.name}-{accelerator}-{dtype}.ckpt"
        trainer(callbacks=[StopAndSave(checkpoint, event["steps"] // 2), *recorded]).fit(module, train, val)
        losses = module.record["losses"]
        module = build_module(cell, dtype, models)
        module.record["losses"] = losses
        trainer(callbacks=recorded).fit(module, train, val, ckpt_path=checkpoint)
    else:
        run = trainer(callbacks=recorded)
        run.fit(module, train, val)
        if event.get("predict"):
            STEPS_RUN[0] = 0  # a refusal of `predict` comes before its first batch
            predicted = Tokens(GLOBAL_BATCH, length)
            run.predict(module, loader(predicted, cell, accelerator, GLOBAL_BATCH // 2, shuffle=False))
            for outputs in run.predict_loop.predictions or []:
                module.record["predictions"].update(outputs)
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    state = {name: value.detach().cpu() for name, value in state.items()}
    record = dict(module.record)
    if dist.is_initialized() and dist.get_world_size() > 1:  # every stage's parameters; predictions of every rank
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (state, record["predictions"]))
        state = {name: value for part, _ in gathered for name, value in part.items()}
        record["predictions"] = {index: value for _, part in gathered for index, value in part.items()}
    record["weights"] = state
    if accelerator == "cpu":
        record["adam"] = adam.steps
    return record


def launch_ranks(world: int, port: int) -> list[subprocess.Popen]:
    """Ranks 1..world-1 of this job, as Lightning's own launcher starts them (it takes them as launched)."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    base |= {"NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(world)}
    os.environ.update({key: base[key] for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK")})
    os.environ.update(LOCAL_RANK="0", RANK="0", LOCAL_WORLD_SIZE=str(world))
    return [
        subprocess.Popen([sys.executable, *sys.argv], env={**base, "LOCAL_RANK": str(rank), "RANK": str(rank)})
        for rank in range(1, world)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", required=True, help="a JSON list of [family, layout, event]")
    parser.add_argument("--accelerator", default="neuron")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cells = [Cell(*cell) for cell in json.loads(Path(args.cells).read_text())]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    children = launch_ranks(args.world, args.port) if args.world > 1 and "LOCAL_RANK" not in os.environ else []
    rank = int(os.environ.get("RANK", "0"))
    dtype = torch.float64 if args.float64 else torch.float32
    for cell in cells:
        started: dict[str, Any] = {"cell": list(cell)}
        STEPS_RUN[0] = 0
        # each cell stands for a run of its own: no compiled graph (or recompile count) carried over from the last
        torch._dynamo.reset()
        try:
            record = run_cell(cell, args.accelerator, dtype, out)
        except Exception as error:  # noqa: BLE001  a refusal, or a failure: the sweep tells them apart
            started |= {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
            started["refused"] = isinstance(error, REFUSALS) and STEPS_RUN[0] == 0
            if rank == 0:
                with (out / "cells.jsonl").open("a") as file:
                    file.write(json.dumps(started) + "\n")
            if not isinstance(error, REFUSALS):  # the ranks may be anywhere: end the job, the sweep starts another
                print(f"[rank {rank}] {cell.name}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                os._exit(1)
            if dist.is_initialized():
                dist.barrier()
            continue
        if rank == 0:
            weights = out / f"weights-{cell.name}{'-64' if args.float64 else ''}.pt"
            torch.save(record.pop("weights"), weights)
            started["weights"] = str(weights)
            if "adam" in record:
                adam = out / f"adam-{cell.name}{'-64' if args.float64 else ''}.pt"
                torch.save(record.pop("adam"), adam)
                started["adam"] = str(adam)
            started |= record
            with (out / "cells.jsonl").open("a") as file:
                file.write(json.dumps(started) + "\n")
    for child in children:
        child.wait()
    sys.exit(max((child.returncode for child in children), default=0))


if __name__ == "__main__":
    main()
