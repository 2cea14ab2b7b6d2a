"""The native backend: TorchNeuron's `neuron` device (PyTorch PrivateUse1; torch-neuronx 2.10+, Trn2/Trn3), or the
CPU stand-in (`lightning_trn.standin`). Eager: there is no graph to cut, and device ops run as they are called.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, cast

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from typing_extensions import override

from lightning_trn.runtime.base import DeviceRuntime, RuntimeMetrics
from lightning_trn.runtime.collectives import Collectives
from lightning_trn.runtime.discovery import CPU, NEURON, NeuronUnavailableError, Platform
from lightning_trn.runtime.environment import EnvironmentPatch
from lightning_trn.runtime.host_collectives import HostCollectives
from lightning_trn.runtime.selection import native_device_available


def _standin() -> ModuleType | None:
    """The stand-in's module when it is this process's `neuron` device (never imported from here: that loads it)."""
    module = sys.modules.get("lightning_trn.standin")
    return module if module is not None and module.is_loaded() else None


def _torchneuron_fallbacks() -> dict[str, int]:
    """The ops TorchNeuron ran on the host since the process started (or its `clear_op_tracking()`), each counted
    once: `torch_neuronx.get_fallback_ops()` lists names (`aten::add.Tensor`), not calls. Ops still queued on the
    device are not listed yet. Empty where TorchNeuron is not installed."""
    try:
        import torch_neuronx
    except ImportError:
        return {}
    get_fallback_ops = getattr(torch_neuronx, "get_fallback_ops", None)
    return {str(name): 1 for name in get_fallback_ops()} if get_fallback_ops is not None else {}


class NativeRuntime(DeviceRuntime):
    """All calls into the native `neuron` device go through here."""

    name = "native"
    shards_models = True
    device_type = "neuron"
    cpu_platform = "the CPU stand-in"

    def __init__(self) -> None:
        self._platform: Platform | None = None

    @override
    def is_installed(self) -> bool:
        return native_device_available()

    @override
    def detect_platform(self) -> Platform:
        if self._platform is None:
            count = torch.get_device_module("neuron").device_count() if native_device_available() else 0
            if count < 1:
                raise NeuronUnavailableError(
                    "`accelerator='neuron'` on the native backend found no `neuron` device: torch reports "
                    f"{count}. On a trn2/trn3 check the Neuron driver and NEURON_RT_VISIBLE_CORES; without Trainium "
                    "set LIGHTNING_TRN_STANDIN=1 before `import lightning_trn`."
                )
            if _standin() is not None:  # a CPU pretending: not NeuronCores (software rounding, no runtime switches)
                self._platform = Platform(
                    CPU,
                    count,
                    "the neuron stand-in (LIGHTNING_TRN_STANDIN_DEVICES)",
                    # the stand-in reads no Neuron runtime variable
                    "set LIGHTNING_TRN_STANDIN_DEVICES to the number of stand-in devices before `import lightning_trn`",
                )
            else:
                self._platform = Platform(NEURON, count, "torch.neuron.device_count(): logical NeuronCores")
        return self._platform

    @override
    def device(self) -> torch.device:
        return torch.device(self.device_type, torch.get_device_module(self.device_type).current_device())

    @override
    def sync(self, wait: bool = False) -> None:
        """Eager: nothing to cut. `wait=True` waits for the device's queued work."""
        if wait:
            torch.get_device_module(self.device_type).synchronize()

    @override
    def prefetch(self, dataloader: Iterable, device: torch.device) -> Iterable:
        return (move_data_to_device(batch, device) for batch in dataloader)

    @override
    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """CPU copies of `tensors` for one host sync: each copy is queued without waiting (into pinned memory, which
        PyTorch allocates for a `non_blocking` copy to the host), then the host waits once for the devices they
        came from, as an expert's CUDA code does. One blocking `.cpu()` per tensor would be a host sync each."""
        copies = [t.detach().to("cpu", non_blocking=True) for t in tensors]
        module = torch.get_device_module(self.device_type)
        for device in {t.device for t in tensors if t.device.type == self.device_type}:
            module.synchronize(device)
        return copies

    @override
    def memory_stats(self, device: torch.device) -> dict[str, Any]:
        try:
            return dict(torch.get_device_module(self.device_type).memory_stats(device))
        except (AttributeError, RuntimeError):
            return {}

    @override
    def metrics(self) -> RuntimeMetrics:
        """Graphs `torch.compile` built (Dynamo's count, any backend); device reads, host syncs and CPU-fallback ops
        as the stand-in counts them. TorchNeuron counts no transfers (zeros there) and lists its fallback ops by
        name: each one seen counts once, so a phase's difference shows the ops that first fell back in it."""
        dynamo = sys.modules.get("torch._dynamo.utils")  # never imported from here: only if torch.compile ran
        compiles = dynamo.counters["stats"]["unique_graphs"] if dynamo is not None else 0
        standin = _standin()
        if standin is None:
            return RuntimeMetrics(compiles=compiles, cpu_fallbacks=_torchneuron_fallbacks())
        counts = standin.counters()
        return RuntimeMetrics(
            compiles=compiles,
            device_to_host=counts["device_to_host"],
            host_to_device=counts["host_to_device"],
            scalar_reads=counts["scalar_reads"],
            host_syncs=counts["host_syncs"],
            cpu_fallbacks=standin.host_op_counts(),
        )

    @override
    def autocast(self, dtype: torch.dtype) -> AbstractContextManager:
        return torch.autocast(self.device_type, dtype=dtype)

    @override
    def compile(self, module: torch.nn.Module, *, fullgraph: bool) -> torch.nn.Module:
        """TorchNeuron's `torch.compile` backend (the stand-in registers one of the same name)."""
        # a module compiles to an `OptimizedModule`; torch's annotations only say "a callable"
        return cast(torch.nn.Module, torch.compile(module, backend="neuron", fullgraph=fullgraph, dynamic=False))

    @override
    def compile_in_place(self, module: torch.nn.Module, *, fullgraph: bool) -> bool:
        """`module.compile` with the options of `compile`."""
        module.compile(backend="neuron", fullgraph=fullgraph, dynamic=False)
        return True

    @override
    def manual_seed(self, seed: int) -> None:
        torch.get_device_module(self.device_type).manual_seed_all(seed)

    @override
    def world_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    @override
    def supports_cross_process_collectives(self) -> bool:
        return True

    @override
    def configure_process(
        self,
        *,
        global_rank: int,
        local_rank: int,
        world_size: int,
        local_world_size: int,
        main_address: str,
        env: EnvironmentPatch,
    ) -> None:
        """One NeuronCore per process: device `local_rank` of those torch sees. When the launcher already gave each
        process its own core (`NEURON_RT_VISIBLE_CORES` per rank), torch sees one and it is `neuron:0`."""
        module = torch.get_device_module(self.device_type)
        count = module.device_count()
        if count == 1:
            return
        if local_rank >= count:
            raise NeuronUnavailableError(
                f"Data-parallel worker with local rank {local_rank} of {local_world_size} on this node, but torch sees "
                f"only {count} `neuron` devices (logical NeuronCores). Lower `devices` to at most {count}, or "
                f"{self.detect_platform().widen}."
            )
        module.set_device(local_rank)

    @override
    def process_group_backend(self) -> str:
        return "neuron"

    @override
    def collectives(self, world_size: int, group: Any = None) -> Collectives:
        """Collectives on the device tensors themselves, in the default (`neuron`) process group; `group`, the
        strategy's gloo group, carries host objects only."""
        return DeviceCollectives(world_size)


class DeviceCollectives(HostCollectives):
    """`HostCollectives` without the host copies: the `neuron` backend takes device tensors."""

    @override
    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @override
    def metric_sync_fn(self) -> None:
        """torchmetrics' default gather already works: the default group takes device tensors."""
        return None
