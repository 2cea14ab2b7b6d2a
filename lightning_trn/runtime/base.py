"""The device-runtime interface: what the accelerator, strategies, precision plugin and callbacks may ask of it.

`XlaRuntime` implements it with torch_xla (Trainium through torch-neuronx, or XLA:CPU). A second backend, such as
AWS's native PyTorch "neuron" device, implements the same methods and is picked in `lightning_trn.runtime.get_runtime`
without changes to the strategies.
"""

from __future__ import annotations

import functools
import operator
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_trn.runtime.collectives import Collectives
from lightning_trn.runtime.discovery import NEURON, NeuronUnavailableError, Platform, neuron_chip, software_versions
from lightning_trn.runtime.environment import EnvironmentPatch


@dataclass(frozen=True)
class RuntimeMetrics:
    """Cumulative counters of what the runtime did: graph compiles, executions, transfers and CPU fallbacks."""

    compiles: int = 0
    executions: int = 0
    device_to_host: int = 0
    host_to_device: int = 0
    #: `.item()`-style reads of a device scalar: each one blocks the host on the device.
    scalar_reads: int = 0
    #: times the host waited for the device: reads to the host that block (on XLA every transfer), `.item()`,
    #: synchronize calls. Copies queued without waiting (`non_blocking`, native) are transfers but no host sync.
    host_syncs: int = 0
    #: ops the runtime could not lower and ran on the host instead, by name (`aten::nonzero` ...).
    cpu_fallbacks: dict[str, int] = field(default_factory=dict)

    def _combine(self, other: RuntimeMetrics, op: Callable[[int, int], int]) -> RuntimeMetrics:
        """Every counter of `self` and `other` combined with `op`; fallbacks that come to 0 are dropped."""
        counts = {
            f.name: op(getattr(self, f.name), getattr(other, f.name)) for f in fields(self) if f.name != "cpu_fallbacks"
        }
        names = set(self.cpu_fallbacks) | set(other.cpu_fallbacks)
        fallbacks = {n: op(self.cpu_fallbacks.get(n, 0), other.cpu_fallbacks.get(n, 0)) for n in names}
        return RuntimeMetrics(**counts, cpu_fallbacks={n: v for n, v in fallbacks.items() if v})

    def __sub__(self, other: RuntimeMetrics) -> RuntimeMetrics:
        return self._combine(other, operator.sub)

    def __add__(self, other: RuntimeMetrics) -> RuntimeMetrics:
        return self._combine(other, operator.add)


@functools.cache  # said once per process and platform
def _say_no_device_stats(platform: str) -> None:
    rank_zero_warn(
        f"lightning_trn: {platform} offers no device statistics (utilization, device memory): DeviceStatsMonitor "
        "logs none here. On a Neuron host they come from the runtime and `neuron-monitor`."
    )


def autograd_lacks_device_worker(err: RuntimeError) -> bool:
    """Whether `err` is autograd's assert for a device it started no worker thread for (see `check_autograd`)."""
    return "device_ready_queues_" in str(err)


class _InitializedDeviceModule:
    """A device module as `torch.utils.checkpoint` reads it: `module`'s functions, reported initialized."""

    _initialized = True

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class DeviceRuntime(ABC):
    """One device backend. Methods are called on every rank; none may block unless its docstring says so."""

    #: short name, e.g. "xla"
    name: str = ""
    #: the torch device type of this backend's devices ("xla", "neuron")
    device_type: str = ""
    #: what this backend runs on where there are no NeuronCores (messages and reports)
    cpu_platform: str = ""
    #: whether the backend has a persistent compile cache that `enable_compile_cache` points somewhere
    has_compile_cache: bool = False
    #: whether models can be sharded with torch's DTensor, FSDP2 and tensor parallelism on this backend's devices
    shards_models: bool = False
    #: whether this backend's process groups have `send`/`recv` (pipeline stages then use them; else broadcasts in
    #: 2-rank groups, `lightning_trn.core.parallel.stage_transport`). TorchNeuron's are not confirmed: its source
    #: snapshot has none, its docs do not say
    point_to_point: bool = False
    #: whether the Neuron runtime under this backend rounds bf16 results stochastically when
    #: `NEURON_RT_STOCHASTIC_ROUNDING_EN=1` (documented for the XLA stack; TorchNeuron's docs and source name no switch)
    runtime_rounds_bf16: bool = False

    @abstractmethod
    def is_installed(self) -> bool:
        """Whether the backend's Python package can be imported."""

    @abstractmethod
    def detect_platform(self) -> Platform:
        """The platform this process will use; raises `NeuronUnavailableError` with the fix if there is none."""

    def on_neuron(self) -> bool:
        """Whether this process runs on real NeuronCores: False on XLA:CPU and where no platform is usable."""
        try:
            return self.detect_platform().kind == NEURON
        except NeuronUnavailableError:
            return False

    def chip(self) -> str | None:
        """The Trainium generation of this host's NeuronCores ("trn1", "trn2", "trn3"); None off Neuron."""
        return neuron_chip() if self.on_neuron() else None

    def describe_platform(self) -> str:
        """What this process runs on, for reports: "NeuronCores (trn2)", "XLA:CPU", ..."""
        return f"NeuronCores ({self.chip() or 'chip unknown'})" if self.on_neuron() else self.cpu_platform

    def core_label(self, device: torch.device) -> str:
        """Which core `device` is, for messages naming a failing rank: the NeuronCore the launcher gave this process
        (`NEURON_RT_VISIBLE_CORES`), else the device and platform."""
        visible = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
        if visible and self.on_neuron():
            return f"NeuronCore {visible} ({device})"
        return f"{device} on {self.describe_platform()}"

    def versions(self) -> dict[str, str]:
        """The installed stack's versions: packages (torch, torch-xla / torch-neuronx, neuronx-cc, ...), driver and
        runtime library."""
        return software_versions()

    @abstractmethod
    def device(self) -> torch.device:
        """This process's device (one device per process)."""

    @abstractmethod
    def sync(self, wait: bool = False) -> None:
        """Cut the pending lazy graph and launch it (a no-op for eager backends)."""

    @abstractmethod
    def prefetch(self, dataloader: Iterable, device: torch.device) -> Iterable:
        """Wrap `dataloader` so batches arrive on `device`, loaded in the background. It only moves data: cutting
        the graph is the strategy's job (`sync`)."""

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """CPU copies of this backend's device `tensors`, in as few device->host transfers as the backend allows."""
        return [t.detach().cpu() for t in tensors]

    def to_device(self, tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Copies of host `tensors` held in `device` memory, so graphs take them as inputs (never as constants)."""
        return [t.to(device) for t in tensors]

    @abstractmethod
    def memory_stats(self, device: torch.device) -> dict[str, Any]:
        """Device memory figures the runtime offers (empty if it offers none)."""

    def device_stats(self, device: torch.device) -> dict[str, Any]:
        """What `DeviceStatsMonitor` logs: the runtime's memory figures and, on a Neuron host with `neuron-monitor`
        installed, NeuronCore utilization and device memory from its stream. Says once when there are none."""
        stats = self.memory_stats(device)
        if self.on_neuron():
            from lightning_trn.runtime.monitor import neuron_monitor_stats

            stats.update(neuron_monitor_stats())
        if not stats:
            _say_no_device_stats(self.describe_platform())
        return stats

    def start_trace(self, log_dir: str) -> bool:
        """Start recording a profiler trace of this process's device work into `log_dir` (TensorBoard's profile
        layout); False where the backend records through `torch.profiler` instead."""
        return False

    def stop_trace(self) -> None:  # noqa: B027  (a no-op where start_trace records nothing)
        """Stop the trace `start_trace` started and write it."""

    @abstractmethod
    def metrics(self) -> RuntimeMetrics:
        """Cumulative compile / execution / transfer / fallback counters for this process."""

    @abstractmethod
    def autocast(self, dtype: torch.dtype) -> AbstractContextManager:
        """Autocast context for this device type."""

    @abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the device's random number generator (`torch.manual_seed` does not reach it on XLA)."""

    def checkpoint_device_module(self) -> Any:
        """The device module `torch.utils.checkpoint` should save and restore this device's RNG state through
        (`device`, `get_rng_state`, `set_rng_state`, and `_initialized` true: torch skips the device's RNG state,
        so dropout recomputes other masks, when a module lacks it, as TorchNeuron's `torch.neuron` does)."""
        return _InitializedDeviceModule(torch.get_device_module(self.device_type))

    #: whether the compiler may merge an activation-checkpointing recompute with the original forward (XLA's
    #: common-subexpression elimination), so the recompute is fenced with `optimization_barrier_`
    fences_recompute: bool = False

    def optimization_barrier_(self, tensors: list[torch.Tensor]) -> None:  # noqa: B027  (eager backends need no fence)
        """Fence `tensors` in place so the compiler cannot merge work computed from them with work computed before
        (an activation-checkpointing recompute with the original forward); nothing on eager backends."""

    @abstractmethod
    def world_size(self) -> int:
        """Number of processes the runtime's own collectives span."""

    @abstractmethod
    def supports_cross_process_collectives(self) -> bool:
        """Whether the runtime's collectives really span processes (False on XLA:CPU, see PLATFORM.md)."""

    def check_autograd(self, device: torch.device) -> None:
        """Raise a clear error if autograd cannot run a backward pass on `device` (one tiny backward, no compile).

        PyTorch's autograd engine starts its per-device worker threads once per process, at the first backward, for
        the devices registered at that moment. A backward on the CPU before the Neuron device existed (torch_xla's
        runtime starts at the first device use; the stand-in at `import lightning_trn`) leaves it without a worker
        for them for the rest of the process, which PyTorch reports as an INTERNAL ASSERT in the first step.
        """
        leaf = torch.zeros((), device=device, requires_grad=True)
        try:
            leaf.backward()
        except RuntimeError as err:
            if not autograd_lacks_device_worker(err):
                raise
            raise RuntimeError(
                f"PyTorch's autograd engine cannot run backward passes on {device}: a backward pass ran in this "
                "process before the Neuron device was started, and autograd starts its device workers only once, "
                "for the devices present then (a PyTorch limitation that cannot be undone in this process). Run the "
                "earlier CPU backward (a notebook's sanity check, say) after the first Neuron `fit` or in a separate "
                "process, or, for a single-process run, start the device before it: "
                "`lightning_trn.runtime.get_runtime().device()` right after `import lightning_trn`."
            ) from err

    def compile(self, module: torch.nn.Module, *, fullgraph: bool) -> torch.nn.Module:
        """`module` under this backend's `torch.compile` compiler (static shapes); unchanged where the backend
        compiles whole steps itself (XLA)."""
        return module

    def compile_in_place(self, module: torch.nn.Module, *, fullgraph: bool) -> bool:
        """Compile `module`'s calls in place with this backend's compiler (`nn.Module.compile`: the module object and
        its state_dict keys stay as they are); False, leaving it unchanged, where the backend compiles whole steps
        itself (XLA)."""
        return False

    def enable_compile_cache(self, path: str) -> bool:
        """Point the backend's persistent compile cache at local directory `path` for the rest of this process.

        Returns False, changing nothing, when this process already compiled and the cache can no longer be set
        (or the backend has no persistent compile cache: `has_compile_cache`).
        """
        return False

    def compile_cache_counters(self) -> dict[str, int]:
        """Persistent compile-cache lookups in this process: `hits`, `misses`, `unloadable` (found but not usable)."""
        return {}

    def configure_process(  # noqa: B027  (a backend that needs no per-worker environment keeps this no-op)
        self,
        *,
        global_rank: int,
        local_rank: int,
        world_size: int,
        local_world_size: int,
        main_address: str,
        env: EnvironmentPatch,
    ) -> None:
        """Set this worker's device environment for a data-parallel job; call before the device is first used."""

    def process_group_backend(self) -> str:
        """The `torch.distributed` backend for the default process group of a data-parallel job."""
        return "gloo"

    def collectives(self, world_size: int, group: Any = None) -> Collectives:
        """Cross-process collectives for a job of `world_size` processes (`group`: the host process group)."""
        from lightning_trn.runtime.host_collectives import HostCollectives

        return HostCollectives(world_size, group)
