"""Models sharded over NeuronCores: what the Trainer's and Fabric's `NeuronModelParallelStrategy` share (the mesh
check, meta-device materialization, seed checkpoints, replicated tensors made equal).

The strategies extend Lightning's own `ModelParallelStrategy` (FSDP2 `fully_shard` and DTensor tensor parallelism on
a 2-D device mesh, torch.distributed.checkpoint directories): the mesh is built on the `neuron` devices, one per
process, the default group is the runtime's `neuron` backend and host objects go over a gloo group
(`lightning_trn.core.parallel.process_group`). Only the native backend shards models (`DeviceRuntime.shards_models`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.nn import Module

from lightning_trn.core.checkpoint.safetensors_blocks import file_shapes, listed, local_block, read_into, weight_files
from lightning_trn.core.parallel.parallel_dims import DATA_CONTEXT, ParallelDims
from lightning_trn.runtime import DeviceRuntime

#: the arguments of Lightning's `ModelParallelStrategy` (Trainer and Fabric) and the attributes that hold them
_LIGHTNING_ARGUMENTS = {
    "data_parallel_size": "_data_parallel_size",
    "tensor_parallel_size": "_tensor_parallel_size",
    "save_distributed_checkpoint": "_save_distributed_checkpoint",
    "process_group_backend": "_process_group_backend",
    "timeout": "_timeout",
}


def check_shards_models(runtime: DeviceRuntime, what: str, pipeline_parallel_size: int = 1) -> None:
    """Raise the one-paragraph refusal for sharded strategies on a backend that cannot shard models (XLA), one
    that says so for pipeline parallelism where it was asked for."""
    if runtime.shards_models:
        return
    if pipeline_parallel_size > 1:
        raise ValueError(
            f"{what}(pipeline_parallel_size={pipeline_parallel_size}) is not available on lightning_trn's "
            f"{runtime.name} backend (torch-neuronx with torch_xla, the training stack of Trn1): pipeline "
            "parallelism runs `torch.distributed.pipelining`'s schedules eagerly, stage by stage, with tensors "
            "handed between processes, and Neuron's XLA stack has neither eager stages nor GSPMD pipelining here. "
            "Run it on the native backend (TorchNeuron on Trn2/Trn3, `LIGHTNING_TRN_BACKEND=native`); on Trn1, fit "
            "the model with ZeRO-1, `strategy='neuron_zero1'`, and activation checkpointing (docs/memory.md)."
        )
    raise ValueError(
        f"{what} is not available on lightning_trn's {runtime.name} backend (torch-neuronx with torch_xla, the "
        "training stack of Trn1): FSDP2 and tensor parallelism (Lightning's ModelParallelStrategy and FSDPStrategy) "
        "need DTensor on an eager device, which the native backend has (TorchNeuron on Trn2/Trn3, "
        "`LIGHTNING_TRN_BACKEND=native`). On the XLA backend, shard the optimizer state over the data-parallel "
        "ranks with ZeRO-1, `strategy='neuron_zero1'` (with Adam and bf16 weights, 16 bytes per parameter become "
        "4 + 12/N on N ranks), and recompute activations with `activation_checkpointing_policy={Block}`: "
        "docs/memory.md has the arithmetic of what fits."
    )


def lightning_model_parallel_arguments(strategy: Any) -> dict[str, Any]:
    """The constructor arguments a Lightning `ModelParallelStrategy` object was made with (to build ours); Fabric's
    also has its `parallelize_fn`."""
    arguments = {name: getattr(strategy, attribute) for name, attribute in _LIGHTNING_ARGUMENTS.items()}
    if hasattr(strategy, "_parallelize_fn"):
        arguments["parallelize_fn"] = strategy._parallelize_fn
    return arguments


def _local_part(full: Tensor, like: Tensor) -> Tensor:
    """This rank's part of `full` (a host tensor every rank holds alike) as `like` holds it, without copying
    (`local_block`): only the shard travels to the device."""
    return full[local_block(full.shape, like)]


#: a module's own initialization of the submodules it was built with on the meta device, used by `materialize`:
#: a method returning `(submodule, init)` pairs in order, `init(submodule)` writing all of that submodule's own
#: parameters and buffers (e.g. `recipes.llm.CausalLM`: Hugging Face's init, replayed as eager construction runs it)
MATERIALIZATION_STEPS = "materialization_steps"
#: what runs `materialize`'s steps: at each one, one submodule's own tensors exist at full size on the host
InitStep = tuple[Module, Callable[[Module], None]]


def _own_tensors(submodule: Module) -> dict[str, Tensor]:
    return {
        name: tensor for name, tensor in {**submodule._parameters, **submodule._buffers}.items() if tensor is not None
    }


def _set_own_tensor(submodule: Module, name: str, tensor: Tensor) -> None:
    """Put `tensor` in `submodule`'s own parameter or buffer slot `name`, past `Module.__setattr__`'s checks."""
    slots = submodule._parameters if name in submodule._parameters else submodule._buffers
    slots[name] = tensor  # type: ignore[assignment]  # `_parameters` holds Parameters: callers give a parameter one


def _reset_parameters_steps(module: Module, done: set[Module]) -> tuple[list[InitStep], set[str]]:
    """`reset_parameters()` of every submodule with tensors of its own not in `done`, in `modules()` order; and the
    class names of those without the method."""
    steps: list[InitStep] = []
    missing = set()
    for submodule in module.modules():
        if submodule in done or not _own_tensors(submodule):
            continue
        if callable(getattr(submodule, "reset_parameters", None)):
            # `Module.__getattr__` types an undeclared attribute as a Tensor or Module; this one is a method
            steps.append((submodule, lambda sub: sub.reset_parameters()))  # type: ignore[operator]  # see above
        else:
            missing.add(type(submodule).__name__)
    return steps, missing


def _run_on_host(submodule: Module, init: Callable[[Module], None]) -> dict[str, Tensor]:
    """`init(submodule)` with full-size, uninitialized host tensors in place of its own; returns them (initialized)
    and puts the submodule's own tensors back."""
    own = _own_tensors(submodule)
    for name, tensor in own.items():
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        if name in submodule._parameters:
            submodule._parameters[name] = torch.nn.Parameter(host, tensor.requires_grad)
        else:
            submodule._buffers[name] = host
    try:
        init(submodule)
        return {name: tensor.detach() for name, tensor in _own_tensors(submodule).items()}
    finally:
        for name, tensor in own.items():
            _set_own_tensor(submodule, name, tensor)


#: the file a seed checkpoint directory holds (`write_seed_checkpoint`): every tensor stored whole, by module name,
#: named as a `save_pretrained` folder's single file
SEED_FILE = "model.safetensors"

#: a host-built module's values by submodule and name, taken by `host_values_to_meta` for `materialize`
HostValues = dict[Module, dict[str, Tensor]]


def _copy_shards(submodule: Module, values: dict[str, Tensor]) -> None:
    """Copy this rank's part of each full-size host value into the submodule's tensor of that name: only the part
    crosses to the device."""
    own = _own_tensors(submodule)
    with torch.no_grad():
        for name, full in values.items():
            tensor = own[name]
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            local.copy_(_local_part(full, tensor))


def empty_meta_tensors(module: Module, device: torch.device) -> None:
    """Give the module's meta tensors uninitialized storage on `device`, the others untouched (`to_empty` would
    empty every tensor `_apply` reaches, torchmetrics' states included: a recipe's running validation sums). FSDP2
    re-points its sharded parameters in its `_apply`."""
    module._apply(lambda tensor: torch.empty_like(tensor, device=device) if tensor.is_meta else tensor)


def materialize(
    module: Module,
    device: torch.device,
    seed_checkpoint: _PATH | None = None,
    host_values: HostValues | None = None,
) -> None:
    """Give a module built on the meta device (`init_module(empty_init=True)`) and then sharded its values on the
    device: each submodule's `reset_parameters()` runs on full-size CPU tensors, from the CPU generator that every rank
    seeded the same, and each rank copies only its shard to the device (a slice of the host tensor). The weights are
    those of the unsharded module initialised on the CPU, whatever the mesh, and no random op runs on DTensors
    (TorchNeuron's generator does not serve DTensor's offset-based random streams). Host memory: one submodule's own
    tensors at full size; host time: every rank draws every full-size tensor (`seed_checkpoint` avoids that).

    A module with a `materialization_steps()` method (`MATERIALIZATION_STEPS`) initializes the submodules it names
    its own way instead, in its order (a submodule may come more than once, e.g. to draw what eager construction drew
    before the final init; it is copied to the device after its last step); `reset_parameters()` serves the rest.

    Args:
        seed_checkpoint: a directory of `write_seed_checkpoint`: each rank reads its shards from it instead
            (`load_seed_checkpoint`), nothing is drawn.
        host_values: full-size host values of submodules (`host_values_to_meta`), copied instead of initialized.
    """
    if not _has_meta_device_parameters_or_buffers(module):
        return
    empty_meta_tensors(module, device)
    if seed_checkpoint is not None:
        load_seed_checkpoint(module, seed_checkpoint)
        return
    host_values = dict(host_values or {})
    hook = getattr(module, MATERIALIZATION_STEPS, None)
    steps = [step for step in (hook() if callable(hook) else []) if step[0] not in host_values]
    default, uninitialized = _reset_parameters_steps(module, {submodule for submodule, _ in steps} | set(host_values))
    steps += default
    last = {submodule: index for index, (submodule, _) in enumerate(steps)}
    for index, (submodule, init) in enumerate(steps):
        initialized = _run_on_host(submodule, init)
        if last[submodule] == index:  # one drawn again later reaches the device after its last step only
            _copy_shards(submodule, initialized)
    while host_values:  # each host tensor released once its shard is on the device
        _copy_shards(*host_values.popitem())
    if uninitialized:
        rank_zero_warn(
            "Parameter initialization incomplete. These modules have parameters or buffers with uninitialized memory "
            f"because they don't define a `reset_parameters()` method: {', '.join(sorted(uninitialized))}"
        )


def host_values_to_meta(module: Module) -> HostValues:
    """Put a module's host (CPU) parameters and buffers on the meta device, tied ones staying tied, and return their
    values for `materialize`. Sharding the meta module and then materializing it sends each rank only its shards to
    the device, where moving the host-built module first would send all of it."""
    values: HostValues = {}
    on_meta: dict[int, Tensor] = {}
    for submodule in module.modules():
        for name, tensor in _own_tensors(submodule).items():
            if tensor.device.type != "cpu":
                continue
            values.setdefault(submodule, {})[name] = tensor.detach()
            if id(tensor) not in on_meta:
                meta = torch.empty_like(tensor, device="meta")
                is_parameter = isinstance(tensor, torch.nn.Parameter)
                on_meta[id(tensor)] = torch.nn.Parameter(meta, tensor.requires_grad) if is_parameter else meta
            _set_own_tensor(submodule, name, on_meta[id(tensor)])
    return values


#: name segments that wrappers insert and `state_dict()` hides (activation checkpointing, `torch.compile`)
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _unwrapped_name(name: str) -> str:
    """A parameter's or buffer's name without the segments wrappers insert: the name `state_dict()` gives it."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _state_to_seed(module: Module) -> dict[str, Tensor]:
    """What a seed checkpoint holds: every parameter and buffer by name without wrappers' segments (activation
    checkpointing may wrap blocks after the checkpoint was written), non-persistent buffers included (they are not
    in `state_dict()`, and a meta-built module has no values for them either)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {_unwrapped_name(name): tensor for name, tensor in tensors}


def write_seed_checkpoint(module_factory: Callable[[], Module], path: _PATH) -> Path:
    """Build the model once, in this process, and write its initial parameters and buffers into the directory
    `path`, as one safetensors file (`SEED_FILE`), for `materialize(..., seed_checkpoint=path)` (the strategies'
    `seed_checkpoint=path`): then no rank draws full-size tensors on its host at setup, each reads its shards.

    `module_factory()` returns the module the strategy gets (the LightningModule for the Trainer, the model for
    `fabric.setup`), seeded as the training script seeds it; built on the meta device it is materialized here on the
    host first. Run it in one process, before training (as TorchTitan's `create_seed_checkpoint`). Returns the
    directory."""
    from safetensors.torch import save_file

    module = module_factory()
    materialize(module, torch.device("cpu"))
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous() for name, tensor in _state_to_seed(module).items()}
    save_file(state, directory / SEED_FILE)
    return directory


def load_seed_checkpoint(module: Module, path: _PATH) -> None:
    """Read `module`'s parameters and buffers from a `write_seed_checkpoint` directory, in place, on every rank
    independently (no collective). Each rank reads only the block of each tensor it holds (a DTensor's local shard,
    all of a plain tensor) through safetensors' slicing, one tensor at a time (`safetensors_blocks.read_into`): a
    tensor is stored whole, and a reader that loads whole stored tensors (torch.distributed.checkpoint's) would read
    the whole model on every rank.

    Raises:
        FileNotFoundError: the directory has no `SEED_FILE`.
        ValueError: the file lacks some of the module's tensors, or holds them in other shapes (written from
            another module).
    """
    file = Path(path) / SEED_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"The seed checkpoint {str(path)!r} has no {SEED_FILE}: write it with `write_seed_checkpoint` (one "
            "written by an earlier lightning_trn, a torch.distributed.checkpoint directory, must be written again)."
        )
    state = _state_to_seed(module)
    shapes = file_shapes(weight_files(Path(path)))
    missing = sorted(set(state) - set(shapes))
    mismatched = [
        f"{name} {shapes[name]} vs {list(tensor.shape)}"
        for name, tensor in state.items()
        if name in shapes and list(tensor.shape) != shapes[name]
    ]
    problems = []
    if missing:
        counted = f"{len(missing)} of the module's {len(state)} parameters and buffers"
        problems.append(f"it has no {listed(missing)} ({counted})")
    if mismatched:
        problems.append(f"shapes stored vs the module's: {listed(mismatched)}")
    if problems:
        raise ValueError(
            f"The seed checkpoint {str(path)!r} does not fit the module: {'; '.join(problems)}. Write it with "
            "`write_seed_checkpoint` from a factory that builds the module the strategy gets: the LightningModule "
            "for the Trainer, the model passed to `fabric.setup` for Fabric."
        )
    with torch.no_grad():
        for name, tensor in state.items():
            read_into(tensor, file, name)


def broadcast_replicated(module: Module, device: torch.device, group: Any = None, alone: bool = False) -> None:
    """Make what every rank holds alike equal to the first rank's, in place: plain (non-DTensor) parameters and
    buffers over all ranks, and the local tensor of each DTensor over every mesh dimension it is replicated on (HSDP's
    replicate dimension, NO_SHARD, replicated tensor-parallel weights). Each rank drew these from its own generator,
    so one rank that drew once more than the others (a data loader, a dropout) would otherwise train diverging
    replicas unnoticed. Costs one broadcast per such tensor at setup; sharded tensors, and tensors not on `device`'s
    type (offloaded to the host), are not touched. Under pipeline parallelism plain tensors are broadcast over
    `group`, the ranks holding the same stages (`alone`: no other rank does)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    tensors = {id(tensor): tensor for tensor in [*module.parameters(), *module.buffers()]}
    with torch.no_grad():
        for tensor in tensors.values():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()
            if local.device.type != device.type:
                continue
            if not isinstance(tensor, DTensor):
                if not alone:
                    dist.broadcast(local, group=group, group_src=0)
                continue
            for dim, placement in enumerate(tensor.placements):
                if isinstance(placement, Replicate):
                    dist.broadcast(local, group=tensor.device_mesh.get_group(dim), group_src=0)


def check_replicated_sharding(module: Module, mesh: Any) -> None:
    """Refuse parameters whose gradients would never be reduced over a dimension whose ranks compute different
    ones: with HSDP replicas, a module sharded over the data-parallel dimension alone; with context parallel (each
    rank a part of every sequence), a trainable parameter not sharded over data x context (`fsdp_mesh`). The copies
    would drift apart silently."""
    from torch.distributed.tensor import DTensor

    names = mesh.mesh_dim_names or ()
    if "context_parallel" in names:
        alone = sorted(
            name
            for name, parameter in module.named_parameters()
            if parameter.requires_grad
            and not (isinstance(parameter, DTensor) and DATA_CONTEXT in (parameter.device_mesh.mesh_dim_names or ()))
        )
        if alone:
            raise ValueError(
                f"The device mesh has a context-parallel dimension (context_parallel_size="
                f"{mesh['context_parallel'].size()}: each rank computes the gradients of its part of every "
                f"sequence), but {listed(alone)} are not sharded over data x context, so their gradients would not "
                "be summed over the context ranks. Shard the model with FSDP2 over "
                "`lightning_trn.ParallelDims.fsdp_mesh(self.device_mesh)` (the flattened "
                f'`device_mesh["{DATA_CONTEXT}"]`, with "replicate" before it for HSDP), every block and the root.'
            )
    if "replicate" not in names:
        return
    alone = sorted(
        name
        for name, parameter in module.named_parameters()
        if isinstance(parameter, DTensor)
        and "data_parallel" in (parameter.device_mesh.mesh_dim_names or ())
        and "replicate" not in (parameter.device_mesh.mesh_dim_names or ())
    )
    if alone:
        raise ValueError(
            f"The device mesh has a replicate dimension (replicate_size={mesh['replicate'].size()}), but "
            f"{listed(alone)} are sharded over `device_mesh['data_parallel']` alone: their gradients would not be "
            "reduced over the replicas. Shard with HSDP's 2-D mesh, "
            "`fully_shard(module, mesh=device_mesh['replicate', 'data_parallel'])`."
        )


def _on_tensor_parallel(parameter: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(parameter, DTensor) and "tensor_parallel" in (parameter.device_mesh.mesh_dim_names or ())


def _left_out_of_tensor_parallel(module: Module) -> list[tuple[str, Tensor]]:
    """The parameters inside blocks (entries of the module's ModuleLists and ModuleDicts) that the tensor-parallel
    plan split in part, but that are not DTensors over the `tensor_parallel` dimension themselves."""
    from torch.nn import ModuleDict, ModuleList

    left: list[tuple[str, Tensor]] = []
    seen: set[int] = set()  # nested ModuleDicts reach a parameter once per level: it is listed (and reduced) once
    for stack_name, stack in module.named_modules():
        if not isinstance(stack, (ModuleList, ModuleDict)):
            continue
        for block_name, block in stack.named_children():
            parameters = list(block.named_parameters())
            if any(_on_tensor_parallel(p) for _, p in parameters):
                prefix = _unwrapped_name(f"{stack_name}.{block_name}." if stack_name else f"{block_name}.")
                for name, parameter in parameters:
                    if not _on_tensor_parallel(parameter) and id(parameter) not in seen:
                        seen.add(id(parameter))
                        left.append((prefix + _unwrapped_name(name), parameter))
    return left


def check_tensor_parallel_gradients(module: Module, mesh: Any) -> None:
    """Refuse, before the first update, parameters that the tensor-parallel plan left whole inside the blocks it
    split, where their gradients differ between the tensor-parallel ranks: their input was split over the ranks (a
    norm over each attention head, as Qwen3's q_norm and k_norm), so each rank's gradient is only its part and the
    copies would drift apart without an error. A whole parameter whose input is replicated (a block's norm before a
    column-wise layer) has the same gradient on every rank and passes. Called once the first step's gradients are
    complete (the strategies' `reduce_gradients`); one all-reduce of those gradients."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import is_fake

    if "tensor_parallel" not in (mesh.mesh_dim_names or ()) or mesh["tensor_parallel"].size() == 1:
        return
    named = [(name, p.grad) for name, p in _left_out_of_tensor_parallel(module) if p.grad is not None]
    if not named:
        return
    local = [grad.to_local() if hasattr(grad, "to_local") else grad for _, grad in named]
    if any(is_fake(grad) for grad in local):  # the estimator's simulated step: there are no values to compare
        return
    flat = torch.cat([g.detach().flatten().float() for g in local])
    bounds = torch.stack([flat, -flat])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=mesh["tensor_parallel"].get_group())
    spread = (bounds[0] + bounds[1]).split([g.numel() for g in local])  # largest minus smallest, per element
    diverging = [
        name
        for (name, _), part, grad in zip(named, spread, local, strict=True)
        if part.numel() and float(part.max()) > 1e-3 * float(grad.detach().abs().max().clamp_min(1e-30))
    ]
    if diverging:
        raise ValueError(
            f"Tensor parallel over {mesh['tensor_parallel'].size()} ranks: {listed(sorted(diverging))} "
            f"{'is' if len(diverging) == 1 else 'are'} inside blocks that the tensor-parallel plan splits, left out "
            "of the plan (a whole copy on every rank), and the ranks computed different gradients for "
            f"{'it' if len(diverging) == 1 else 'them'}, so the copies would drift apart. Nothing was updated. "
            "Either their input was split over the ranks, so each rank's gradient is only its part: add them to "
            "the plan of `parallelize_module` (a norm over each attention head's features, Qwen3's q_norm and "
            "k_norm, takes `SequenceParallel(sequence_dim=2, use_local_output=True)`, as TorchTitan's Qwen3 plan; a "
            "norm over the sequence-split hidden states takes `SequenceParallel()`). Or the parameters the plan "
            "leaves whole started different on each rank (an embedding or head initialized without a common "
            "seed): call `lightning.seed_everything(...)` before the model is built, or load its weights."
        )


def setup_outer_mesh(
    strategy: Any, lightning_setup: Callable[[], None], dims: ParallelDims, pipelining: Any, precision: Any
) -> None:
    """A Neuron `ModelParallelStrategy`'s `setup_environment` (Trainer and Fabric): Lightning's own
    (`lightning_setup`), and with pipeline stages or HSDP replicas the N-D mesh of `dims` in place of Lightning's 2-D
    one, which is built over a data-parallel size standing for the outer dimensions together; then the pipeline
    groups (`lightning_trn.core.parallel.pipeline.Pipelining.setup`), which are also the scope of gradient
    clipping's norm."""
    if dims.outer == 1:
        lightning_setup()
        return
    sizes = dims.sizes(strategy.num_nodes, strategy.num_processes)
    # Lightning's setup reads its two sizes; they stand for the outer dimensions only while it runs
    strategy._data_parallel_size = dims.outer * sizes["data_parallel"]
    strategy._tensor_parallel_size = sizes["tensor_parallel"]
    lightning_setup()
    strategy._data_parallel_size = sizes["data_parallel"]
    strategy._device_mesh = ParallelDims.build_mesh(sizes, strategy.root_device.type)
    pipelining.setup(strategy._device_mesh, strategy.root_device, strategy._process_group_backend)
    precision.gradient_norm_scope = pipelining
