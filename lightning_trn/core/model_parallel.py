"""`ModelParallelCore`: models sharded over NeuronCores, shared by the Trainer's and Fabric's
`NeuronModelParallelStrategy`.

The strategies extend Lightning's own `ModelParallelStrategy` (FSDP2 `fully_shard` and DTensor tensor parallelism on
a 2-D device mesh, torch.distributed.checkpoint directories): the mesh is built on the `neuron` devices, one per
process, the default group is the runtime's `neuron` backend and host objects go over a gloo group
(`lightning_trn.core.process_group`). Only the native backend shards models (`DeviceRuntime.shards_models`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module

from lightning_trn.core.process_group import ProcessGroupCore
from lightning_trn.runtime import DeviceRuntime, get_runtime

#: the arguments of Lightning's `ModelParallelStrategy` (Trainer and Fabric) and the attributes that hold them
_LIGHTNING_ARGUMENTS = {
    "data_parallel_size": "_data_parallel_size",
    "tensor_parallel_size": "_tensor_parallel_size",
    "save_distributed_checkpoint": "_save_distributed_checkpoint",
    "process_group_backend": "_process_group_backend",
    "timeout": "_timeout",
}


def check_shards_models(runtime: DeviceRuntime, what: str) -> None:
    """Raise the one-paragraph refusal for sharded strategies on a backend that cannot shard models (XLA)."""
    if runtime.shards_models:
        return
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


def _shard_of(full: Tensor, like: Tensor) -> Tensor:
    """This rank's part of `full` (every rank holds the same) as `like` holds it: a DTensor's local shard, on the
    device (no communication), or all of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


#: a module's own initialization of the submodules it was built with on the meta device, used by `materialize`:
#: a method returning `(submodule, init)` pairs in order, `init(submodule)` writing all of that submodule's own
#: parameters and buffers (e.g. `recipes.llm.CausalLM`: Hugging Face's init, replayed as eager construction runs it)
MATERIALIZATION_STEPS = "materialization_steps"
#: what runs `materialize`'s steps: at each one, one submodule's own tensors exist at full size on the host
InitStep = tuple[Module, Callable[[Module], None]]


def _own_tensors(submodule: Module) -> dict[str, Tensor]:
    return {name: tensor for name, tensor in {**submodule._parameters, **submodule._buffers}.items()
            if tensor is not None}


def _reset_parameters_steps(module: Module, done: set[Module]) -> tuple[list[InitStep], set[str]]:
    """`reset_parameters()` of every submodule with tensors of its own not in `done`, in `modules()` order; and the
    class names of those without the method."""
    steps: list[InitStep] = []
    missing = set()
    for submodule in module.modules():
        if submodule in done or not _own_tensors(submodule):
            continue
        if callable(getattr(submodule, "reset_parameters", None)):
            steps.append((submodule, lambda sub: sub.reset_parameters()))
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
            (submodule._parameters if name in submodule._parameters else submodule._buffers)[name] = tensor


def materialize(module: Module, device: torch.device) -> None:
    """Give a module built on the meta device (`init_module(empty_init=True)`) and then sharded its values on the
    device: each submodule's `reset_parameters()` runs on full-size CPU tensors, from the CPU generator that every rank
    seeded the same, and each rank keeps its shard. The weights are those of the unsharded module initialised on the
    CPU, whatever the mesh, and no random op runs on DTensors (TorchNeuron's generator does not serve DTensor's
    offset-based random streams). Host memory: one submodule's own tensors at full size.

    A module with a `materialization_steps()` method (`MATERIALIZATION_STEPS`) initializes the submodules it names
    its own way instead, in its order (a submodule may come more than once, e.g. to draw what eager construction drew
    before the final init; it is copied to the device after its last step); `reset_parameters()` serves the rest."""
    if not _has_meta_device_parameters_or_buffers(module):
        return
    # `to_empty` on the meta tensors only: it would empty every tensor `_apply` reaches, torchmetrics' states
    # included (a recipe's running validation sums). FSDP2 re-points its sharded parameters in its `_apply`.
    module._apply(lambda tensor: torch.empty_like(tensor, device=device) if tensor.is_meta else tensor)
    hook = getattr(module, MATERIALIZATION_STEPS, None)
    steps: list[InitStep] = list(hook()) if callable(hook) else []
    default, uninitialized = _reset_parameters_steps(module, {submodule for submodule, _ in steps})
    steps += default
    last = {submodule: index for index, (submodule, _) in enumerate(steps)}
    for index, (submodule, init) in enumerate(steps):
        initialized = _run_on_host(submodule, init)
        if last[submodule] != index:
            continue  # drawn again later: only the last step's values reach the device
        with torch.no_grad():
            for name, tensor in _own_tensors(submodule).items():
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                local.copy_(_shard_of(initialized[name].to(device), tensor))
    if uninitialized:
        rank_zero_warn(
            "Parameter initialization incomplete. These modules have parameters or buffers with uninitialized memory "
            f"because they don't define a `reset_parameters()` method: {', '.join(sorted(uninitialized))}"
        )


class ModelParallelCore(ProcessGroupCore):
    """Mixed into a Neuron strategy before Lightning's `ModelParallelStrategy` (the Trainer's or Fabric's): the
    process groups are lightning_trn's, the device mesh and everything sharded are Lightning's, on `neuron` devices.

    Raises:
        ValueError: on a backend that cannot shard models (XLA), at construction.
    """

    strategy_name = "neuron_model_parallel"
    strategy_description = "FSDP2 and tensor parallel over NeuronCores, native backend (lightning_trn)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_shards_models(get_runtime(), type(self).__name__)
        super().__init__(*args, **kwargs)

    def _configure_launcher(self) -> None:
        """Called once the devices and nodes are known (at `Trainer(...)` / `Fabric(...)`): check the mesh fits."""
        self._check_mesh_sizes()
        super()._configure_launcher()  # type: ignore[misc]

    def _check_mesh_sizes(self) -> None:
        data = self._data_parallel_size  # type: ignore[attr-defined]
        tensor = self._tensor_parallel_size  # type: ignore[attr-defined]
        sizes = (self.num_nodes if data == "auto" else data) * (self.num_processes if tensor == "auto" else tensor)
        processes = self.num_nodes * self.num_processes
        if sizes != processes:
            raise ValueError(
                f"{type(self).__name__}(data_parallel_size={data!r}, tensor_parallel_size={tensor!r}) needs {sizes} "
                f"processes, the run has {processes} (devices={self.num_processes} x num_nodes={self.num_nodes}). "
                "Choose sizes whose product is devices x num_nodes; tensor parallelism is fastest within a node, "
                "e.g. tensor_parallel_size=devices and data_parallel_size=num_nodes (the defaults, 'auto')."
            )

    def setup_environment(self) -> None:
        """Claim this process's NeuronCore and join the process group before Lightning's setup (the device, then the
        process group again, already joined, and the mesh): TorchNeuron refuses a `neuron` process group once a
        device tensor exists, and the accelerator's setup runs a probe on the device."""
        self._claim_device()
        self._setup_distributed()
        super().setup_environment()  # type: ignore[misc]
