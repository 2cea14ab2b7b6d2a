"""The LLM recipe's training step against TorchTitan's own, for the same model shape and mesh, simulated at full
world size.

    python -m benchmarks.step_vs_torchtitan [--presets trn2-8b,trn2-70b] [--families llama3,qwen3] [--tiny]
        [--no-transformers] [key=value ...]

For each preset and family, two simulations of one training step of rank 0 at the preset's world size (fake
tensors on the `neuron` stand-in, the fake process group, device memory by torch's `FSDPMemTracker`, collectives by
the estimator's counting mode: docs/sharding.md, "Will it fit?"):

- the recipe: `lightning_trn.estimate.estimate` on `recipes.llm.build_model(cfg)` as it is (`recipes/llm/
  parallelize.py`); for `qwen3`, the recipe's `model.pretrained` path on a folder holding only a `config.json` of a
  Qwen3 model at the preset's shape (`Qwen3ForCausalLM`: q_norm / k_norm per head), which the estimator reads no
  weights for;
- TorchTitan: its own installed code (torchtitan 0.3.0, `benchmarks/_torchtitan.py`, nothing of it copied): its
  `Llama3Model` / `Qwen3Model` at the preset's shape, split by its `parallelize_llama` / `parallelize_qwen3` at the
  same layout (tensor parallel x FSDP, HSDP replicas where the preset has them; activation checkpointing: the
  preset's `model.activation_checkpointing=true` as TorchTitan's `FullAC`, false as none), bf16 parameters with fp32
  reduction, and stepped as its `Trainer.train_step` steps (its chunked loss, gradient clipping, AdamW).

Printed per preset and family: the collectives of one step (count and bytes per rank, by kind and by mesh dimension
-- the recipe's `data_parallel`/`tensor_parallel`/`replicate` and TorchTitan's `fsdp`/`tp`/`dp_replicate` under one
name each: dp_shard, tp, dp_replicate), the estimator's totals by kind, rank 0's peak and memory by category, the
parameters per rank, each recipe/TorchTitan ratio, and a reason line for each row that differs (what in the two
plans makes it differ). Then what TorchTitan's `experiments/transformers_modeling_backend` plan does with the
recipe's Hugging Face model, and what in the simulation stands in for what TorchTitan runs on a GPU.

`--tiny` runs both presets shrunk (2 layers, hidden 64, dp 2 x tp 2, 4 ranks) for the smoke test (about half a
minute); the full run takes minutes (the 256-rank 70B preset most).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PRESETS = ("trn2-8b", "trn2-70b")
FAMILIES = ("llama3", "qwen3")
#: `--tiny`: the presets' strategy and precision on a model small enough for CI, on dp 2 x tp 2
TINY = (
    "trainer.devices=4",
    "trainer.num_nodes=1",
    "model.tensor_parallel_size=2",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "data.vocab_size=4096",
    "data.seq_len=256",
)
#: the stand-in's device count for the simulation: one trn2.48xlarge node's logical cores
STANDIN_DEVICES = "64"
_GIB = 2**30
_MEMORY_ROWS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


def _use_standin() -> None:
    """Simulate on the `neuron` stand-in, native stack, where no Neuron stack is installed (as
    `python -m lightning_trn.estimate` does), with a node's devices whatever a test suite set; set before the
    stand-in loads."""
    import importlib.util

    if importlib.util.find_spec("torch_neuronx") is None:
        os.environ["LIGHTNING_TRN_STANDIN_DEVICES"] = STANDIN_DEVICES
        os.environ.setdefault("LIGHTNING_TRN_BACKEND", "native")
        import lightning_trn.standin  # noqa: F401


# ---------------------------------------------------------------------------------------------------- the recipe


@dataclass
class RecipeStep:
    """The recipe's simulated step: the estimate, its collectives by (kind, mesh dimension), its parameters per
    rank."""

    estimate: Any
    counts: dict[tuple[str, str], int]
    bytes: dict[tuple[str, str], int]
    parameters: int
    buffer_bytes: int
    seconds: float
    #: where in the step rank 0's memory peaked (`_torchtitan.peak_places`)
    peak_place: str

    @property
    def memory(self) -> Any:
        (rank,) = self.estimate.ranks
        return rank


def _counting_callback(counter: Any) -> Any:
    """A callback that enters `counter` (`_torchtitan.dim_counter`) at `setup` and counts the second training step
    only, with the group names of the module's device mesh."""
    import lightning.pytorch as pl

    from benchmarks._torchtitan import DIM_NAMES

    class Count(pl.Callback):
        def __init__(self) -> None:
            self.stack = contextlib.ExitStack()

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.stack.enter_context(counter)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            mesh = pl_module.device_mesh
            counter.groups = {
                mesh[name].get_group().group_name: DIM_NAMES.get(name, name) for name in mesh.mesh_dim_names
            }
            counter.counting = batch_idx == 1

        def on_train_batch_end(self, *args: Any) -> None:
            counter.counting = False

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.stack.close()

    return Count()


def simulate_recipe(cfg: Any) -> RecipeStep:
    """`lightning_trn.estimate.estimate` of the recipe's module for `cfg`, as `python -m lightning_trn.estimate llm`
    runs it, with its collectives counted by mesh dimension and its parameters per rank."""
    from omegaconf import OmegaConf
    from torch.distributed.tensor import DTensor

    from benchmarks._torchtitan import dim_counter, peak_places
    from lightning_trn.estimate import estimate
    from lightning_trn.estimate.__main__ import recipe_batch
    from lightning_trn.recipes import llm

    trainer_args = {**OmegaConf.to_container(cfg.trainer, resolve=True), **llm.trainer_args(cfg)}  # type: ignore[dict-item]
    counter = dim_counter()
    built: list[Any] = []

    def counted() -> Any:
        module = llm.build_model(cfg)
        module.configure_callbacks = lambda: [_counting_callback(counter)]  # type: ignore[method-assign]  # this one
        built.append(module)
        return module

    def local(tensor: Any) -> Any:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    start = time.perf_counter()
    with peak_places() as places:
        result = estimate(counted, recipe_batch(llm.RECIPE, cfg), platform="trn2", **trainer_args)
    module = built[-1]
    parameters = sum(local(p).numel() for p in module.parameters() if p.requires_grad)
    buffers = sum(local(b).numel() * local(b).element_size() for b in module.buffers())
    seconds = time.perf_counter() - start
    (rank,) = result.ranks
    place = places.get(rank.peak, "")
    return RecipeStep(result, dict(counter.counts), dict(counter.bytes), parameters, buffers, seconds, place)


def qwen3_folder(cfg: Any, directory: str) -> str:
    """A `save_pretrained` folder holding only the `config.json` of a Qwen3 model at the recipe config's shape (head
    dimension hidden / heads, the output not tied to the embedding, as Qwen3 8B and larger): what the recipe's
    `model.pretrained` reads to build a Qwen3 on the meta device; the estimator reads no weights."""
    from transformers import Qwen3Config

    m = cfg.model
    Qwen3Config(
        vocab_size=cfg.data.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.hidden_size // m.num_heads,
        max_position_embeddings=cfg.data.seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------------- the comparison


def _size(count: int) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def _ratio(plugin: float, reference: float) -> str:
    if reference == 0:
        return "1.00" if plugin == 0 else "inf"
    return f"{plugin / reference:.2f}"


def titan_layout(cfg: Any) -> dict[str, Any]:
    """TorchTitan's arguments for the recipe config's job: world size, node size, mesh, activation checkpointing,
    batch per data-parallel rank, sequence length."""
    m = cfg.model
    devices, nodes = int(cfg.trainer.devices), int(cfg.trainer.get("num_nodes", 1))
    return {
        "world_size": devices * nodes,
        "devices_per_node": devices,
        "tp": m.tensor_parallel_size,
        "dp_replicate": m.replicate_size,
        "ac": "full" if m.activation_checkpointing else "none",
        "local_batch": cfg.data.batch_size,
        "seq_len": cfg.data.seq_len,
    }


def model_shape(cfg: Any) -> Any:
    from benchmarks._torchtitan import ModelShape

    m = cfg.model
    return ModelShape(
        hidden=m.hidden_size,
        intermediate=m.intermediate_size,
        layers=m.num_layers,
        heads=m.num_heads,
        kv_heads=m.num_kv_heads,
        vocab=cfg.data.vocab_size,
        rope_theta=m.rope_theta,
    )


def _dim(name: str) -> str:
    from benchmarks._torchtitan import DIM_NAMES

    return DIM_NAMES.get(name, name)


def rows_of(preset: str, family: str, recipe: RecipeStep, titan: Any) -> list[list[Any]]:
    """The table's rows for one preset and family: per (kind, mesh dimension), the estimator's totals by kind, all
    bytes, the peak, the memory by category, the parameters per rank; recipe against TorchTitan."""
    titan_counts = {(kind, _dim(dim)): count for (kind, dim), count in titan.counts.items()}
    titan_bytes = {(kind, _dim(dim)): size for (kind, dim), size in titan.bytes.items()}
    rows = []
    for key in sorted({*recipe.counts, *titan_counts}):
        kind, dim = key
        mine, theirs = recipe.bytes.get(key, 0), titan_bytes.get(key, 0)
        row = [f"{kind} over {dim}", recipe.counts.get(key, 0), _size(mine), titan_counts.get(key, 0), _size(theirs)]
        rows.append([preset, family, *row, _ratio(mine, theirs)])
    ours = {c.kind: c for c in recipe.estimate.collectives}
    theirs_by_kind = {c.kind: c for c in titan.collectives}
    for kind in sorted({*ours, *theirs_by_kind}):
        mine_c, other = ours.get(kind), theirs_by_kind.get(kind)
        mine_b, other_b = (mine_c.bytes_per_rank if mine_c else 0), (other.bytes_per_rank if other else 0)
        rows.append(
            [
                preset,
                family,
                f"estimator: {kind}",
                mine_c.count if mine_c else 0,
                _size(mine_b),
                other.count if other else 0,
                _size(other_b),
                _ratio(mine_b, other_b),
            ]
        )
    total_ours = sum(c.bytes_per_rank for c in recipe.estimate.collectives)
    total_theirs = sum(c.bytes_per_rank for c in titan.collectives)
    count_ours = sum(c.count for c in recipe.estimate.collectives)
    count_theirs = sum(c.count for c in titan.collectives)
    rows.append(
        [
            preset,
            family,
            "**all collectives (bytes)**",
            count_ours,
            _size(total_ours),
            count_theirs,
            _size(total_theirs),
            _ratio(total_ours, total_theirs),
        ]
    )
    peak_ours, peak_theirs = recipe.memory.peak, titan.peak
    rows.append([preset, family, "**peak per rank**", "", _size(peak_ours), "", _size(peak_theirs)])
    rows[-1].append(_ratio(peak_ours, peak_theirs))
    for name in _MEMORY_ROWS:
        mine_m, other_m = getattr(recipe.memory, name), getattr(titan.memory, name)
        rows.append(
            [preset, family, f"at peak: {name}", "", _size(mine_m), "", _size(other_m), _ratio(mine_m, other_m)]
        )
    rows.append(
        [
            preset,
            family,
            "parameters per rank (elements)",
            "",
            f"{recipe.parameters:,}",
            "",
            f"{titan.parameters:,}",
            _ratio(recipe.parameters, titan.parameters),
        ]
    )
    return rows


# --------------------------------------------------------------------------------------------------- the reasons


@dataclass
class Context:
    """What the reasons quote: the job and both sides' measurements."""

    family: str
    cfg: Any
    recipe: RecipeStep
    titan: Any

    @property
    def logits(self) -> int:
        """Elements of one rank's logits for the whole sequence (batch x seq x vocabulary / tensor parallel)."""
        data, m = self.cfg.data, self.cfg.model
        return data.batch_size * data.seq_len * data.vocab_size // m.tensor_parallel_size


def _norm_head_gathers(ctx: Context) -> str:
    return (
        "TorchTitan all-gathers its [norm, lm_head] FSDP unit three times a step, the recipe (the same unit, also "
        "not resharded after forward) twice: TorchTitan's ChunkedLossWrapper ends every loss with "
        "`lm_head.set_reshard_after_forward(True)`, so from the second step on the unit is resharded after the "
        "norm's forward and gathered again by the loss's `lm_head.unshard()`; both then gather it once more for the "
        "norm's backward (FSDP2 reshards a unit after the post-backward of its first module, lm_head)"
    )


def _token_count(ctx: Context) -> str:
    return (
        "TorchTitan sums the step's valid tokens over its `batch` mesh (`dist_sum_tensor`, 8 bytes) and divides the "
        "summed loss by that count with FSDP's gradient division off; the recipe divides by its own block's tokens "
        "and FSDP2 averages the gradients (the same for packed blocks, which have no padding)"
    )


def _clipping(ctx: Context) -> str:
    return (
        "gradient clipping: the recipe's (`lightning_trn.core.parallel.gradients.clip_grad_norm_`) takes one norm "
        "per group of gradients with the same mesh and placements (column-wise, row-wise, replicated norm weights) and "
        "makes each whole on its own, an all-reduce per mesh dimension it is partial on; TorchTitan's "
        "`clip_grad_norm_(..., foreach=True)` stacks every parameter's norm (`_foreach_norm`) into one DTensor and "
        "makes that whole once; scalars, a few bytes either way"
    )


def _loss_chunks(ctx: Context) -> str:
    return (
        "the loss: TorchTitan's ChunkedLossWrapper runs its vocabulary-parallel cross entropy "
        "(`_LossParallelCrossEntropy`) on 8 chunks of the sequence, 3 all-reduces each (max, sum of exponentials, "
        "the target's logit; one float per token of the chunk), the recipe's `loss_parallel` the same 3 over the "
        "whole sequence at once: 8x the calls, the same bytes; the gradient clipping's all-reduces differ as over "
        "dp_shard"
    )


def _early_stop(ctx: Context) -> str | None:
    if ctx.cfg.model.activation_checkpointing:
        return (
            "activation checkpointing: TorchTitan's FullAC wraps each block in `checkpoint_wrapper(..., "
            "early_stop=False)`, so the backward's recompute runs the whole block, down to the MLP's closing "
            "reduce-scatter (w2, row-wise to sequence shards) whose output the backward does not need; the recipe's "
            "(Hugging Face gradient checkpointing: torch's non-reentrant checkpoint, early stop on) stops the "
            "recompute once the tensors the backward needs exist: one reduce-scatter fewer per layer"
        )
    return None


def _rope_buffers(ctx: Context) -> str:
    return (
        f"buffers: TorchTitan keeps a RoPE cache in every attention layer ({ctx.titan.buffer_bytes / 2**20:.1f} MiB "
        f"per rank: {ctx.cfg.model.num_layers} x seq_len x head_dim, "
        + ("complex64" if ctx.family == "llama3" else "fp32 cos and sin")
        + f"), the recipe one rotary embedding for the model ({ctx.recipe.buffer_bytes / 2**20:.2f} MiB)"
    )


def _gradients(ctx: Context) -> str:
    return (
        "TorchTitan's step starts with `optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)`, False by "
        "default, so the previous step's sharded fp32 gradients stay allocated (zeroed) through the forward; the "
        "recipe sets them to None before its step (Lightning's `zero_grad`): it has none until its backward "
        "reduces them"
    )


def _activations(ctx: Context) -> str:
    data, m = ctx.cfg.data, ctx.cfg.model
    logits, tp = ctx.logits, m.tensor_parallel_size
    text = (
        f"the logits: the recipe's loss takes the whole sequence's ({logits:,} elements per rank: lm_head's bf16 "
        f"output {2 * logits / _GIB:.2f} GiB, then an fp32 copy and an fp32 log-softmax, {4 * logits / _GIB:.2f} GiB "
        "each), TorchTitan's ChunkedLossWrapper one eighth of the sequence at a time, each chunk's backward run at "
        "once"
    )
    if m.activation_checkpointing:
        return text + "; checkpointed blocks keep only their inputs on both sides"
    tokens, head_dim = data.batch_size * data.seq_len, m.hidden_size // m.num_heads
    mask = 2 * data.seq_len**2
    repeated = 2 * tokens * (m.num_heads - m.num_kv_heads) // tp * head_dim * 2
    norms = 2 * tokens // tp * m.hidden_size * 2
    # Qwen3's q_norm and k_norm: the same RMSNorm difference over each rank's query and key heads
    head_norms = tokens * (m.num_heads + m.num_kv_heads) // tp * head_dim * 2 if ctx.family == "qwen3" else 0
    which = "the two norms" + (" and q_norm, k_norm" if head_norms else "")
    return text + (
        f"; and per decoder layer the recipe keeps {(mask + repeated - norms - head_norms) / 2**20:+.0f} MiB: its "
        f"(1, 1, seq, seq) causal mask, which SDPA on the stand-in turns into a bf16 bias saved in every layer "
        f"({mask / 2**20:.0f} MiB), and k and v repeated to every query head by Hugging Face's attention "
        f"({repeated / 2**20:+.0f} MiB), against TorchTitan's RMSNorm keeping its input in fp32 where Hugging Face's "
        f"keeps a bf16 copy ({-(norms + head_norms) / 2**20:+.0f} MiB for {which})"
    )


def _temporaries(ctx: Context) -> str:
    logits = ctx.logits
    text = (
        f"the loss's backward: the recipe's makes the gradient of the whole sequence's logits ({4 * logits / _GIB:.2f} "
        f"GiB in fp32, {2 * logits / _GIB:.2f} GiB cast to bf16 for lm_head), TorchTitan's of one chunk's at a time"
    )
    if ctx.recipe.peak_place == ctx.titan.peak_place:
        return text
    return text + (
        f"; and the two peak at different points (the recipe in {ctx.recipe.peak_place}, TorchTitan in "
        f"{ctx.titan.peak_place}), with other all-gathered weights and unsharded gradients alive there"
    )


#: row label -> why the two sides differ there (None: no reason under this job: printed as not analysed)
REASONS = {
    "all_gather over dp_shard": _norm_head_gathers,
    "all_reduce over batch": _token_count,
    "all_reduce over dp_shard": _clipping,
    "all_reduce over tp": _loss_chunks,
    "reduce_scatter over tp": _early_stop,
    "at peak: parameters": _rope_buffers,
    "at peak: gradients": _gradients,
    "at peak: activations": _activations,
    "at peak: temporaries": _temporaries,
}


def reasons(rows: list[list[Any]], ctx: Context) -> list[str]:
    """A line for each row whose two sides differ (ratio other than 1.00, or other counts): why."""
    lines = []
    for row in rows:
        label, count_ours, _, count_theirs, _, ratio = row[2:]
        if ratio == "1.00" and count_ours == count_theirs:
            continue
        if label.startswith(("estimator: ", "**all")):
            continue  # sums of the rows by mesh dimension
        if label == "**peak per rank**":
            deltas = ", ".join(
                f"{name} {(getattr(ctx.recipe.memory, name) - getattr(ctx.titan.memory, name)) / 2**20:+,.0f} MiB"
                for name in _MEMORY_ROWS
            )
            lines.append(
                f"  reason: peak: the recipe peaks in {ctx.recipe.peak_place}, TorchTitan in {ctx.titan.peak_place}; "
                f"recipe - TorchTitan there: {deltas} (lines below)"
            )
            continue
        explain = REASONS.get(label)
        text = explain(ctx) if explain is not None else None
        lines.append(f"  reason: {label}: {text or 'not analysed (a difference this benchmark has no reason for)'}")
    return lines


# ------------------------------------------------------------------------------------------------------ the runs


def compare(preset: str, family: str, overrides: Sequence[str]) -> tuple[list[list[Any]], list[str], Any]:
    """Rows of the table for one preset and family, the lines printed with it, and TorchTitan's step."""
    from benchmarks._torchtitan import simulate_torchtitan
    from lightning_trn.recipes import cli, llm

    cfg = cli.load_config(llm.RECIPE, [f"preset={preset}", *overrides])
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        if family == "qwen3":
            cfg = cli.load_config(llm.RECIPE, [f"preset={preset}", *overrides, f"model.pretrained={folder}"])
            qwen3_folder(cfg, folder)
        recipe = simulate_recipe(cfg)
    layout = titan_layout(cfg)
    titan = simulate_torchtitan(family, model_shape(cfg), **layout)
    lines.append(
        f"{preset} / {family}: world size {layout['world_size']} (tp {titan.tp} x dp_shard {titan.dp_shard}"
        f" x dp_replicate {titan.dp_replicate}), activation checkpointing {layout['ac']}, "
        f"{layout['local_batch']} x {layout['seq_len']} tokens per data-parallel rank; simulated in "
        f"{recipe.seconds:.0f} s (recipe), {titan.seconds:.0f} s (TorchTitan)"
    )
    for side, memory in (("recipe", recipe.memory), ("TorchTitan", titan.memory)):
        lines.append(
            f"  {side}: peak {memory.peak / _GIB:.2f} GiB (parameters {memory.parameters / _GIB:.2f}, gradients "
            f"{memory.gradients / _GIB:.2f}, optimizer {memory.optimizer_state / _GIB:.2f}, activations "
            f"{memory.activations / _GIB:.2f}, temporaries {memory.temporaries / _GIB:.2f})"
        )
    rows = rows_of(preset, family, recipe, titan)
    return rows, lines + reasons(rows, Context(family, cfg, recipe, titan)), titan


def transformers_backend(preset: str, overrides: Sequence[str]) -> str:
    """What TorchTitan's `experiments/transformers_modeling_backend` does with the recipe's Hugging Face model
    (its config saved as a `save_pretrained` folder, the backend's "full" flavor) at the preset's layout."""
    from benchmarks._torchtitan import simulate_torchtitan
    from lightning_trn.recipes import cli, llm

    cfg = cli.load_config(llm.RECIPE, [f"preset={preset}", *overrides])
    layout = titan_layout(cfg)
    with tempfile.TemporaryDirectory() as folder:
        import torch

        with torch.device("meta"):
            config = llm.build_model(cfg).net.config
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(folder)
        try:
            step = simulate_torchtitan("transformers", folder, spmd_backend="spmd_types", **layout)
        except RuntimeError as err:
            return f"{preset}: TorchTitan's transformers_modeling_backend on the recipe's LlamaForCausalLM: {err}"
    return (
        f"{preset}: TorchTitan's transformers_modeling_backend on the recipe's LlamaForCausalLM ran: peak "
        f"{step.peak / _GIB:.2f} GiB, {sum(c.bytes_per_rank for c in step.collectives) / _GIB:.2f} GiB of collectives"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated LLM recipe presets")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: llama3, qwen3")
    parser.add_argument("--tiny", action="store_true", help="shrink the presets (dp 2 x tp 2, 2 layers) for CI")
    parser.add_argument(
        "--no-transformers", action="store_true", help="skip TorchTitan's transformers_modeling_backend attempt"
    )
    parser.add_argument("overrides", nargs="*", help="recipe config overrides (key=value), after the preset's")
    args = parser.parse_args(argv)
    _use_standin()
    from benchmarks._harness import format_table

    overrides = [*(TINY if args.tiny else ()), *args.overrides]
    header = ("preset", "family", "collective / memory", "recipe count", "recipe bytes")
    notes: dict[str, None] = {}
    for preset in args.presets.split(","):
        for family in args.families.split(","):
            rows, lines, titan = compare(preset, family, overrides)
            notes.update(dict.fromkeys(titan.notes))
            print(lines[0], *lines[1:3], sep="\n")
            print(format_table((*header, "TorchTitan count", "TorchTitan bytes", "ratio"), rows))
            print(*lines[3:], sep="\n", flush=True)
        if not args.no_transformers:
            print(transformers_backend(preset, overrides), flush=True)
    print("What stands in for what TorchTitan runs on a GPU (benchmarks/_torchtitan.py):")
    print(*(f"  - {note}" for note in notes), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
