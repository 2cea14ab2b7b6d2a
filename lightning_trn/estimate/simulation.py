"""A job simulated (`estimate`), one rank at a time: `Trainer.fit` for two optimizer steps on fake tensors and a
fake process group, its device memory tracked by PyTorch's memory trackers and its collectives counted
(`simulate_rank`); with pipeline stages one rank of each kind of stage (`stage_kinds`), earliest first, and the
tensors the stages hand each other counted.

The process state this changes is set and put back by `lightning_trn.estimate.patches`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from lightning_trn.core.parallel.pipeline import stages_of_rank
from lightning_trn.estimate import patches, step_time
from lightning_trn.estimate.report import (
    API,
    CAPACITY_GIB,
    PLATFORMS,
    RECIPE,
    ROWS,
    STAGE_RECV,
    STAGE_SEND,
    XLA_NOTE,
    XLA_PLATFORMS,
    Collective,
    Estimate,
    PipelineEstimate,
    RankMemory,
)
from lightning_trn.hooks.simulation import STAGE_TRANSFERS

#: the tracker's categories (its snapshot keys, lower-cased) -> this estimate's rows
_CATEGORIES = {
    "sharded param": "parameters",
    "parameter": "parameters",
    "buffer": "parameters",
    "sharded grad": "gradients",
    "gradient": "gradients",
    "optstate": "optimizer_state",
    "activation": "activations",
    "inputs": "activations",
    "unsharded param": "temporaries",
    "unsharded grad": "temporaries",
    "temp": "temporaries",
    "all gather": "temporaries",
    "reduce scatter": "temporaries",
    "other": "temporaries",
}


def _cluster(world_size: int, rank: int, devices: int) -> Any:
    """A cluster environment that says this process is `rank` of `world_size` (`devices` per node) and that the
    processes exist already, so the Trainer launches none."""
    from lightning.fabric.plugins.environments import ClusterEnvironment

    class SimulatedCluster(ClusterEnvironment):
        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "127.0.0.1"

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return False

        def world_size(self) -> int:
            return world_size

        def set_world_size(self, size: int) -> None:
            pass

        def global_rank(self) -> int:
            return rank

        def set_global_rank(self, rank: int) -> None:
            pass

        def local_rank(self) -> int:
            return rank % devices

        def node_rank(self) -> int:
            return rank // devices

    return SimulatedCluster()


class _CollectiveBytes:
    """`CommDebugMode` counting the bytes of each collective's largest tensor as well, in all and in groups whose
    ranks span more than one node of `devices` ranks (set up lazily: the class needs torch.distributed.tensor)."""

    @staticmethod
    def mode(devices: int, microbatched: bool = False) -> Any:
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops

        class Mode(CommDebugMode):
            def __init__(self) -> None:
                super().__init__()
                self.comm_bytes: dict[Any, int] = defaultdict(int)
                self.cross_node_bytes: dict[Any, int] = defaultdict(int)
                self.wire: dict[Any, float] = defaultdict(float)
                self.cross_node_wire: dict[Any, float] = defaultdict(float)
                self.ops = step_time.OpCount()

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = super().__torch_dispatch__(func, types, args, kwargs)
                if out is NotImplemented:  # a DTensor: its local operations come back here
                    return out
                packet = getattr(func, "_overloadpacket", None)
                if packet in self.comm_registry or packet in c10d_collective_ops:
                    packet = NATIVE_TO_PY_MAPPING.get(packet, packet)
                    size = max(map(_tensor_bytes, (*args, *(kwargs or {}).values(), out)))
                    ranks = _group_ranks(args, kwargs)
                    wire = step_time.ring_factor(str(packet), len(ranks)) * size
                    self.comm_bytes[packet] += size
                    nodes = len({rank // devices for rank in ranks})
                    if nodes > 1:
                        self.cross_node_bytes[packet] += size
                        self.cross_node_wire[packet] += wire * nodes / len(ranks)
                    else:
                        self.wire[packet] += wire
                else:
                    self.ops.add(func, args, kwargs, out)
                return out

        mode = Mode()
        if microbatched:
            mode.advanced_module_tracker = _NoModuleTracker()  # type: ignore[assignment]  # what the mode reads of it
        return mode


class _NoModuleTracker:
    """`CommDebugMode`'s module tracker for pipeline stages: it files collectives by module (unused here) and fails
    when a stage runs its modules once per microbatch; this one files every collective under "Global"."""

    name = "Global"
    is_bw = False
    activation_checkpointing = False

    def __init__(self) -> None:
        self.module_parents_dict: dict[str, set[str]] = {"Global": set()}

    def __enter__(self) -> _NoModuleTracker:
        return self

    def __exit__(self, *args: object) -> None:
        pass


def _group_ranks(args: Any, kwargs: Any) -> list[int]:
    """The global ranks of the group a collective runs in: its argument is a `ProcessGroup` (c10d ops, boxed) or a
    group's name (functional collectives); the default group's ranks where none is named."""
    import torch.distributed as dist
    from torch.distributed import ProcessGroup

    names = {name: group for group, name in dist.distributed_c10d._world.pg_names.items()}
    for leaf in tree_flatten([args, kwargs or {}])[0]:
        if isinstance(leaf, torch.ScriptObject) and "ProcessGroup" in str(leaf._type()):
            leaf = ProcessGroup.unbox(leaf)
        group = leaf if isinstance(leaf, ProcessGroup) else names.get(leaf) if isinstance(leaf, str) else None
        if group is not None:
            return dist.get_process_group_ranks(group)
    return list(range(dist.get_world_size()))


def _tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in one argument of a collective (a tensor, or a list of them, e.g. an all-gather's
    outputs)."""
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _collectives(modes: list[Any]) -> list[Collective]:
    """The collectives the modes (one per micro-batch of a step) counted, in all."""
    counts: dict[Any, int] = defaultdict(int)
    sizes: dict[Any, int] = defaultdict(int)
    across: dict[Any, int] = defaultdict(int)
    wire: dict[Any, float] = defaultdict(float)
    wire_across: dict[Any, float] = defaultdict(float)
    for mode in modes:
        for packet, count in mode.get_comm_counts().items():
            counts[packet] += count
            sizes[packet] += mode.comm_bytes.get(packet, 0)
            across[packet] += mode.cross_node_bytes.get(packet, 0)
            wire[packet] += mode.wire.get(packet, 0.0)
            wire_across[packet] += mode.cross_node_wire.get(packet, 0.0)
    return [
        Collective(
            str(packet).replace("c10d.", "").replace("_c10d_functional.", ""),
            count,
            sizes[packet],
            across[packet],
            str(packet),
            wire[packet],
            wire_across[packet],
        )
        for packet, count in sorted(counts.items(), key=lambda item: str(item[0]))
    ]


def _stage_transfers(transfers: list[tuple[bool, int, int]], rank: int, devices: int) -> list[Collective]:
    """The tensors the pipeline schedule sent and received in the step (`(sent, bytes, peer)`, counted by
    `lightning_trn.hooks.simulation.counted_stage_transfers`) as two rows: sends and receives, with the bytes
    exchanged with a rank on another node of `devices` ranks."""
    rows = []
    for kind, sent in ((STAGE_SEND, True), (STAGE_RECV, False)):
        mine = [(size, peer) for is_send, size, peer in transfers if is_send == sent]
        if mine:
            across = sum(size for size, peer in mine if peer // devices != rank // devices)
            total = sum(size for size, _ in mine)
            # a link carries each direction on its own: the receives' bytes are the peers' sends
            wire, wire_across = (float(total - across), float(across)) if sent else (0.0, 0.0)
            rows.append(Collective(kind, len(mine), total, across, kind, wire, wire_across))
    return rows


def _compiled(module: torch.nn.Module) -> bool:
    """Whether any submodule runs compiled (`Module.compile()` in place, or a `torch.compile` wrapper)."""
    return any(
        getattr(sub, "_compiled_call_impl", None) is not None or type(sub).__name__ == "OptimizedModule"
        for sub in module.modules()
    )


def _tokens_per_step(trainer: Any, batch: Any, accumulate: int) -> float | None:
    """Tokens a rank trains on per step: the micro-batch's token ids (its first integer tensor of two or more
    dimensions) times `accumulate`, times the data streams (the mesh's replicate and data-parallel ranks, or every
    rank without a mesh), over the world size (the ranks that split a stream share its tokens)."""
    ids = next(
        (
            t
            for t in tree_flatten(batch)[0]
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and not t.is_floating_point()
        ),
        None,
    )
    if ids is None:
        return None
    mesh = getattr(trainer.strategy, "device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    world = trainer.world_size
    streams = world
    if mesh is not None and names:
        streams = 1
        for name in ("replicate", "data_parallel"):
            if name in names:
                streams *= mesh[name].size()
    return ids.numel() * accumulate * streams / world


def _fsdp_root(module: torch.nn.Module) -> torch.nn.Module | None:
    from torch.distributed.fsdp import FSDPModule

    return next((sub for sub in module.modules() if isinstance(sub, FSDPModule)), None)


def _rank_memory(rank: int, snapshot: dict[Any, int]) -> RankMemory:
    rows = dict.fromkeys(ROWS, 0)
    peak = 0
    for key, value in snapshot.items():
        name = str(getattr(key, "value", key)).lower()
        if name == "total":
            peak = value
        else:
            rows[_CATEGORIES[name]] += value
    return RankMemory(rank, peak=peak, **rows)


def _module_stats(tracker: Any, stats: Callable[[str], Any], microbatched: bool) -> Any:
    """The tracker's per-module statistics (only its totals are read here), made for what a real step does and the
    trackers refuse:

    - a module whose forward did not run through the tracker gets statistics at its first backward hook: a
      `training_step` that calls a submodule (`self.model(x)`) leaves FSDP's root forward out, and its backward
      hooks still run (the statistics would raise `KeyError`);
    - `microbatched` (pipeline stages): each forward outside the backward starts a module's statistics afresh, as
      its first would; a stage runs its modules once per microbatch, which the trackers refuse as a second
      iteration.
    """
    from torch.utils.weak import WeakIdKeyDictionary

    class PerModuleStats(WeakIdKeyDictionary):
        def __contains__(self, module: Any) -> bool:
            return super().__contains__(module) and not (microbatched and not tracker._mod_tracker.is_bw)

        def __getitem__(self, module: Any) -> Any:
            if not super().__contains__(module):
                self[module] = stats(type(module).__name__)
            return super().__getitem__(module)

    return PerModuleStats()


def _tracker(root: torch.nn.Module | None, optimizers: list[torch.optim.Optimizer], microbatched: bool) -> Any:
    """`FSDPMemTracker` of the FSDP `root` (with the first optimizer), else `MemTracker`, with the per-module
    statistics of `_module_stats`."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats
    from torch.distributed._tools.mem_tracker import MemTracker, _ModMemStats

    if root is None:
        tracker = MemTracker()
        if microbatched:
            tracker.memory_tracking = _module_stats(tracker, _ModMemStats, microbatched)
    else:
        tracker = FSDPMemTracker(root, optimizers[0] if optimizers else None)
        tracker.memory_tracking = _module_stats(tracker, _FSDPModMemStats, microbatched)
    if microbatched:
        tracker._mod_tracker = _stage_module_tracker()
    return tracker


def _stage_module_tracker() -> Any:
    """The trackers' `ModTracker` for pipeline stages: a stage's input is a leaf tensor that requires its gradient
    (received from the previous stage), and torch's multi-gradient hook on it, with which the tracker sees a
    module's backward end, fails under `autograd.grad` (the stages' backward); such a module's backward is taken
    as ending with the whole backward, as the tracker does for inputs without gradients."""
    from torch.distributed._tools.mod_tracker import ModTracker

    def hookable(value: Any) -> bool:
        return not (isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is None)

    class StageModTracker(ModTracker):
        def _fw_pre_hook(self, mod: torch.nn.Module, input: Any) -> None:
            super()._fw_pre_hook(mod, tuple(value for value in tree_flatten(input)[0] if hookable(value)))

    return StageModTracker()


class _Measure:
    """A callback that makes every tensor fake from the `setup` hook on (after the strategy's environment: the
    device mesh is built from real rank lists), tracks the device memory from the end of the strategy's setup
    (`on_fit_start`: the model sharded and materialized, the optimizers built) to the end of the second optimizer
    step (`accumulate` micro-batches each), and the collectives of that step (`devices` ranks per node: which of
    them cross nodes)."""

    @staticmethod
    def callback(result: dict[str, Any], fake_mode: Any, accumulate: int, devices: int) -> Any:
        from lightning.pytorch.callbacks import Callback

        class Measure(Callback):
            def __init__(self) -> None:
                self.fake = contextlib.ExitStack()
                self.stack = contextlib.ExitStack()
                self.comm_stack = contextlib.ExitStack()
                self.comms: list[Any] = []

            def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
                self.fake.enter_context(fake_mode)

            def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
                self.fake.close()

            def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
                optimizers = list(trainer.optimizers)
                microbatched = _pipelining(trainer.strategy) is not None
                for each in optimizers:
                    _closure_first(each)
                    if microbatched:
                        _foreach_as_on_the_device(each)
                root = _fsdp_root(trainer.strategy.model)
                tracker = _tracker(root, optimizers, microbatched)
                if root is not None:
                    self.stack.enter_context(tracker)
                    # the rest of the LightningModule (metrics' states, an unsharded head) is device memory too,
                    # and so is the state of the other optimizers
                    tracker.track_external(
                        *(t for t in [*pl_module.parameters(), *pl_module.buffers()] if not _is_dtensor(t)),
                        *optimizers[1:],
                    )
                else:
                    tracker.track_external(pl_module, *optimizers)
                    self.stack.enter_context(tracker)
                result["tracker"] = tracker

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                result["batch"] = batch
                if batch_idx == accumulate:  # the measured step: its pipeline stages' transfers
                    STAGE_TRANSFERS.counting = []
                if batch_idx >= accumulate:  # one mode per micro-batch: its module tracker follows one forward
                    mode = _CollectiveBytes.mode(devices, _pipelining(trainer.strategy) is not None)
                    self.comms.append(self.comm_stack.enter_context(mode))

            def on_train_batch_end(
                self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
            ) -> None:
                self.comm_stack.close()
                # the trackers refuse a second forward of a module within their per-module statistics
                result["tracker"].reset_mod_stats()
                if batch_idx == accumulate - 1:
                    _restart_peak(result["tracker"])
                elif batch_idx == 2 * accumulate - 1:
                    self.stack.close()
                    transfers = _stage_transfers(STAGE_TRANSFERS.counting or [], trainer.global_rank, devices)
                    STAGE_TRANSFERS.counting = None
                    result["collectives"] = _collectives(self.comms) + transfers
                    result["work"] = step_time.Work(
                        step_time.OpCount.total(mode.ops for mode in self.comms),
                        _compiled(trainer.strategy.model),
                        _tokens_per_step(trainer, result.get("batch"), accumulate),
                    )
                    trainer.should_stop = True

            def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
                STAGE_TRANSFERS.counting = None
                self.comm_stack.close()
                self.stack.close()
                self.fake.close()

        return Measure()


def _restart_peak(tracker: Any) -> None:
    """Make the tracker's peak the memory in use now, as entering it does (it has no public reset): the peak is
    then the second step's, with the optimizer state, as `torch.neuron.reset_peak_memory_stats()` before the step
    gives. The first step's is not used: it peaks below the second in every configuration measured (it has no
    optimizer state until its optimizer step)."""
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {device: snap["Total"] for device, snap in tracker._peak_mem_snap.items()}


def _closure_first(optimizer: Any) -> None:
    """Lightning hands forward and backward to `optimizer.step(closure)`, inside the optimizer's step hooks, where
    the trackers file every tensor as optimizer state. Run the closure first, then the step without it, so
    activations and gradients count as such (an optimizer that calls its closure once does the same work)."""
    step = optimizer.step

    @functools.wraps(step)  # keeps the LR scheduler's mark on the step it wrapped
    def closure_then_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = closure() if closure is not None else None
        with step_time.optimizer_step():
            step(**kwargs)
        return loss

    optimizer.step = closure_then_step  # patched on this one (simulated, thrown away) optimizer object only


def _foreach_as_on_the_device(optimizer: Any) -> None:
    """The implementation torch's optimizers pick by default on the device (`foreach`: one temporary per parameter
    in the step, all at once), not the one they pick for fake tensors (single-tensor: two temporaries of one
    parameter at a time): torch takes the list form only for `Tensor` and `Parameter` of a device with its kernels.
    Set for the parameters of pipeline stages (plain tensors): the first stage's peak is in its optimizer step,
    measured 5.6 MB (9 %) over the allocator's without this."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    devices = _get_foreach_kernels_supported_devices()
    for group in optimizer.param_groups:
        if group.get("foreach", False) is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = all(not _is_dtensor(p) and p.device.type in devices for p in group["params"])


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _host_loader(batch: Any, count: int) -> Any:
    """A training loader of `count` copies of `batch` (a pytree of tensors; only shapes and dtypes count) as host
    tensors of zeros (valid indices for embeddings and losses): the strategy copies them to the device as it copies
    real batches (host memory: one micro-batch, a few MB)."""
    batches = [tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), batch) for _ in range(count)]
    return _Batches(batches)


class _Batches:
    """The batches as they are, one at a time: a `DataLoader` would draw its seed from a tensor (fake here)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _on_meta(module_factory: Callable[[], Any]) -> Any:
    """The module as `module_factory` builds it, with every tensor on the meta device (no memory, however large).
    Built under `torch.device("meta")`; a factory that reads values while building (`.item()`, which meta tensors
    cannot answer) is built on the host and moved."""
    try:
        with torch.device("meta"):
            return module_factory()
    except (NotImplementedError, RuntimeError):
        module = module_factory()
        return module._apply(lambda t: t if t.is_meta else torch.empty_like(t, device="meta"))


def simulate_rank(
    module_factory: Callable[[], Any], batch: Any, rank: int, **trainer_kwargs: Any
) -> tuple[RankMemory, list[Collective], step_time.Work]:
    """Train two optimizer steps as rank `rank` of the job `trainer_kwargs` describes, on fake tensors and a fake
    process group; returns that rank's memory at the second step's peak, that step's collectives and its operations
    (`step_time.Work`).

    Raises:
        EstimateError: Lightning refuses the job as configured, or the simulation fails (the message says where).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch._subclasses.fake_tensor import FakeTensorMode

    devices, nodes = int(trainer_kwargs.get("devices", 1)), int(trainer_kwargs.get("num_nodes", 1))
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    if not isinstance(accumulate, int) or accumulate < 1:
        raise patches.EstimateError(
            f"accumulate_grad_batches={accumulate!r}: the estimator simulates a whole number of micro-batches per "
            "optimizer step; pass a positive int."
        )
    world_size = devices * nodes
    # fake tensors' dispatch cache is torch's, for all modes: its keys hold a device without its index ("neuron", as
    # DTensor's sharding propagation asks), so an earlier simulated rank's outputs on its own device would come back
    FakeTensorMode.cache_clear()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    result: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(patches.process_settings())
        root = stack.enter_context(tempfile.TemporaryDirectory())
        stack.enter_context(patches.device_count(devices))
        stack.enter_context(patches.fake_process_group(rank, world_size))
        stack.enter_context(patches.simulation_hooks())
        # Lightning keeps the first Trainer's cluster environment (its rank) and mesh in a strategy object:
        # each simulated rank gets a copy of the unused one
        strategy = trainer_kwargs.get("strategy")
        if strategy is not None and not isinstance(strategy, str):
            trainer_kwargs = {**trainer_kwargs, "strategy": copy.deepcopy(strategy)}
        try:
            trainer = pl.Trainer(
                **{
                    **trainer_kwargs,
                    # one epoch of the loader's batches (two optimizer steps), stopped by `_Measure`: manual
                    # optimization counts every optimizer's step, so `max_steps` cannot say when
                    "max_epochs": 1,
                    "max_steps": -1,
                    "accumulate_grad_batches": accumulate,
                    "limit_val_batches": 0,
                    "num_sanity_val_steps": 0,
                    "logger": False,
                    "enable_checkpointing": False,
                    "enable_progress_bar": False,
                    "enable_model_summary": False,
                    "use_distributed_sampler": False,
                    "default_root_dir": root,
                    "callbacks": [_Measure.callback(result, fake_mode, accumulate, devices)],
                    "plugins": [*_as_list(trainer_kwargs.get("plugins")), _cluster(world_size, rank, devices)],
                }
            )
        except Exception as err:
            raise _refusal("Lightning refuses these Trainer arguments", err) from err
        module = _on_meta(module_factory)
        if not isinstance(trainer.strategy, ModelParallelStrategy):  # ours (and FSDP) materialize a meta model
            with fake_mode:  # made fake where a data-parallel strategy would move it
                ties = _ties(module)
                module._apply(functools.partial(_fake_on, trainer.strategy.root_device))
                _retie(ties)
        # logging is host bookkeeping of (here fake) scalars, not device memory
        module.log = lambda *args, **kwargs: None
        module.log_dict = lambda *args, **kwargs: None
        # the simulated module is thrown away: teardown's move to the host is skipped (torch cannot swap a fake
        # parameter for its host copy)
        module.cpu = lambda: module
        try:
            trainer.fit(module, train_dataloaders=_host_loader(batch, 2 * accumulate))
        except Exception as err:
            raise _refusal("the simulated run stopped", err) from err
    if "collectives" not in result:
        raise patches.EstimateError(
            "lightning_trn.estimate: the simulated run ended before its second optimizer step (does the module's "
            "training_step return None on every batch, or stop the fit?)."
        )
    memory = _rank_memory(rank, _device_snapshot(result["tracker"].get_tracker_snapshot("peak")))
    return memory, result["collectives"], result["work"]


def _refusal(where: str, err: Exception) -> patches.EstimateError:
    """The paragraph an estimate that cannot run ends with: Lightning's own refusal of the job (a real run stops the
    same way), or what the simulation could not do, with the error's own words."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if isinstance(err, patches.EstimateError):
        return err
    frames = []
    traceback = err.__traceback__
    while traceback is not None:
        frames.append(traceback.tb_frame.f_code.co_filename)
        traceback = traceback.tb_next
    # raised by Lightning or the plugin (not inside torch): their checks of the job as configured
    configuration = isinstance(err, (MisconfigurationException, ValueError, TypeError, RuntimeError))
    if configuration and not (frames and "/torch/" in frames[-1]):
        return patches.EstimateError(
            f"lightning_trn.estimate: {where}: {type(err).__name__}: {err} A real run of this job stops the same "
            "way: change the module or the Trainer arguments, then estimate again."
        )
    return patches.EstimateError(
        f"lightning_trn.estimate could not simulate this job ({where} in {frames[-1] if frames else 'the simulation'}: "
        f"{type(err).__name__}: {err}). The simulation runs Trainer.fit on fake tensors (no values: code that "
        "reads a tensor's value on the host, or a torch feature without fake-tensor support, cannot run there) and a "
        "fake process group. Estimate the module without that part (e.g. the eager model instead of a compiled "
        "one), or measure one real step on the device with torch.neuron.max_memory_allocated()."
    )


def _device_snapshot(snapshot: dict[torch.device, dict[Any, int]]) -> dict[Any, int]:
    return next((snap for device, snap in snapshot.items() if device.type != "cpu"), {})


def _ties(module: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """The places of each parameter registered more than once (a head tied to the embedding)."""
    places: dict[int, list[tuple[torch.nn.Module, str]]] = defaultdict(list)
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                places[id(param)].append((sub, name))
    return [group for group in places.values() if len(group) > 1]


def _retie(ties: list[list[tuple[torch.nn.Module, str]]]) -> None:
    """Registers each tied group's first converted parameter in its other places: `Module._apply` converts a fake
    parameter per place, which would untie them (twice the memory and optimizer state of a real run)."""
    for (first, first_name), *others in ties:
        for sub, name in others:
            sub._parameters[name] = first._parameters[first_name]


def _fake_on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor's fake counterpart on `device` (under the fake mode); other tensors as they are."""
    return torch.empty_like(tensor, device=device) if tensor.is_meta else tensor


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def default_platform(trainer_kwargs: dict[str, Any]) -> str:
    """The chip the job is for when not named: this host's, else Trn1 for ZeRO-1 / DDP on the XLA stack's names,
    else Trn2 (sharded models need the native stack)."""
    from lightning_trn.runtime import get_runtime

    chip = get_runtime().chip()
    if chip is not None:
        return chip
    strategy = trainer_kwargs.get("strategy")
    return "trn1" if strategy in ("neuron_zero1", "neuron_ddp") else "trn2"


def describe(platform: str, device: str, world_size: int, nodes: int, ranks: Sequence[int]) -> str:
    """The report's first line: which stack and platform are simulated, on what."""
    stack = "XLA stack (torch-neuronx 2.9), its training state exact" if platform in XLA_PLATFORMS else "native stack"
    return (
        f"simulated: {platform}, {stack}, on {device} (torch {torch.__version__}, fake tensors, fake process group): "
        f"{world_size} ranks on {nodes} node(s), rank(s) {', '.join(map(str, ranks))}"
    )


def estimate(
    module_factory: Callable[[], Any],
    batch: Any,
    *,
    platform: str | None = None,
    ranks: Sequence[int] | None = None,
    caller: str = API,
    **trainer_kwargs: Any,
) -> Estimate:
    """Estimate the device memory per rank and the collectives of one training step of the job
    `Trainer(**trainer_kwargs).fit(module_factory(), ...)` at its real world size, in this process.

    Args:
        module_factory: builds the LightningModule as the training script does; called once per simulated rank,
            under `torch.device("meta")` (nothing is allocated, however large the model).
        batch: one micro-batch as the training loader yields it (a pytree of tensors of any device: meta tensors
            allocate nothing); only shapes and dtypes are used.
        platform: "trn1", "trn2" or "trn3": the capacity, margin and reserved memory per rank (`PLATFORMS`);
            default `default_platform`.
        ranks: the ranks to simulate; ranks whose shards have the same shapes use the same memory, so rank 0 stands
            for all of them under FSDP2 (evenly padded shards), tensor parallelism and ZeRO-1 (evenly padded chunks).
            None: rank 0, or with pipeline stages one rank per kind of stage (`stage_kinds`: the first stage's, a
            middle one's, the last's), each stage's memory and collectives reported; the job fits when every stage
            does.
        caller: whose terms the advice uses: `"api"` (Trainer and strategy arguments) or `"recipe"` (recipe keys).
        trainer_kwargs: the Trainer arguments of the job (`accelerator="neuron"`, `devices`, `num_nodes`,
            `strategy`, `precision`, `accumulate_grad_batches`, ...). Loop lengths, logging and checkpointing are
            the estimator's.

    Runs with or without `LIGHTNING_TRN_STANDIN`: where no Neuron stack is installed the CPU stand-in is loaded and
    shows `devices` devices during the simulation (up to 64 per node; more ranks go in `num_nodes`).

    Raises:
        EstimateError: the environment cannot simulate (the XLA stack's torch, an untested torch), a process group
            exists already, Lightning refuses the job as configured, or the simulation cannot run the module; the
            message says which and what to do.
    """
    if caller not in (API, RECIPE):
        raise ValueError(f"caller={caller!r}: expected {API!r} or {RECIPE!r}.")
    device = patches.native_device()
    platform = platform or default_platform(trainer_kwargs)
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r}: expected one of {', '.join(PLATFORMS)}.")
    devices, nodes = int(trainer_kwargs.get("devices", 1)), int(trainer_kwargs.get("num_nodes", 1))
    if devices > 64:
        raise patches.EstimateError(
            f"devices={devices}: a node has at most 64 NeuronCores (trn2.48xlarge's logical cores); give the ranks "
            f"of more nodes with num_nodes (e.g. devices=64, num_nodes={max(2, -(-devices // 64))})."
        )
    pipelining = _pipelining(trainer_kwargs.get("strategy"))
    world_size = devices * nodes
    if ranks is None:
        ranks = [rank for rank, _ in stage_kinds(pipelining, world_size)] if pipelining is not None else [0]
    if pipelining is not None:  # earliest pipeline rank first: a stage's input shapes come from the one before
        ranks = sorted(ranks)
    memories: list[Any] = []
    collectives: dict[int, list[Any]] = {}
    work: dict[int, step_time.Work] = {}
    STAGE_TRANSFERS.clear()
    try:
        for rank in ranks:
            memory, collectives[rank], work[rank] = simulate_rank(module_factory, batch, rank, **trainer_kwargs)
            memories.append(memory)
    finally:
        STAGE_TRANSFERS.clear()
    pipeline = None
    if pipelining is not None:
        per_rank = world_size // pipelining.size
        stages = {
            rank: stages_of_rank(pipelining.schedule, rank // per_rank, pipelining.size, pipelining.stages_per_rank)
            for rank in ranks
        }
        pipeline = PipelineEstimate(
            pipelining.schedule,
            pipelining.size,
            pipelining.microbatches,
            pipelining.stages_per_rank,
            stages,
            collectives,
        )
    notes = [XLA_NOTE] if platform in XLA_PLATFORMS else []
    notes += _context_parallel_note(trainer_kwargs.get("strategy"), batch, memories[0])
    return Estimate(
        world_size,
        platform,
        int(CAPACITY_GIB[platform] * 2**30),
        memories,
        collectives[ranks[0]],
        notes,
        simulated=describe(platform, device, world_size, nodes, ranks),
        caller=caller,
        pipeline=pipeline,
        work=work,
    )


def _context_parallel_note(strategy: Any, batch: Any, memory: Any) -> list[str]:
    """Under context parallelism, what it divides in the rank's memory (the activations of its part of each
    sequence) and what it does not (the attention mask, local x whole sequence, and the gathered keys and values)."""
    dims = getattr(strategy, "parallel_dims", None)
    size = getattr(dims, "context_parallel", 1)
    sequences = batch.get("input_ids") if isinstance(batch, dict) else None
    if size == 1 or sequences is None:
        return []
    rows, length = sequences.shape[:2]
    mask = rows * (length // size) * length  # booleans
    return [
        f"context parallel {size}: each rank holds {length // size:,} of each sequence's {length:,} tokens, so its "
        f"activations ({memory.activations / 2**30:.2f} GiB at the peak) are 1/{size} of a whole sequence's; not "
        f"divided: the attention mask of the rank's queries against the whole sequence ({rows} x {length // size:,} "
        f"x {length:,} booleans, {mask / 2**30:.2f} GiB) and the whole sequence's keys and values of the layer "
        "being computed (gathered, then freed)"
    ]


def _pipelining(strategy: Any) -> Any:
    """The pipeline settings of a strategy with pipeline stages (`NeuronModelParallelStrategy`), else None."""
    pipelining = getattr(strategy, "_pipelining", None)
    return pipelining if pipelining is not None and pipelining.size > 1 else None


def stage_kinds(pipelining: Any, world_size: int) -> list[tuple[int, list[int]]]:
    """One rank per kind of pipeline rank, with its stage indices: whether it holds the first stage (the
    embedding), the last (the head and the loss), or neither (middle stages alike), the earliest pipeline rank of
    each kind, at mesh coordinate 0 otherwise (the pipeline dimension is the mesh's outermost)."""
    kinds: dict[tuple[bool, bool], tuple[int, list[int]]] = {}
    last = pipelining.num_stages - 1
    for pipeline_rank in range(pipelining.size):
        stages = stages_of_rank(pipelining.schedule, pipeline_rank, pipelining.size, pipelining.stages_per_rank)
        rank = pipeline_rank * (world_size // pipelining.size)
        kinds.setdefault((0 in stages, last in stages), (rank, stages))
    return list(kinds.values())
