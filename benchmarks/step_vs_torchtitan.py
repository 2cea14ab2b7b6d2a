"""The LLM recipe's training step against TorchTitan's for the same model and mesh, simulated at full world size.

    python -m benchmarks.step_vs_torchtitan [--presets trn2-8b,trn2-70b] [--tiny] [key=value ...]

For each preset, `lightning_trn.estimate.estimate` simulates one training step of rank 0 at the preset's world size
(fake tensors, fake process group, no memory: docs/sharding.md, "Will it fit?") twice, on the same model
(`recipes.llm.build_model`), the same batch and the same Trainer:

- plugin: the recipe as it is (`recipes/llm/parallelize.py`, the hooks of `lightning_trn.hooks`);
- TorchTitan: the same `CausalLM` split by TorchTitan's published `parallelize_llama` (`models/llama3/infra/
  parallelize.py`, before its move into the model classes), written out below for Hugging Face's module names, not
  imported: `apply_tp` (embedding row-wise with sequence-sharded output, sequence-parallel norms, `PrepareModuleInput`
  gathering attention and MLP inputs as DTensors, q/k/v and gate/up column-wise, o/down row-wise back to sequence
  shards, the output column-wise with vocabulary-split logits for `loss_parallel`), full activation checkpointing
  per block (`checkpoint_wrapper`, no RNG state kept), FSDP2 per block, the embedding, the final norm with the output
  (not resharded after forward) and the root, bf16 parameters with fp32 reduction; and TorchTitan's step: gradients
  set to None before the forward, clipping by the total norm with one `full_tensor()` of it.

Printed per preset: the collectives of one step (count and bytes per rank, by kind and by mesh dimension), the
estimator's own totals by kind, the per-rank peak, and each plugin/TorchTitan ratio (target: bytes and peak at most
1.00). The estimator reports collectives by kind; the mesh dimension of each comes from a dispatch mode here that
reads each collective's process group. `--tiny` runs both presets shrunk (2 layers, hidden 64, dp 2 x tp 2) for the
smoke test; the full run takes minutes (the 256-rank preset most).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

PRESETS = ("trn2-8b", "trn2-70b")
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


def _use_standin() -> None:
    """Simulate on the `neuron` stand-in, native stack, where no Neuron stack is installed (as
    `python -m lightning_trn.estimate` does), with a node's devices whatever a test suite set; set before the
    stand-in loads."""
    import importlib.util

    if importlib.util.find_spec("torch_neuronx") is None:
        os.environ["LIGHTNING_TRN_STANDIN_DEVICES"] = STANDIN_DEVICES
        os.environ.setdefault("LIGHTNING_TRN_BACKEND", "native")
        import lightning_trn.standin  # noqa: F401


# ------------------------------------------------------------------------------------ TorchTitan's parallelize_llama


def titan_apply_tp(net: Any, tp_mesh: Any) -> None:
    """TorchTitan's `apply_tp` (loss parallel on, no float8) for Hugging Face's Llama names: tok_embeddings ->
    model.embed_tokens, attention_norm -> input_layernorm, attention.wq -> self_attn.q_proj, ffn_norm ->
    post_attention_layernorm, feed_forward.w1/w3/w2 -> mlp.gate_proj/up_proj/down_proj, output -> lm_head. Hugging
    Face's model reads the sequence length off the embedding's output, so that output stays a DTensor, and so do the
    blocks' outputs that are added to it (`use_local_output=False`: a layout, no communication)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        net,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in net.model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "mlp.up_proj": ColwiseParallel(),
            },
        )


def titan_apply_ac(net: Any) -> None:
    """TorchTitan's full activation checkpointing: each block in `checkpoint_wrapper`, without keeping RNG state."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = net.model.layers
    for index, block in enumerate(layers):
        layers[index] = checkpoint_wrapper(block, preserve_rng_state=False)


def titan_apply_fsdp(net: Any, dp_mesh: Any, param_dtype: Any) -> None:
    """TorchTitan's `apply_fsdp` (default reshard policy, no pipeline): the embedding, each block, the final norm with
    the output (kept unsharded after forward: backward needs them at once), the root."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)}
    fully_shard(net.model.embed_tokens, **config, reshard_after_forward=True)
    for block in net.model.layers:
        fully_shard(block, **config, reshard_after_forward=True)
    fully_shard([net.model.norm, net.lm_head], **config, reshard_after_forward=False)
    fully_shard(net, **config)


def titan_step_module(cfg: Any) -> Any:
    """The recipe's `CausalLM` for `cfg`, split and stepped as TorchTitan does (module docstring)."""
    import torch
    from typing_extensions import override

    from lightning_trn.recipes import llm

    class TorchTitanStep(llm.CausalLM):
        @override
        def configure_model(self) -> None:
            if self._parallelized:
                return
            mesh = self.device_mesh
            if mesh is None:
                raise RuntimeError("The TorchTitan side runs under the preset's ModelParallelStrategy (a device mesh).")
            param_dtype = torch.bfloat16 if str(self.trainer.precision).startswith("bf16") else torch.float32
            if mesh["tensor_parallel"].size() > 1:
                titan_apply_tp(self.net, mesh["tensor_parallel"])
            if self.hparams["activation_checkpointing"]:
                titan_apply_ac(self.net)
            if mesh["data_parallel"].size() > 1:
                titan_apply_fsdp(self.net, mesh["data_parallel"], param_dtype)
            self._parallelized = True

        @override
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            """TorchTitan's `train_step` begins with `optimizers.zero_grad()` (gradients set to None)."""
            for optimizer in self.trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)

        @override
        def configure_gradient_clipping(
            self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
        ) -> None:
            """TorchTitan's `clip_grad_norm_`: the total norm of the DTensor gradients, made whole once."""
            from torch.distributed.tensor import DTensor

            if not gradient_clip_val:
                return
            params = [p for p in self.parameters() if p.grad is not None]
            grads = [p.grad for p in params if p.grad is not None]
            total = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
            if isinstance(total, DTensor):
                total = total.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(params, float(gradient_clip_val), total, True)

    plugin = llm.build_model(cfg)
    return TorchTitanStep(**dict(plugin.hparams), meta_init=plugin._meta_init)


# ------------------------------------------------------------------------ collectives by kind and mesh dimension


_KINDS = (("all_gather", "all_gather"), ("allgather", "all_gather"), ("reduce_scatter", "reduce_scatter"))


def _kind(name: str) -> str:
    """A collective op's kind: all_gather, reduce_scatter, all_reduce or its own name."""
    name = name.split("::")[-1].split(".")[-1]
    for part, kind in _KINDS:
        if part in name:
            return kind
    return "all_reduce" if "allreduce" in name or "all_reduce" in name else name.strip("_")


def _group_name(arg: Any) -> Any:
    """The group name a collective's argument names: a functional collective's is the name itself, a c10d op's a
    boxed `ProcessGroup`."""
    import torch
    from torch.distributed import ProcessGroup

    if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
        return ProcessGroup.unbox(arg).group_name
    return arg


class MeshCollectives:
    """Counts and bytes per rank of the collectives of the second training step, by (kind, mesh dimension), as the
    estimator sizes them (the largest tensor of a call). Added to the simulated module's callbacks; its dispatch mode
    is entered at `setup`, under the estimator's (which enter later), and counts only during the second step."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def callback(self) -> Any:
        import lightning.pytorch as pl
        import torch
        from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        ops = {*NATIVE_TO_PY_MAPPING, *c10d_collective_ops}
        owner = self

        class Mode(TorchDispatchMode):
            counting = False
            groups: dict[str, str] = {}

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if self.counting and func._overloadpacket in ops:
                    leaves = tree_flatten([args, kwargs or {}])[0]
                    names = [_group_name(leaf) for leaf in leaves if not torch.is_tensor(leaf)]
                    dim = next((self.groups[n] for n in names if isinstance(n, str) and n in self.groups), "?")
                    key = (_kind(str(func._overloadpacket)), dim)
                    owner.counts[key] += 1
                    owner.bytes[key] += max(
                        sum(t.numel() * t.element_size() for t in tree_flatten(part)[0] if torch.is_tensor(t))
                        for part in (*args, *(kwargs or {}).values(), out)
                    )
                return out

        class Count(pl.Callback):
            def __init__(self) -> None:
                self.stack = contextlib.ExitStack()
                self.mode = Mode()

            def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
                self.stack.enter_context(self.mode)

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                mesh = pl_module.device_mesh
                self.mode.groups = {mesh[name].get_group().group_name: name for name in mesh.mesh_dim_names}
                self.mode.counting = batch_idx == 1

            def on_train_batch_end(self, *args: Any) -> None:
                self.mode.counting = False

            def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
                self.stack.close()

        return Count()


def measure(module_factory: Any, batch: Any, trainer_args: dict[str, Any]) -> tuple[Any, MeshCollectives, float]:
    """The estimate of one side, its collectives by mesh dimension, and the wall seconds it took."""
    from lightning_trn.estimate import estimate

    by_mesh = MeshCollectives()

    def counted() -> Any:
        module = module_factory()
        module.configure_callbacks = lambda: [by_mesh.callback()]
        return module

    start = time.perf_counter()
    result = estimate(counted, batch, platform="trn2", **trainer_args)
    return result, by_mesh, time.perf_counter() - start


def _size(count: int) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def _ratio(plugin: float, reference: float) -> str:
    if reference == 0:
        return "1.00" if plugin == 0 else "inf"
    return f"{plugin / reference:.2f}"


def compare(preset: str, overrides: Sequence[str]) -> list[list[Any]]:
    """Rows of the table for one preset: per (kind, mesh dimension), then the estimator's totals by kind, the total
    and the peak, plugin against TorchTitan."""
    from omegaconf import OmegaConf

    from lightning_trn.estimate.__main__ import recipe_batch
    from lightning_trn.recipes import cli, llm

    cfg = cli.load_config(llm.RECIPE, [f"preset={preset}", *overrides])
    trainer_args = {**OmegaConf.to_container(cfg.trainer, resolve=True), **llm.trainer_args(cfg)}  # type: ignore[dict-item]
    batch = recipe_batch(llm.RECIPE, cfg)
    plugin, plugin_mesh, plugin_s = measure(lambda: llm.build_model(cfg), batch, trainer_args)
    titan, titan_mesh, titan_s = measure(lambda: titan_step_module(cfg), batch, trainer_args)
    world = plugin.world_size
    print(f"{preset}: world size {world}; simulated in {plugin_s:.0f} s (plugin), {titan_s:.0f} s (TorchTitan)")
    rows = []
    for key in sorted({*plugin_mesh.counts, *titan_mesh.counts}):
        kind, dim = key
        rows.append(
            [
                preset,
                f"{kind} over {dim}",
                plugin_mesh.counts.get(key, 0),
                _size(plugin_mesh.bytes.get(key, 0)),
                titan_mesh.counts.get(key, 0),
                _size(titan_mesh.bytes.get(key, 0)),
                _ratio(plugin_mesh.bytes.get(key, 0), titan_mesh.bytes.get(key, 0)),
            ]
        )
    ours = {c.kind: c for c in plugin.collectives}
    theirs = {c.kind: c for c in titan.collectives}
    for kind in sorted({*ours, *theirs}):
        mine, other = ours.get(kind), theirs.get(kind)
        mine_bytes, other_bytes = (mine.bytes_per_rank if mine else 0), (other.bytes_per_rank if other else 0)
        rows.append(
            [
                preset,
                f"estimator: {kind}",
                mine.count if mine else 0,
                _size(mine_bytes),
                other.count if other else 0,
                _size(other_bytes),
                _ratio(mine_bytes, other_bytes),
            ]
        )
    total_ours = sum(c.bytes_per_rank for c in plugin.collectives)
    total_theirs = sum(c.bytes_per_rank for c in titan.collectives)
    rows.append(
        [
            preset,
            "**all collectives (bytes)**",
            sum(c.count for c in plugin.collectives),
            _size(total_ours),
            sum(c.count for c in titan.collectives),
            _size(total_theirs),
            _ratio(total_ours, total_theirs),
        ]
    )
    rows.append(
        [
            preset,
            "**peak per rank**",
            "",
            _size(plugin.peak),
            "",
            _size(titan.peak),
            _ratio(plugin.peak, titan.peak),
        ]
    )
    for side, result in (("plugin", plugin), ("TorchTitan", titan)):
        (rank,) = result.ranks
        print(
            f"  {side}: peak {rank.peak / _GIB:.2f} GiB (parameters {rank.parameters / _GIB:.2f}, gradients "
            f"{rank.gradients / _GIB:.2f}, optimizer {rank.optimizer_state / _GIB:.2f}, activations "
            f"{rank.activations / _GIB:.2f}, temporaries {rank.temporaries / _GIB:.2f})"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated LLM recipe presets")
    parser.add_argument("--tiny", action="store_true", help="shrink the presets (dp 2 x tp 2, 2 layers) for CI")
    parser.add_argument("overrides", nargs="*", help="recipe config overrides (key=value), after the preset's")
    args = parser.parse_args(argv)
    _use_standin()
    from benchmarks._harness import format_table

    overrides = [*(TINY if args.tiny else ()), *args.overrides]
    rows = [row for preset in args.presets.split(",") for row in compare(preset, overrides)]
    header = ("preset", "collective / memory", "plugin count", "plugin bytes", "TorchTitan count", "TorchTitan bytes")
    print(format_table((*header, "ratio"), rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
