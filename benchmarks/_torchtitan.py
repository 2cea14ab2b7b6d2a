"""TorchTitan's own training step, simulated the way `lightning_trn.estimate` simulates the recipe's: one rank at the
job's full world size, fake tensors on the `neuron` device (the CPU stand-in where no Neuron stack is installed), the
fake process group, device memory by torch's `FSDPMemTracker`, collectives by the estimator's counting mode.

    from benchmarks._torchtitan import ModelShape, simulate_torchtitan

    step = simulate_torchtitan("llama3", "8B", world_size=8, devices_per_node=8, ac="selective", local_batch=2,
                               seq_len=8192)
    step.peak, step.memory, step.collectives, step.counts, step.bytes, step.modes, step.peak_place

`family` "transformers" runs TorchTitan's `experiments/transformers_modeling_backend` on a `save_pretrained` folder's
Hugging Face model (its `spmd_types` backend only: on torch 2.13 it stops in `fully_shard`, and the error says so).
What TorchTitan changes for the whole process while it runs (its device type, Dynamo's LRU cache, the Hugging Face
backend's init patches of transformers' classes, logging levels) is put back afterwards.

Everything TorchTitan-specific the benchmarks need is here; nothing of TorchTitan's plan is copied. What runs is
torchtitan 0.3.0's code (`pip install --no-deps torchtitan==0.3.0 spmd-types tyro docstring-parser`, pinned in
`requirements/constraints-native.txt`):

- the model: `torchtitan.models.llama3` / `torchtitan.models.qwen3`, a published flavor ("8B", "70B", ...) as its
  registry builds it, or a config at a given shape (`ModelShape`) built by the family's own layer builder
  (`_build_llama3_layers` / `_build_qwen3_layers`) with its own initializer tables, fused q/k/v and Qwen3's per-head
  q/k norms included; built on the meta device, as its `Trainer` builds it, after `Model.Config.update_from_config`
  with a `Trainer.Config` (which sets the sharding declarations its tensor-parallel plan reads);
- the mesh: `ParallelDims.from_config(ParallelismConfig(...), world_size).build_mesh()`;
- the plan: the family's `parallelize_fn` (`parallelize_llama`, `parallelize_qwen3`): its tensor parallel (sequence
  parallel on, loss parallel through its vocabulary-split `lm_head`), activation checkpointing (`FullAC`,
  `SelectiveAC`: its per-op policy), FSDP2 or HSDP (`apply_fsdp_to_decoder`: bf16 parameters, fp32 reduction, its
  reshard policy, gradient division off);
- the step: `Trainer.forward_backward_step` (its input handling, document-causal masks from per-document positions,
  `_forward_backward_body`) with the loss its published Llama 3 and Qwen3 configs use (`ChunkedLossWrapper` over
  `CrossEntropyLoss`, 8 chunks; `loss="plain"`: `CrossEntropyLoss` on the whole sequence), inside the rest of
  `Trainer.train_step` written out here in its order:
  `optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)`, the valid-token count summed over the `batch`
  mesh (`dist_utils.dist_sum_tensor`), `dist_utils.clip_grad_norm_(..., foreach=True)`, `optimizers.step()` (its
  `OptimizersContainer`, `default_adamw`) and `lr_schedulers.step()`. Left out: the step's host-side logging
  (`int()` of the token count, `.item()` of losses every `log_freq` steps), which fake tensors cannot answer.

What the simulation cannot run, and what stands in (each is in `TitanStep.notes`):

- TorchTitan's language models take attention only from FlexAttention or varlen (its `sdpa` backend is refused for
  them). Flex compiles its kernel with Inductor (Triton), which the stand-in has no backend for: the compiled
  `create_block_mask` runs eagerly, and `FlexAttention._compiled_flex_attn` is causal grouped-query
  `scaled_dot_product_attention` (what the recipe's Hugging Face attention calls); the masks' blocks are kept.
- `init_weights` draws truncated normals into DTensors, which reads values back (`item`) on fake tensors: skipped,
  as the estimator materializes without values (memory is the same: `to_empty` allocates every parameter and buffer).
- The fused AdamW (`implementation="fused"`, TorchTitan's default) is used where torch has the kernel for the device;
  else `foreach` (the same state, the step's temporaries differ).
- torchtitan 0.3.0's default `spmd_backend="spmd_types"` (local tensors typed per mesh axis) does not run on torch
  2.13 with FSDP (`fully_shard` with `dp_mesh_dims` needs DTensor parameters on the whole mesh); the DTensor backend
  (`partial_dtensor`, the plan as DTensors over the tensor-parallel axis, as before 0.3) runs and is the default
  here. `simulate_torchtitan(..., spmd_backend="spmd_types")` reports what stops it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import sys
import time
import types
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: TorchTitan's model families run here: its Llama 3 and Qwen3 models with their plans, and its
#: `experiments/transformers_modeling_backend` (a Hugging Face model from a `save_pretrained` folder's config)
FAMILIES = ("llama3", "qwen3", "transformers")
AC_MODES = ("none", "full", "selective")
#: "chunked": TorchTitan's `ChunkedLossWrapper` (its published configs'); "plain": `CrossEntropyLoss` on the whole
#: sequence
LOSSES = ("chunked", "plain")
#: modules TorchTitan's trainer imports for its data loading and that its model, plan and step never call (its
#: `torchdata` loader, Hugging Face `datasets`): stand-ins for the import of `torchtitan.trainer` only, taken out of
#: `sys.modules` again afterwards
_DATA_MODULES: dict[str, dict[str, Any]] = {
    "torchdata": {},
    "torchdata.stateful_dataloader": {"StatefulDataLoader": type("StatefulDataLoader", (), {})},
    "datasets": {"Dataset": type("Dataset", (), {}), "load_dataset": None},
    "datasets.distributed": {"split_dataset_by_node": None},
}
#: mesh dimension names: TorchTitan's (`ParallelDims`) and the recipe's (Lightning's mesh) -> one name for the tables
DIM_NAMES = {
    "fsdp": "dp_shard",
    "data_parallel": "dp_shard",
    "dp_replicate": "dp_replicate",
    "replicate": "dp_replicate",
    "tp": "tp",
    "tensor_parallel": "tp",
}
_KINDS = (("all_gather", "all_gather"), ("allgather", "all_gather"), ("reduce_scatter", "reduce_scatter"))


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder's shape, as the recipe's config gives it (`model.*`, `data.vocab_size`)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0
    #: None: hidden / heads
    head_dim: int | None = None
    norm_eps: float = 1e-6

    @property
    def per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads


@dataclass
class TitanStep:
    """One simulated TorchTitan training step (the second of two) of rank `rank`."""

    family: str
    model: str
    world_size: int
    devices_per_node: int
    tp: int
    dp_shard: int
    dp_replicate: int
    ac: str
    local_batch: int
    seq_len: int
    #: rank 0's memory at the step's peak (`lightning_trn.estimate.RankMemory`: peak, parameters, gradients,
    #: optimizer_state, activations, temporaries)
    memory: Any
    #: the rank's parameters (its shards' elements) and their bytes
    parameters: int
    parameter_bytes: int
    #: the rank's buffers' bytes (TorchTitan keeps a RoPE cache in every attention layer)
    buffer_bytes: int
    #: the step's collectives, as the estimator reports them (`lightning_trn.estimate.Collective`)
    collectives: list[Any]
    #: (kind, mesh dimension) -> count and bytes per rank (the largest tensor of each call, as the estimator counts)
    counts: dict[tuple[str, str], int]
    bytes: dict[tuple[str, str], int]
    #: the measured step's counting modes (`simulation._CollectiveBytes.mode`), for `lightning_trn.estimate`'s
    #: step-time functions
    modes: list[Any]
    #: where in the step rank 0's memory peaked (`peak_places`)
    peak_place: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def peak(self) -> int:
        return int(self.memory.peak)


def kind(name: str) -> str:
    """A collective op's kind: all_gather, reduce_scatter, all_reduce or its own name."""
    name = name.split("::")[-1].split(".")[-1]
    for part, each in _KINDS:
        if part in name:
            return each
    return "all_reduce" if "allreduce" in name or "all_reduce" in name else name.strip("_")


def _group_name(arg: Any) -> Any:
    """The group name a collective's argument names: a functional collective's is the name itself, a c10d op's a
    boxed `ProcessGroup`."""
    import torch
    from torch.distributed import ProcessGroup

    if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
        return ProcessGroup.unbox(arg).group_name
    return arg


def dim_counter() -> Any:
    """A dispatch mode that counts collectives by (kind, mesh dimension) while `counting`: `groups` maps process-group
    names to dimension names; each call's size is its largest tensor (the estimator's rule)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    ops = {*NATIVE_TO_PY_MAPPING, *c10d_collective_ops}

    class DimCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counting = False
            self.groups: dict[str, str] = {}
            self.counts: dict[tuple[str, str], int] = defaultdict(int)
            self.bytes: dict[tuple[str, str], int] = defaultdict(int)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            # as `CommDebugMode`: DTensor's operators go on to DTensor, whose collectives then come here
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            if any(t is DTensor for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            if self.counting and func._overloadpacket in ops:
                leaves = tree_flatten([args, kwargs or {}])[0]
                names = [_group_name(leaf) for leaf in leaves if not torch.is_tensor(leaf)]
                dim = next((self.groups[n] for n in names if isinstance(n, str) and n in self.groups), "?")
                key = (kind(str(func._overloadpacket)), dim)
                self.counts[key] += 1
                self.bytes[key] += max(
                    sum(t.numel() * t.element_size() for t in tree_flatten(part)[0] if torch.is_tensor(t))
                    for part in (*args, *(kwargs or {}).values(), out)
                )
            return out

    return DimCounter()


def _place(tracker: Any) -> str:
    """Where a memory tracker is in the step: the phase and the innermost module running."""
    modules = [name for name in tracker._mod_tracker.parents if name != "Global"]
    module = max(modules, key=lambda name: name.count("."), default="outside the model's modules: the loss")
    if tracker._in_opt:
        return "the optimizer step"
    phase = "backward" if tracker._mod_tracker.is_bw else "forward"
    return f"the {phase} ({'recompute, ' if tracker._in_ac else ''}{module})"


@contextlib.contextmanager
def peak_places() -> Iterator[dict[int, str]]:
    """While the block runs, every new peak of torch's memory trackers (`MemTracker`, `FSDPMemTracker`) on a device
    is filed by its bytes with where it happened (`_place`): the place of a simulation's peak is `places[peak]`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    places: dict[int, str] = {}
    original = MemTracker._update_peak_stats

    def update(tracker: Any, peak_state: Any) -> None:
        before = dict(tracker._peak_mem)
        original(tracker, peak_state)
        for device, total in tracker._peak_mem.items():
            if device.type != "cpu" and total != before.get(device):
                places[total] = _place(tracker)

    MemTracker._update_peak_stats = update  # type: ignore[method-assign]  # for the block only
    try:
        yield places
    finally:
        MemTracker._update_peak_stats = original  # type: ignore[method-assign]  # as above


# ------------------------------------------------------------------------------------------- importing TorchTitan


def import_torchtitan() -> types.ModuleType:
    """`torchtitan.trainer` (and with it TorchTitan's config, model and parallelize modules), its data-loading
    imports stood in for during the import (`_DATA_MODULES`); TorchTitan's info logging quieted.

    Raises:
        RuntimeError: torchtitan is not installed (it is in `requirements/constraints-native.txt`).
    """
    if "torchtitan.trainer" in sys.modules:
        return sys.modules["torchtitan.trainer"]
    if importlib.util.find_spec("torchtitan") is None:
        raise RuntimeError(
            "benchmarks._torchtitan runs TorchTitan's own code: install it into the native environment with "
            "`pip install --no-deps -c requirements/constraints-native.txt torchtitan spmd-types tyro "
            "docstring-parser` (scripts/setup.sh does)."
        )
    missing = {name.split(".")[0] for name in _DATA_MODULES if importlib.util.find_spec(name.split(".")[0]) is None}
    added = []
    for name, attributes in _DATA_MODULES.items():
        if name.split(".")[0] in missing:
            module = types.ModuleType(name)
            module.__dict__.update(attributes)
            sys.modules[name] = module
            added.append(name)
    try:
        trainer = importlib.import_module("torchtitan.trainer")
    finally:
        for name in added:
            sys.modules.pop(name, None)
    return trainer


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """TorchTitan's log lines (it logs on the root logger: its info, and warnings about what the simulation does not
    use, e.g. CUDA graphs) and DTensor's advice on flattening the clipping norm's mesh, off for the block."""
    loggers = [logging.getLogger(), logging.getLogger("torch.distributed.tensor._redistribute")]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)


# ------------------------------------------------------------------------------------------------------ model configs


def model_config(family: str, model: str | ModelShape, attn_backend: str = "flex") -> Any:
    """TorchTitan's model config for `family`: a published flavor by name (its registry's), or at `model`'s shape
    built by the family's own builders and initializer tables (as its flavors are)."""
    if family not in ("llama3", "qwen3"):
        raise ValueError(f"family={family!r}: expected llama3 or qwen3.")
    if family == "llama3":
        from torchtitan.models import llama3

        if isinstance(model, str):
            return llama3.llama3_configs[model](attn_backend=attn_backend)
        return _llama3_config(model, attn_backend)
    from torchtitan.models import qwen3

    if isinstance(model, str):
        return qwen3.qwen3_configs[model](attn_backend=attn_backend)
    return _qwen3_config(model, attn_backend)


def _llama3_config(shape: ModelShape, attn_backend: str) -> Any:
    """`torchtitan.models.llama3`'s `_8b` / `_70b` at `shape` (fused q/k/v, complex RoPE without Llama 3.1's
    frequency scaling, as the recipe's rotary embeddings)."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, vocab = shape.hidden, shape.vocab
    return llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=shape.norm_eps, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=shape.layers,
            dim=dim,
            n_heads=shape.heads,
            n_kv_heads=shape.kv_heads,
            hidden_dim=shape.intermediate,
            rope=ComplexRoPE.Config(dim=shape.per_head, max_seq_len=131072, theta=shape.rope_theta),
            attn_backend=attn_backend,
        ),
    )


def _qwen3_config(shape: ModelShape, attn_backend: str) -> Any:
    """`torchtitan.models.qwen3`'s `_8b` / `_32b` at `shape`: fused q/k/v, an RMSNorm over each head's query and key
    (`qk_norm`), cos/sin RoPE, untied output (as its 8B and larger)."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    dim, vocab = shape.hidden, shape.vocab
    return qwen3.Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_layers(
            fuse_qkv=True,
            n_layers=shape.layers,
            dim=dim,
            n_heads=shape.heads,
            n_kv_heads=shape.kv_heads,
            head_dim=shape.per_head,
            hidden_dim=shape.intermediate,
            attn_backend=attn_backend,
            rope=CosSinRoPE.Config(dim=shape.per_head, max_seq_len=131072, theta=shape.rope_theta),
        ),
    )


def _model_spec(family: str, config: Any, flavor: str) -> Any:
    from torchtitan.protocols.model_spec import ModelSpec

    if family == "llama3":
        from torchtitan.models import llama3

        reference = llama3.model_registry("debugmodel")
    else:
        from torchtitan.models import qwen3

        reference = qwen3.model_registry("debugmodel")
    return ModelSpec(
        name=reference.name,
        flavor=flavor,
        model=config,
        parallelize_fn=reference.parallelize_fn,
        pipelining_fn=reference.pipelining_fn,
        post_optimizer_build_fn=reference.post_optimizer_build_fn,
        state_dict_adapter=reference.state_dict_adapter,
    )


def trainer_config(
    family: str,
    model: str | ModelShape,
    *,
    tp: int,
    dp_replicate: int,
    ac: str,
    local_batch: int,
    seq_len: int,
    spmd_backend: str,
    loss: str = "chunked",
) -> Any:
    """TorchTitan's `Trainer.Config` for the step: its published Llama 3 / Qwen3 configs' loss (`ChunkedLossWrapper`
    over `CrossEntropyLoss`; `loss="plain"`: `CrossEntropyLoss`) and optimizer (`default_adamw`), the given layout,
    activation checkpointing and batch."""
    titan = import_torchtitan()
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if ac not in AC_MODES:
        raise ValueError(f"ac={ac!r}: expected one of {', '.join(AC_MODES)}.")
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}: expected one of {', '.join(LOSSES)}.")
    ac_config = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[ac]
    common = {
        "optimizer": default_adamw(lr=3e-4),
        "training": TrainingConfig(local_batch_size=local_batch, seq_len=seq_len, steps=2),
        "parallelism": ParallelismConfig(
            data_parallel_replicate_degree=dp_replicate,
            data_parallel_shard_degree=-1,
            tensor_parallel_degree=tp,
            spmd_backend=spmd_backend,  # one of its Literal's, checked by its __post_init__
        ),
        "activation_checkpoint": ac_config,
        "compile": CompileConfig(),
    }
    if family == "transformers":
        if not isinstance(model, str):
            raise ValueError("family='transformers' takes a save_pretrained folder's path (its config.json).")
        from torchtitan.experiments import transformers_modeling_backend as hf_backend
        from torchtitan.experiments.transformers_modeling_backend.configs import TransformersBackendConfig

        # its registry's configs: the "full" flavor (the folder's config as it is), plain cross entropy
        return TransformersBackendConfig(
            hf_model=model, model_spec=hf_backend.model_registry("full"), loss=CrossEntropyLoss.Config(), **common
        )
    config = model_config(family, model)
    flavor = model if isinstance(model, str) else "preset shape"
    return titan.Trainer.Config(
        model_spec=_model_spec(family, config, flavor),
        loss=(
            ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=config.vocab_size))
            if loss == "chunked"
            else CrossEntropyLoss.Config(global_vocab_size=config.vocab_size)
        ),
        **common,
    )


# ------------------------------------------------------------------------------------------------- the simulation


@contextlib.contextmanager
def _standin_patches(device_type: str, notes: list[str]) -> Iterator[None]:
    """What TorchTitan's code needs to run on the simulation's device, put back afterwards: its device type (read
    at import, "cuda" where none is found), eager block masks and causal SDPA for its compiled flex attention; and
    none of its process-wide Dynamo settings."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import flex_attention
    from torchtitan.distributed import activation_checkpoint, parallel_dims
    from torchtitan.models.common import attention
    from torchtitan.tools import utils

    def causal_sdpa(
        q: Any, k: Any, v: Any, *, scale: Any = None, enable_gqa: bool = False, return_aux: Any = None, **_: Any
    ) -> Any:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        if return_aux is not None and getattr(return_aux, "lse", False):
            raise NotImplementedError("the simulation's attention has no log-sum-exp output (context parallel).")
        return out, None

    saved = [
        (parallel_dims, "device_type", device_type),
        (utils, "device_type", device_type),
        (utils, "device_module", torch.get_device_module(device_type)),
        (attention, "_compiled_create_block_mask", flex_attention.create_block_mask),
        (attention.FlexAttention, "_compiled_flex_attn", staticmethod(causal_sdpa)),
        # applying activation checkpointing turns Dynamo's LRU cache off for the whole process (a workaround for
        # compiled flex attention under pipeline stages, neither of which runs here), with no way to read it back
        (activation_checkpoint, "_disable_dynamo_lru_cache", lambda: None),
    ]
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in saved]
    for owner, name, value in saved:
        setattr(owner, name, value)
    notes.append(
        "attention: TorchTitan's FlexAttention compiles its kernel with Inductor (Triton), which the stand-in "
        "cannot run; its block masks are built eagerly and the kernel is causal grouped-query "
        "scaled_dot_product_attention (the recipe's attention op)"
    )
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


@contextlib.contextmanager
def _transformers_restored(family: str, model: str | ModelShape) -> Iterator[None]:
    """For `family="transformers"`: Hugging Face's classes as they were after the block. Building the backend's
    model replaces `PreTrainedModel._init_weights` and `_initialize_weights` and the architecture's decoder layer's
    `__init__` for the whole process (its `_patch_hf_llama_like`), which would change every later Hugging Face model
    (the recipe's among them: its truncated normals cannot run on fake tensors)."""
    if family != "transformers":
        yield
        return
    from transformers import AutoConfig, PreTrainedModel

    model_type = AutoConfig.from_pretrained(str(model)).model_type
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    owners: list[Any] = [PreTrainedModel, *(c for c in vars(modeling).values() if isinstance(c, type))]
    saved = [(owner, name, owner.__dict__[name]) for owner in owners for name in _HF_PATCHED if name in owner.__dict__]
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


#: what TorchTitan's transformers backend replaces on Hugging Face's classes (`_patch_hf_llama_like`)
_HF_PATCHED = ("_init_weights", "_initialize_weights", "__init__")


#: which of TorchTitan's mesh dimensions names a process group that serves several (under FSDP alone, `fsdp`,
#: `batch` and `loss` are the world's group)
_DIM_PREFERENCE = ("fsdp", "dp_shard", "tp", "dp_replicate", "cp", "ep", "efsdp", "pp", "dp", "batch", "loss")


def _mesh_dims(parallel_dims: Any) -> dict[str, str]:
    """Process-group name -> TorchTitan mesh dimension name: its one-dimensional meshes (`_DIM_PREFERENCE` where
    one group serves several), then the world mesh."""
    meshes = {**parallel_dims._single_axis_meshes, **parallel_dims.get_all_one_dimensional_meshes()}
    order = sorted(meshes, key=lambda name: _DIM_PREFERENCE.index(name) if name in _DIM_PREFERENCE else 99)
    groups: dict[str, str] = {}
    for name in order:
        groups.setdefault(meshes[name].get_group().group_name, name)
    groups.setdefault(parallel_dims.world_mesh.get_group().group_name, "world")
    return groups


def _local(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def simulate_torchtitan(
    family: str,
    model: str | ModelShape,
    *,
    world_size: int,
    devices_per_node: int = 64,
    tp: int = 1,
    dp_replicate: int = 1,
    ac: str = "none",
    local_batch: int = 1,
    seq_len: int = 2048,
    spmd_backend: str = "partial_dtensor",
    loss: str = "chunked",
    rank: int = 0,
) -> TitanStep:
    """Simulate two TorchTitan training steps of `family` (`"llama3"`, `"qwen3"`) at `model` (a flavor of its
    registry, e.g. `"8B"`, or a `ModelShape`) as rank `rank` of `world_size` ranks (`devices_per_node` per node):
    tensor parallel over `tp`, HSDP replicas `dp_replicate` (1: FSDP), FSDP over the rest, activation checkpointing
    `ac` ("none", "full": TorchTitan's `FullAC`, "selective": its per-op `SelectiveAC`), `local_batch` sequences of
    `seq_len` tokens per data-parallel rank, `loss` ("chunked": its `ChunkedLossWrapper`, "plain"), `spmd_backend`
    TorchTitan's (module docstring). Returns the second step's peak, memory and collectives (module
    docstring: what runs and what stands in).

    Raises:
        lightning_trn.estimate.EstimateError: the environment cannot simulate (an untested torch, a process group
            already initialized).
        RuntimeError: TorchTitan's code stops in the simulation (the message says where, with its error).
    """
    with quiet(), _transformers_restored(family, model):
        return _simulate(
            family,
            model,
            world_size=world_size,
            devices_per_node=devices_per_node,
            tp=tp,
            dp_replicate=dp_replicate,
            ac=ac,
            local_batch=local_batch,
            seq_len=seq_len,
            spmd_backend=spmd_backend,
            loss=loss,
            rank=rank,
        )


def _simulate(
    family: str,
    model: str | ModelShape,
    *,
    world_size: int,
    devices_per_node: int,
    tp: int,
    dp_replicate: int,
    ac: str,
    local_batch: int,
    seq_len: int,
    spmd_backend: str,
    loss: str,
    rank: int,
) -> TitanStep:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_trn.estimate import patches, simulation
    from lightning_trn.hooks import registry

    start = time.perf_counter()
    patches.native_device()  # the stand-in loaded before TorchTitan reads the device type
    titan = import_torchtitan()
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.cudagraph import wrap_with_cuda_graph

    config = trainer_config(
        family,
        model,
        tp=tp,
        dp_replicate=dp_replicate,
        ac=ac,
        local_batch=local_batch,
        seq_len=seq_len,
        spmd_backend=spmd_backend,
        loss=loss,
    )
    notes: list[str] = []
    device_type = "neuron"
    device = torch.device(device_type, rank % devices_per_node)
    FakeTensorMode.cache_clear()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    result: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(patches.process_settings())
        stack.enter_context(patches.device_count(devices_per_node))
        stack.enter_context(patches.fake_process_group(rank, world_size))
        stack.enter_context(patches.simulation_hooks())
        stack.enter_context(registry.installed((*registry.CHECKPOINT_HOOKS, *registry.DTENSOR_RANDOM_HOOKS)))
        stack.enter_context(_standin_patches(device_type, notes))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        places = stack.enter_context(peak_places())
        # TorchTitan's Trainer.__init__, in its order, for what the step uses
        parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
        parallel_dims.build_mesh()
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
        stack.enter_context(fake_mode)
        model_spec = config.model_spec
        model_config = model_spec.model
        model_config.update_from_config(config=config)
        with torch.device("meta"):
            net = model_config.build()
        loss_fn = config.loss.build(compile_config=config.compile)
        try:
            net = model_spec.parallelize_fn(
                net,
                parallel_dims=parallel_dims,
                training=config.training,
                parallelism=config.parallelism,
                compile_config=config.compile,
                ac_config=config.activation_checkpoint,
                dump_folder="",
            )
        except Exception as err:
            raise RuntimeError(
                f"TorchTitan's {model_spec.parallelize_fn.__name__} (spmd_backend={spmd_backend}) stopped: "
                f"{type(err).__name__}: {err}"
            ) from err
        if spmd_backend == "partial_dtensor":
            notes.append(
                "spmd_backend=partial_dtensor (its plan as DTensors): torchtitan 0.3.0's default, spmd_types, stops "
                "on torch 2.13 in fully_shard (with dp_mesh_dims it takes DTensor parameters on the whole mesh only)"
            )
        net.to_empty(device=device)
        notes.append("init_weights skipped: its truncated-normal draws read values back, which fake tensors cannot")
        net.train()
        model_parts = [net]
        if isinstance(loss_fn, ChunkedLossWrapper):  # as its Trainer: the head runs in the loss, chunk by chunk
            loss_fn.set_lm_head(net.lm_head)
            net._skip_lm_head = True
        optimizers = _optimizers(config, model_parts, notes)
        lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
        trainer = object.__new__(titan.Trainer)
        trainer.config = config
        trainer.parallel_dims = parallel_dims
        trainer.device = device
        trainer.model_config = model_config
        trainer.model_parts = model_parts
        trainer.loss_fn = loss_fn
        trainer.ntokens_seen = 0
        trainer.train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
        trainer.fwd_bwd_fn = wrap_with_cuda_graph(trainer._forward_backward_body)
        # as for pipeline stages (`microbatched`): the chunked loss runs `lm_head` once per chunk in one step, which
        # the tracker's per-module statistics refuse otherwise
        tracker = simulation._tracker(net, list(optimizers.optimizers), True)
        stack.enter_context(tracker)
        counter = dim_counter()
        counter.groups = _mesh_dims(parallel_dims)
        modes: list[Any] = []
        for step in range(2):
            if step == 1:
                modes.append(stack.enter_context(simulation._CollectiveBytes.mode(devices_per_node, True)))
                stack.enter_context(counter)
                counter.counting = True
            _train_step(trainer, optimizers, lr_schedulers, local_batch, seq_len)
            tracker.reset_mod_stats()
            if step == 0:
                simulation._restart_peak(tracker)
        counter.counting = False
        result["snapshot"] = simulation._device_snapshot(tracker.get_tracker_snapshot("peak"))
        result["parameters"] = [_local(p) for p in net.parameters()]
        result["buffers"] = sum(_local(b).numel() * _local(b).element_size() for b in net.buffers())
    memory = simulation._rank_memory(rank, result["snapshot"])
    peak_place = places.get(memory.peak, "")
    parameters = result["parameters"]
    return TitanStep(
        family=family,
        model=model if isinstance(model, str) else "preset shape",
        world_size=world_size,
        devices_per_node=devices_per_node,
        tp=parallel_dims.tp,
        dp_shard=parallel_dims.dp_shard,
        dp_replicate=parallel_dims.dp_replicate,
        ac=ac,
        local_batch=local_batch,
        seq_len=seq_len,
        memory=memory,
        parameters=sum(p.numel() for p in parameters),
        parameter_bytes=sum(p.numel() * p.element_size() for p in parameters),
        buffer_bytes=result["buffers"],
        collectives=simulation._collectives(modes),
        counts=dict(counter.counts),
        bytes=dict(counter.bytes),
        modes=modes,
        peak_place=peak_place,
        notes=notes,
        seconds=time.perf_counter() - start,
    )


def _optimizers(config: Any, model_parts: list[Any], notes: list[str]) -> Any:
    """TorchTitan's `OptimizersContainer` from the config (`default_adamw`, fused), or with `foreach` where torch has
    no fused AdamW for the device."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    device = next(model_parts[0].parameters()).device.type
    if config.optimizer.implementation.startswith("fused") and device not in _get_fused_kernels_supported_devices():
        config.optimizer = dataclasses.replace(config.optimizer, implementation="foreach")
        notes.append(f"AdamW: foreach (torch has no fused AdamW for {device!r}; TorchTitan's default is fused)")
    return config.optimizer.build(model_parts=model_parts)


def _train_step(trainer: Any, optimizers: Any, lr_schedulers: Any, local_batch: int, seq_len: int) -> None:
    """TorchTitan's `Trainer.train_step` for one micro-batch (no gradient accumulation, no pipeline stages), less its
    host-side logging: the batch as its text loader yields it (token ids, per-document positions, labels; one
    document per sequence), in its order of calls."""
    import torch
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    from lightning_trn.estimate import step_time

    config = trainer.config
    optimizers.zero_grad(set_to_none=config.training.disable_cuda_graphs)
    tokens = torch.zeros(local_batch, seq_len, dtype=torch.long)
    positions = torch.arange(seq_len).repeat(local_batch, 1)
    input_dict, labels = {"input": tokens, "positions": positions}, torch.zeros_like(tokens)
    local_valid_tokens = torch.tensor(0, dtype=torch.int64)
    local_valid_tokens += (labels != IGNORE_INDEX).sum()
    parallel_dims = trainer.parallel_dims
    if parallel_dims.dp_enabled:
        global_valid_tokens = dist_utils.dist_sum_tensor(
            local_valid_tokens.to(trainer.device), parallel_dims.get_mesh("batch")
        )
    else:
        global_valid_tokens = local_valid_tokens.to(trainer.device)
    input_dict = {key: value.to(trainer.device) for key, value in input_dict.items()}
    trainer.forward_backward_step(
        input_dict=input_dict, labels=labels.to(trainer.device), global_valid_tokens=global_valid_tokens
    )
    dist_utils.clip_grad_norm_(
        [p for m in trainer.model_parts for p in m.parameters()],
        config.training.max_norm,
        foreach=True,
        pp_mesh=parallel_dims.get_optional_mesh("pp"),
        ep_enabled=parallel_dims.ep_enabled,
    )
    with step_time.optimizer_step():  # the step-time model files its operations as the optimizer's (unfused)
        optimizers.step()
    lr_schedulers.step()
