"""Lightning's `FSDPStrategy` arguments served by FSDP2 (`fully_shard`) on the native backend, shared by the Trainer's
`NeuronFSDPStrategy`: FSDP1 is deprecated upstream, and a Lightning FSDP script should run with only the accelerator
changed (docs/sharding.md).

How each FSDP1 sharding strategy is expressed with FSDP2:

| FSDP1 | FSDP2 |
|---|---|
| FULL_SHARD | a 1-D mesh over all processes, `reshard_after_forward=True` |
| SHARD_GRAD_OP | the same mesh, `reshard_after_forward=False` (weights stay gathered between forward and backward) |
| NO_SHARD | a 2-D (replicate, shard) mesh whose shard dimension is 1: all of it on every rank, gradients all-reduced |
| HYBRID_SHARD | a 2-D mesh, replicated across nodes and sharded within one, `reshard_after_forward=True` |
| _HYBRID_SHARD_ZERO2 | the same mesh, `reshard_after_forward=False` |
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module

#: FSDP1 sharding strategy -> (FSDP2's `reshard_after_forward`, whether the mesh is (replicate, shard))
SHARDING_STRATEGIES = {
    "FULL_SHARD": (True, False),
    "SHARD_GRAD_OP": (False, False),
    "NO_SHARD": (True, True),
    "HYBRID_SHARD": (True, True),
    "_HYBRID_SHARD_ZERO2": (False, True),
}
#: FSDP1 keyword arguments accepted and ignored: FSDP2 behaves as they ask (original parameters, replicated states
#: broadcast from the first rank at setup by the strategy, prefetching by default)
IGNORED_KWARGS = ("use_orig_params", "sync_module_states", "limit_all_gathers", "forward_prefetch", "backward_prefetch")
#: what a Lightning `FSDPStrategy` object holds, by our argument's name
_LIGHTNING_ATTRIBUTES = {
    "cpu_offload": "cpu_offload",
    "mixed_precision": "mixed_precision",
    "state_dict_type": "_state_dict_type",
    "process_group_backend": "_process_group_backend",
    "timeout": "_timeout",
}


def sharding_layout(sharding_strategy: Any) -> tuple[bool, bool]:
    """`(reshard_after_forward, replicate_and_shard)` for an FSDP1 sharding strategy (name or enum); one paragraph
    for one FSDP2 cannot express."""
    name = getattr(sharding_strategy, "name", sharding_strategy)
    name = name.upper() if isinstance(name, str) else name
    if name not in SHARDING_STRATEGIES:
        raise ValueError(
            f"sharding_strategy={sharding_strategy!r} is not available with accelerator='neuron': lightning_trn serves "
            "FSDPStrategy with FSDP2 (`fully_shard`), which expresses FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
            "HYBRID_SHARD and _HYBRID_SHARD_ZERO2 (docs/sharding.md has how). For anything else, write the sharding "
            "in `configure_model` with `fully_shard` under `ModelParallelStrategy`."
        )
    return SHARDING_STRATEGIES[name]


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse FSDP1 keyword arguments that FSDP2 has no counterpart for (one paragraph naming them)."""
    unknown = sorted(set(kwargs) - set(IGNORED_KWARGS))
    if unknown:
        raise ValueError(
            f"FSDPStrategy({', '.join(f'{name}=...' for name in unknown)}) is not available with "
            "accelerator='neuron': lightning_trn serves FSDPStrategy with FSDP2 (`fully_shard`), which takes "
            "auto_wrap_policy, activation_checkpointing_policy, sharding_strategy, state_dict_type, cpu_offload, "
            "mixed_precision and device_mesh (and ignores use_orig_params, sync_module_states, limit_all_gathers, "
            "forward_prefetch, backward_prefetch). For FSDP2's own options, shard in `configure_model` under "
            "`ModelParallelStrategy` (docs/sharding.md)."
        )


def lightning_fsdp_arguments(strategy: Any) -> dict[str, Any]:
    """The arguments to build our FSDP strategy with from a Lightning `FSDPStrategy` object."""
    arguments = {name: getattr(strategy, attribute) for name, attribute in _LIGHTNING_ATTRIBUTES.items()}
    kwargs = dict(getattr(strategy, "kwargs", None) or strategy._fsdp_kwargs)  # the Trainer's / Fabric's name
    arguments["auto_wrap_policy"] = kwargs.pop("auto_wrap_policy", None)
    arguments["device_mesh"] = kwargs.pop("device_mesh", None)
    arguments["sharding_strategy"] = strategy.sharding_strategy
    checkpointing = strategy._activation_checkpointing_kwargs  # Lightning's: {"auto_wrap_policy": p} or {"check_fn": f}
    if "check_fn" in checkpointing:
        check = checkpointing["check_fn"]
        arguments["activation_checkpointing_policy"] = lambda module, recurse, **_: recurse or check(module)
    else:
        arguments["activation_checkpointing_policy"] = checkpointing.get("auto_wrap_policy")
    return {**arguments, **kwargs}


def _wraps(policy: Any, module: Module) -> bool:
    """Whether FSDP1's `auto_wrap_policy` (a set of classes, a `ModuleWrapPolicy`, or a callable
    `(module, recurse, nonwrapped_numel)`) selects `module` as a unit of its own."""
    if policy is None:
        return False
    if isinstance(policy, (set, frozenset, list, tuple)):
        return isinstance(module, tuple(policy))
    classes = getattr(policy, "_module_classes", None)
    if classes is not None:
        return isinstance(module, tuple(classes))
    numel = sum(p.numel() for p in module.parameters())
    return bool(policy(module=module, recurse=False, nonwrapped_numel=numel))


def mixed_precision_policy(mixed_precision: Any) -> Any:
    """FSDP2's `MixedPrecisionPolicy` for FSDP1's `MixedPrecision` (parameter and reduction dtypes), or None."""
    if mixed_precision is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype, reduce_dtype=mixed_precision.reduce_dtype)


def reduction_policy(mp_policy: Any | None, precision: str | None) -> Any | None:
    """The `MixedPrecisionPolicy` to shard with: the user's, or under `bf16-true` without one, gradients
    reduce-scattered in fp32 (FSDP2 would reduce in the parameters' bf16: a 64-way bf16 sum is off by about 1e-2
    relative, against the single bf16 rounding of the fp32 sum's result, as TorchTitan's `reduce_dtype=float32`)."""
    if mp_policy is not None or precision != "bf16-true":
        return mp_policy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(reduce_dtype=torch.float32)


def offload_policy(cpu_offload: bool | Any | None) -> Any:
    """FSDP2's `CPUOffloadPolicy` for FSDP1's `cpu_offload` (True or `CPUOffload(offload_params=True)`), or None."""
    if not getattr(cpu_offload, "offload_params", cpu_offload):
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy()


def shard_by_policy(
    module: Module,
    mesh: Any,
    policy: Any,
    reshard_after_forward: bool,
    mp_policy: Any | None = None,
    offload: Any | None = None,
    forward_methods: tuple[str, ...] = (),
) -> None:
    """`fully_shard` the submodules `policy` selects (innermost first), then `module` itself; `forward_methods` of
    the root run FSDP's forward hooks too (Lightning calls `training_step`, not `forward`). Does nothing to a module
    already sharded."""
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    if isinstance(module, FSDPModule):
        return
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if offload is not None:
        options["offload_policy"] = offload
    units = [sub for sub in module.modules() if sub is not module and _wraps(policy, sub)]
    for unit in reversed(units):  # children before their parents
        fully_shard(unit, **options)
    fully_shard(module, **options)
    for name in forward_methods:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)


#: the LightningModule methods through which Lightning runs the model: FSDP's forward hooks run around them
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class FSDPSharding:
    """Lightning's `FSDPStrategy` arguments as FSDP2 applies them, held by the Trainer's and Fabric's
    `NeuronFSDPStrategy` (`_fsdp`): the mesh of the sharding strategy, and `shard`, which applies them to a module.

    Args:
        auto_wrap_policy: the submodules sharded as units of their own (a set of classes, a `ModuleWrapPolicy`, or
            FSDP1's callable); the rest belongs to the root module's unit.
        sharding_strategy: FULL_SHARD (default), SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or _HYBRID_SHARD_ZERO2.
        cpu_offload: keep the sharded parameters and the optimizer step on the host (FSDP2's `CPUOffloadPolicy`).
        mixed_precision: FSDP1's `MixedPrecision`: its parameter and reduction dtypes become FSDP2's
            `MixedPrecisionPolicy`. Without it, `precision="bf16-true"` reduces gradients in fp32.
        device_mesh: for the hybrid strategies, `(replicas, shards)`; by default (nodes, devices per node).
        **kwargs: FSDP1 options without an FSDP2 counterpart are refused; `use_orig_params` and the prefetch and
            sync options are accepted and have FSDP2's behaviour.
    """

    def __init__(
        self,
        auto_wrap_policy: Any | None = None,
        sharding_strategy: Any = "FULL_SHARD",
        cpu_offload: Any = None,
        mixed_precision: Any = None,
        device_mesh: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        check_kwargs(kwargs)
        self.reshard_after_forward, self.replicate_and_shard = sharding_layout(sharding_strategy)
        self.sharding_name = str(getattr(sharding_strategy, "name", sharding_strategy)).upper()
        if device_mesh is not None and not isinstance(device_mesh, tuple):
            raise ValueError("device_mesh: pass the hybrid mesh's shape, `(replicas, shards)`; the strategy builds it.")
        self.auto_wrap_policy = auto_wrap_policy
        self.mp_policy = mixed_precision_policy(mixed_precision)
        self.offload = offload_policy(cpu_offload)
        self.mesh_shape = device_mesh

    @staticmethod
    def saves_distributed_checkpoint(state_dict_type: str) -> bool:
        """FSDP's `state_dict_type`: "sharded" (torch.distributed.checkpoint directories, each rank writing its
        shards) or "full" (one file of CPU tensors assembled on rank 0)."""
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"state_dict_type={state_dict_type!r}: use 'sharded' or 'full'.")
        return state_dict_type == "sharded"

    def mesh_sizes(self, num_nodes: int, num_processes: int) -> tuple[int, int]:
        """The (data-parallel, tensor-parallel) sizes of the sharding strategy's mesh: all processes in one
        dimension, or (replicas, shards)."""
        if self.replicate_and_shard and self.sharding_name != "NO_SHARD":
            return self.mesh_shape or (num_nodes, num_processes)
        return num_nodes * num_processes, 1

    def shard(self, module: Module, mesh: Any, precision: str | None) -> Module:
        """`fully_shard` by `auto_wrap_policy` and on `module` itself, on the strategy's mesh (with `bf16-true` and no
        `mixed_precision`, gradients reduced in fp32: `reduction_policy`)."""
        shard_by_policy(
            module,
            mesh if self.replicate_and_shard else mesh["data_parallel"],
            self.auto_wrap_policy,
            self.reshard_after_forward,
            reduction_policy(self.mp_policy, precision),
            self.offload,
            forward_methods=STEP_METHODS,
        )
        return module
