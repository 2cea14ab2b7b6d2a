"""torch_xla backend: Trainium/Inferentia through torch-neuronx, or XLA:CPU for development and CI.

torch_xla is imported lazily, inside the methods, so `import lightning_trn` works where it is not installed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_trn.runtime.base import DeviceRuntime, RuntimeMetrics
from lightning_trn.runtime.collectives import Collectives
from lightning_trn.runtime.discovery import CPU, Platform, detect_platform, torch_xla_installed
from lightning_trn.runtime.environment import NEURON_COMPILE_CACHE_URL, EnvironmentPatch
from lightning_trn.runtime.xla_import import import_xla

log = logging.getLogger(__name__)

#: torch_xla counters named `aten::X` count ops run on the host. This one is `.item()` / `bool(tensor)`:
#: a host read of a device scalar, reported separately as a sync rather than as a missing lowering.
_SCALAR_READ_COUNTER = "aten::_local_scalar_dense"
#: torch_xla's persistent-cache counters. XLA:CPU finds entries but cannot load them ("Deserializing serialized
#: executable not supported"), so there a warm lookup counts as `unloadable` and the graph is compiled again.
_XLA_CACHE_PATH = "XLA_PERSISTENT_CACHE_PATH"
_CACHE_COUNTERS = {
    "hits": "PersistentCacheHit",
    "misses": "PersistentCacheMiss",
    "unloadable": "PersistentCacheDeserializeFailure",
}


class _TensorSlot:
    """Where a batch held a tensor, in the skeleton of containers `prefetch` keeps while the tensors move."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


#: the `AutocastXLA` kernel of `scaled_dot_product_attention`, registered once per process (None: not yet)
_AUTOCAST_ATTENTION: torch.library.Library | None = None


def _register_autocast_attention() -> None:
    """`scaled_dot_product_attention` under XLA's autocast as under the CPU's and CUDA's (`lower_precision_fp`): its
    floating-point inputs, except float64, cast to the autocast dtype. torch registers no XLA autocast kernel for it,
    so attention ran in fp32, and failed when a rotary embedding left query and key in fp32 beside a bf16 value.
    Only the `AutocastXLA` dispatch key gets the kernel: CPU and GPU runs in the same process are unchanged."""
    global _AUTOCAST_ATTENTION
    if _AUTOCAST_ATTENTION is not None:
        return

    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        dtype = torch.get_autocast_dtype("xla")

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is not None and t.is_floating_point() and t.dtype != torch.float64:
                return t.to(dtype)
            return t

        with torch.autocast("xla", enabled=False):
            return torch.ops.aten.scaled_dot_product_attention(
                cast(query),
                cast(key),
                cast(value),
                cast(attn_mask),
                dropout_p,
                is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )

    library = torch.library.Library("aten", "IMPL")
    library.impl("scaled_dot_product_attention", attention, "AutocastXLA")
    _AUTOCAST_ATTENTION = library


def _batches_until_closed(loader: Any, device: torch.device, skeletons: deque) -> Iterator:
    """The loader's batches, rebuilt around their device tensors; stops and joins its background threads when the
    loop leaves early (`limit_*_batches`, an exception). Left running, those daemon threads wake during interpreter
    shutdown and abort the process ("terminate called without an active exception") after the job has finished."""
    try:
        for tensors in loader.per_device_loader(device):
            yield _join_tensors(skeletons.popleft(), tensors)
    finally:
        loader.close()


def _split_tensors(batch: Any) -> tuple[list[torch.Tensor], Any]:
    """The batch's tensors in order, and the batch with each replaced by its `_TensorSlot`."""
    tensors: list[torch.Tensor] = []

    def take(tensor: torch.Tensor) -> _TensorSlot:
        tensors.append(tensor)
        return _TensorSlot(len(tensors) - 1)

    return tensors, apply_to_collection(batch, torch.Tensor, take)


def _join_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return apply_to_collection(skeleton, _TensorSlot, lambda slot: tensors[slot.index])


class _XlaDeviceModule:
    """What `torch.utils.checkpoint` and `torch.random.fork_rng` ask of `torch.xla`, which torch_xla does not register:
    the device's RNG state is the runtime's seed (an int, `xm.get_rng_state`), one device per process."""

    #: read by torch's checkpoint before it saves the device RNG state for the recompute
    _initialized = True

    @staticmethod
    def device(index: Any = None) -> AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_rng_state(device: Any = None) -> int:
        return import_xla("torch_xla.core.xla_model").get_rng_state()

    @staticmethod
    def set_rng_state(state: Any, device: Any = None) -> None:
        import_xla("torch_xla.core.xla_model").set_rng_state(int(state))


class XlaRuntime(DeviceRuntime):
    """All calls into torch_xla go through here."""

    name = "xla"
    device_type = "xla"
    cpu_platform = "XLA:CPU"
    has_compile_cache = True
    runtime_rounds_bf16 = True

    def __init__(self) -> None:
        self._platform: Platform | None = None

    @override
    def is_installed(self) -> bool:
        return torch_xla_installed()

    @override
    def detect_platform(self) -> Platform:
        if self._platform is None:
            self._platform = detect_platform()
            if self._platform.kind == CPU:
                log.warning("lightning_trn: no NeuronCores found; running on XLA:CPU (PJRT_DEVICE=CPU).")
        return self._platform

    @override
    def device(self) -> torch.device:
        torch_xla = import_xla("torch_xla")
        return torch_xla.device()

    @override
    def sync(self, wait: bool = False) -> None:
        """Cut and launch the graph. `reset_scope=False`: a profiler trace (`XLAProfiler`'s `xp.Trace`/`StepTrace`)
        may be open around the step being cut; its scope is IR metadata only, and the trace resets it at its exit."""
        import_xla("torch_xla").sync(wait=wait, reset_scope=False)

    @override
    def prefetch(self, dataloader: Iterable, device: torch.device) -> Iterable:
        """`MpDeviceLoader` on the batches' tensors only: it would turn tuples, namedtuples, dict subclasses and
        dataclasses into lists and dicts, so each batch's containers travel beside it and are rebuilt around the
        device tensors, as Lightning's own transfer keeps them."""
        parallel_loader = import_xla("torch_xla.distributed.parallel_loader")
        skeletons: deque = deque()  # filled by the loader's background thread, in batch order

        def tensors_only() -> Iterator[list[torch.Tensor]]:
            for batch in dataloader:
                tensors, skeleton = _split_tensors(batch)
                skeletons.append(skeleton)
                yield tensors

        # MpDeviceLoader would also sync at every batch; after the strategy's own cut that sync has nothing to run,
        # yet in a training loop it takes about the step graph's execution time, while the host could be tracing
        # the next step (benchmarks/README.md). Its background threads start loading now.
        loader = parallel_loader.ParallelLoader(tensors_only(), [device], batches_per_execution=sys.maxsize)
        return _batches_until_closed(loader, device, skeletons)

    @override
    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """One transfer for all of them (what `xm.save` does), instead of one `.cpu()` per tensor."""
        if not tensors:
            return []
        return list(import_xla("torch_xla")._XLAC._xla_get_cpu_tensors([t.detach() for t in tensors]))

    @override
    def to_device(self, tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """`send_cpu_data_to_device` (as `MpDeviceLoader`), not `.to()`: torch_xla keeps a 0-dim tensor holding 0 or
        +-1 moved by `.to()` as a graph constant, so the first graph it enters differs from every later one, which
        takes the step's result as an input: one compile more."""
        if not tensors:
            return []
        xm = import_xla("torch_xla.core.xla_model")
        return list(xm.send_cpu_data_to_device([t.detach() for t in tensors], device))

    @override
    def memory_stats(self, device: torch.device) -> dict[str, Any]:
        xm = import_xla("torch_xla.core.xla_model")
        try:
            return dict(xm.get_memory_info(device))
        except RuntimeError:  # XLA:CPU: "GetAllocatorStats is not supported"
            return {}

    @override
    def start_trace(self, log_dir: str) -> bool:
        """torch_xla's profiler session (`xp.start_trace`): host and device activity, written by `stop_trace` as
        TensorBoard's `plugins/profile/<run>/<host>.xplane.pb` (and `.trace.json.gz`)."""
        import_xla("torch_xla.debug.profiler").start_trace(log_dir)
        return True

    @override
    def stop_trace(self) -> None:
        import_xla("torch_xla.debug.profiler").stop_trace()

    @override
    def metrics(self) -> RuntimeMetrics:
        met = import_xla("torch_xla.debug.metrics")

        def count(metric: str) -> int:
            data = met.metric_data(metric)
            return int(data[0]) if data else 0

        fallbacks = {}
        for name in met.counter_names():
            if name.startswith("aten::") and name != _SCALAR_READ_COUNTER:
                fallbacks[name] = int(met.counter_value(name) or 0)
        transfers = count("TransferFromDeviceTime")
        return RuntimeMetrics(
            compiles=count("CompileTime"),
            executions=count("ExecuteTime"),
            device_to_host=transfers,
            host_syncs=transfers,  # each transfer (`.item()` included) waits for the graphs that produce its data
            host_to_device=count("TransferToDeviceTime"),
            scalar_reads=int(met.counter_value(_SCALAR_READ_COUNTER) or 0),
            cpu_fallbacks=fallbacks,
        )

    @override
    def autocast(self, dtype: torch.dtype) -> AbstractContextManager:
        import_xla("torch_xla")
        _register_autocast_attention()
        return torch.autocast("xla", dtype=dtype)

    @override
    def manual_seed(self, seed: int) -> None:
        import_xla("torch_xla.core.xla_model").set_rng_state(seed)

    fences_recompute = True

    @override
    def checkpoint_device_module(self) -> Any:
        """torch_xla registers no `torch.xla`: a module of our own serves its device's RNG state."""
        return _XlaDeviceModule()

    @override
    def optimization_barrier_(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            import_xla("torch_xla.core.xla_model").optimization_barrier_(tensors)

    @override
    def world_size(self) -> int:
        return int(import_xla("torch_xla.runtime").world_size())

    @override
    def supports_cross_process_collectives(self) -> bool:
        return self.detect_platform().kind != CPU

    @override
    def compile(self, module: torch.nn.Module, *, fullgraph: bool) -> torch.nn.Module:
        """Unchanged: every training step is already traced and compiled as one graph."""
        rank_zero_info(
            "lightning_trn.compile: the XLA backend already compiles each training step as one graph; the "
            "module is returned unchanged."
        )
        return module

    @override
    def enable_compile_cache(self, path: str) -> bool:
        """Neuron: the compiler's cache (`NEURON_COMPILE_CACHE_URL`); XLA:CPU: torch_xla's persistent cache."""
        if self.detect_platform().kind != CPU:
            if os.environ.get(NEURON_COMPILE_CACHE_URL) == path:
                return True
            if self.metrics().compiles:
                return False
            os.environ[NEURON_COMPILE_CACHE_URL] = path
            return True
        if os.environ.get(_XLA_CACHE_PATH) == path:  # torch_xla reads it when its compile cache starts
            return True
        if import_xla("torch_xla")._XLAC._xla_computation_cache_is_initialized():
            return False
        import_xla("torch_xla.runtime").initialize_cache(path, readonly=False)
        return True

    @override
    def compile_cache_counters(self) -> dict[str, int]:
        met = import_xla("torch_xla.debug.metrics")
        return {key: int(met.counter_value(counter) or 0) for key, counter in _CACHE_COUNTERS.items()}

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
        """Neuron: one NeuronCore per process and the PJRT ranks torch_xla would set under torchrun (neuron_env.py)."""
        if self.detect_platform().kind == CPU:
            return
        from lightning_trn.runtime.neuron_env import neuron_process_env

        updates = neuron_process_env(
            os.environ,
            global_rank=global_rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            main_address=main_address,
        )
        changes = {name: value for name, value in updates.items() if os.environ.get(name) != value}
        if changes and "torch_xla" in sys.modules and import_xla("torch_xla")._XLAC._xla_runtime_is_initialized():
            raise RuntimeError(
                f"The XLA runtime started before this data-parallel worker could claim its NeuronCore (it still needs "
                f"{sorted(changes)}), e.g. because a tensor was moved to the XLA device before `trainer.fit`. Do not "
                "touch the device before the Trainer runs, or launch with torchrun (torch_xla sets them at import)."
            )
        for name, value in changes.items():
            env.set(name, value)

    @override
    def process_group_backend(self) -> str:
        """`xla` (torch_xla's ProcessGroupXla over `xm` collectives) on Neuron; `gloo` on XLA:CPU."""
        if not self.supports_cross_process_collectives():
            return "gloo"
        import_xla("torch_xla.distributed.xla_backend")  # registers the "xla" backend with torch.distributed
        return "xla"

    @override
    def collectives(self, world_size: int, group: Any = None) -> Collectives:
        if not self.supports_cross_process_collectives():
            return super().collectives(world_size, group)
        from lightning_trn.runtime.xla_collectives import XlaCollectives

        return XlaCollectives(world_size)
