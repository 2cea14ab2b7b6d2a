"""Will a job fit? Simulate one training step of a job at its real world size, in one process, without memory.

`estimate(module_factory, batch, accelerator="neuron", devices=64, strategy=..., precision=...)` runs the plugin's own
strategy code (`Trainer.fit`: the strategy's environment, `configure_model`, sharding, materialization, optimizer
setup, then two training steps: forward, backward, gradient reduction, optimizer step) as one rank of the job would,
with

- PyTorch's fake process group (`init_process_group("fake")`): every collective returns at once, as TorchTitan's
  estimator (`scripts/estimate/estimation.py`) does;
- fake tensors (`FakeTensorMode`) on the `neuron` device: shapes, dtypes and devices, no storage;
- PyTorch's `FSDPMemTracker` (FSDP2 models) or `MemTracker` (others): every tensor allocated on the device, filed
  as parameters, gradients, optimizer state, activations or temporaries, and the peak;
- `CommDebugMode`: the collectives of the second step (its counts), with their buffer sizes.

The first step creates the optimizer state; the second is measured with it present (`reset_mod_stats` and a fresh
peak between), as `torch.neuron.reset_peak_memory_stats()` before it and `max_memory_allocated()` after it would.
Ranks whose shards have the same shapes have the same memory: rank 0 stands for them (`ranks=` simulates others).
Lightning's loop runs unchanged except that it logs nothing (`logger=False`, no progress bar or checkpoints) and the
module's `log` calls are dropped: host bookkeeping of scalars, not device memory.

`python -m lightning_trn.estimate llm preset=trn2-8b [key=value ...]` does this for a recipe (docs/sharding.md,
"Will it fit?").
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

#: device memory per rank (one process: a NeuronCore, or a logical core on Trn2/Trn3 at LNC=2), in GiB
CAPACITY_GIB = {
    "trn1": 16.0,  # a NeuronCore-v2: 32 GiB of HBM per Trainium chip, 2 cores
    "trn2": 24.0,  # a logical core at LNC=2: 96 GiB of HBM per Trainium2 chip, 4 logical cores
    "trn3": 36.0,  # unconfirmed: 144 GB of HBM per Trainium3 chip (AWS's announcement), 4 logical cores at LNC=2
}
#: what each platform trains with: the native stack (TorchNeuron) on Trn2/Trn3, the XLA stack on Trn1
XLA_PLATFORMS = ("trn1",)
XLA_NOTE = (
    "XLA stack: the training state (parameters, gradients, ZeRO-1 chunks, fp32 masters) is exact; activations and "
    "temporaries come from the eager trace, an upper bound (the Neuron compiler schedules the device's real peak)."
)
_GIB = 2**30
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
ROWS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


@dataclass
class RankMemory:
    """Device memory of one simulated rank at the second training step's peak, in bytes, by category: `parameters`
    (this rank's shards and buffers), `gradients` (their gradients), `optimizer_state` (with the optimizer step's
    temporaries, which the tracker files there), `activations` (saved for backward, and the inputs),
    `temporaries` (gathered parameters and gradients, collective buffers, backward temporaries). They add up to
    `peak`."""

    rank: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    peak: int


@dataclass
class Collective:
    """One kind of collective in one training step: how often it ran and the bytes of its buffers on each rank, in
    all (per call the larger side: the gathered tensors of an all-gather, the input of a reduce-scatter, the tensor
    of an all-reduce)."""

    kind: str
    count: int
    bytes_per_rank: int


@dataclass
class Estimate:
    """What `estimate` found: per simulated rank its memory, the step's collectives, the capacity of a core."""

    world_size: int
    platform: str
    capacity: int
    ranks: list[RankMemory]
    collectives: list[Collective] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        """The largest rank's peak, bytes."""
        return max(rank.peak for rank in self.ranks)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def advice(self) -> str:
        """One line naming what to change when it does not fit, from the category that dominates the peak."""
        if self.fits:
            return ""
        worst = max(self.ranks, key=lambda rank: rank.peak)
        over = (self.peak - self.capacity) / _GIB
        if worst.activations + worst.temporaries >= worst.parameters + worst.gradients + worst.optimizer_state:
            change = (
                "activations dominate: turn on activation checkpointing (model.activation_checkpointing=true) "
                "if it is off, lower the micro-batch (data.batch_size), or shard activations with more tensor "
                "parallelism"
            )
        else:
            change = (
                "shard the training state further: more tensor parallelism (model.tensor_parallel_size), "
                "FSDP over more ranks (num_nodes), or ZeRO-1 where the state is replicated"
            )
        return f"does not fit: {over:.2f} GiB over; {change}."

    def format(self) -> str:
        """The report `python -m lightning_trn.estimate` prints; its last line is
        `peak device memory per rank: <x> GiB of <y> GiB`."""
        lines = [f"world size {self.world_size}, {self.platform}: {self.capacity / _GIB:.0f} GiB per rank", ""]
        header = (
            "rank",
            "parameters",
            "gradients",
            "optimizer",
            "activations",
            "temporaries",
            "total peak",
            "capacity",
        )
        lines.append(" | ".join(f"{name:>11}" for name in header))
        for rank in self.ranks:
            cells = [
                f"{rank.rank}",
                *(f"{getattr(rank, row) / _GIB:.2f} GiB" for row in ROWS),
                f"{rank.peak / _GIB:.2f} GiB",
                f"{self.capacity / _GIB:.0f} GiB",
            ]
            lines.append(" | ".join(f"{cell:>11}" for cell in cells))
        lines += ["", "collectives of one training step (per rank)", f"{'kind':>30} | {'count':>6} | {'bytes':>12}"]
        for collective in self.collectives:
            lines.append(f"{collective.kind:>30} | {collective.count:>6} | {_size(collective.bytes_per_rank):>12}")
        if not self.collectives:
            lines.append(f"{'(none)':>30} |")
        lines += ["", *self.notes]
        if not self.fits:
            lines.append(self.advice())
        lines.append(f"peak device memory per rank: {self.peak / _GIB:.2f} GiB of {self.capacity / _GIB:.2f} GiB")
        return "\n".join(line for index, line in enumerate(lines) if line or lines[index - 1])


def _size(count: int) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


# --------------------------------------------------------------------------------------------- the simulated job


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


@contextlib.contextmanager
def _fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default group is PyTorch's fake one for this rank; groups asked for with the gloo backend (the
    strategies' host group) are fake as well, since a real gloo group needs its peers."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("lightning_trn.estimate runs in a process without a process group; one is initialized.")
    new_group = dist.new_group

    def fake_new_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = "fake"
        return new_group(*args, **kwargs)

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    dist.new_group = fake_new_group
    try:
        yield
    finally:
        dist.new_group = new_group
        dist.destroy_process_group()


def _on_real_tensors(function: Callable[..., Any]) -> Callable[..., Any]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    @functools.wraps(function)
    def on_real_tensors(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return on_real_tensors


def _swap_unless_unchanged(swap: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[..., None]:
    from torch._subclasses.fake_tensor import FakeTensor

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        same = (t1.device, t1.dtype, t1.shape, t1.stride()) == (t2.device, t2.dtype, t2.shape, t2.stride())
        if not (same and isinstance(t1, FakeTensor)):
            swap(t1, t2)

    return swap_tensors


@contextlib.contextmanager
def _fake_tensor_fixes() -> Iterator[None]:
    """What torch cannot do with fake tensors, done another way while simulating:

    - device meshes and DTensor shard offsets are host bookkeeping (a mesh's rank lists, a shard's offsets) that
      torch reads back (`tolist`, `nonzero`, `int`), which fake tensors cannot answer: they are computed on real
      tensors (FSDP2 over a tensor-parallel mesh builds a mesh while sharding; `materialize` asks for offsets);
    - `Module.to(device)` swaps every fake parameter for a copy of itself, which torch refuses once the fake
      parameter has a weak reference (any fake `Parameter` has): a move that changes nothing keeps the parameter;
    - DTensor's sharding propagation runs each operator once more on fake tensors of the global shape, for the
      output's metadata only, in the fake mode it finds active: the simulation's own, whose tensors the tracker
      counts (the full vocabulary's log-softmax and its input under loss parallelism: +12 % on the checkpointed
      test model's peak; the unsharded parameters' optimizer state in the first step). It gets a fake mode of its
      own, as it does in a real run, where it allocates no device memory; the tracker skips that mode's tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import _sharding_prop, _utils

    propagation_mode = FakeTensorMode()
    patched: list[tuple[Any, str, Callable[[Any], Any]]] = [
        (DeviceMesh, "__init__", _on_real_tensors),
        (_utils, "compute_local_shape_and_global_offset", _on_real_tensors),
        (torch.utils, "swap_tensors", _swap_unless_unchanged),
        (_sharding_prop, "detect_fake_mode", lambda original: lambda *args: propagation_mode),
    ]
    originals = [getattr(owner, name) for owner, name, _ in patched]
    for (owner, name, wrap), original in zip(patched, originals, strict=True):
        setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        for (owner, name, _), original in zip(patched, originals, strict=True):
            setattr(owner, name, original)


class _CollectiveBytes:
    """`CommDebugMode` counting the bytes of each collective's largest tensor as well (set up lazily: the class
    needs torch.distributed.tensor)."""

    @staticmethod
    def mode() -> Any:
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops

        class Mode(CommDebugMode):
            def __init__(self) -> None:
                super().__init__()
                self.comm_bytes: dict[Any, int] = defaultdict(int)

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = super().__torch_dispatch__(func, types, args, kwargs)
                packet = getattr(func, "_overloadpacket", None)
                if out is not NotImplemented and (packet in self.comm_registry or packet in c10d_collective_ops):
                    packet = NATIVE_TO_PY_MAPPING.get(packet, packet)
                    self.comm_bytes[packet] += max(map(_tensor_bytes, (*args, *(kwargs or {}).values(), out)))
                return out

        return Mode()


def _tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in one argument of a collective (a tensor, or a list of them, e.g. an all-gather's
    outputs)."""
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _collectives(mode: Any) -> list[Collective]:
    return [
        Collective(
            str(packet).replace("c10d.", "").replace("_c10d_functional.", ""), count, mode.comm_bytes.get(packet, 0)
        )
        for packet, count in sorted(mode.get_comm_counts().items(), key=lambda item: str(item[0]))
    ]


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


class _Measure:
    """A callback that makes every tensor fake from the `setup` hook on (after the strategy's environment: the
    device mesh is built from real rank lists), tracks the device memory from the end of the strategy's setup
    (`on_fit_start`: the model sharded and materialized, the optimizer built) to the end of the second training
    step, and the collectives of that step."""

    @staticmethod
    def callback(result: dict[str, Any], fake_mode: Any) -> Any:
        from lightning.pytorch.callbacks import Callback
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker

        class Measure(Callback):
            def __init__(self) -> None:
                self.fake = contextlib.ExitStack()
                self.stack = contextlib.ExitStack()
                self.comms: Any = None

            def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
                self.fake.enter_context(fake_mode)

            def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
                self.fake.close()

            def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
                for each in trainer.optimizers:
                    _closure_first(each)
                optimizer = trainer.optimizers[0] if trainer.optimizers else None
                root = _fsdp_root(trainer.strategy.model)
                if root is not None:
                    tracker: MemTracker = FSDPMemTracker(root, optimizer)
                    self.stack.enter_context(tracker)
                    # the rest of the LightningModule (metrics' states, an unsharded head) is device memory too
                    tracker.track_external(
                        *(t for t in [*pl_module.parameters(), *pl_module.buffers()] if not _is_dtensor(t))
                    )
                else:
                    tracker = MemTracker()
                    tracker.track_external(pl_module, *([optimizer] if optimizer is not None else []))
                    self.stack.enter_context(tracker)
                result["tracker"] = tracker

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == 1:
                    self.comms = self.stack.enter_context(_CollectiveBytes.mode())

            def on_train_batch_end(
                self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
            ) -> None:
                if batch_idx == 0:
                    result["tracker"].reset_mod_stats()
                    _restart_peak(result["tracker"])
                    return
                self.stack.close()  # the modes leave in the order they entered, inner first
                result["collectives"] = _collectives(self.comms)
                trainer.should_stop = True

            def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
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


def _closure_first(optimizer: torch.optim.Optimizer) -> None:
    """Lightning hands forward and backward to `optimizer.step(closure)`, inside the optimizer's step hooks, where
    the trackers file every tensor as optimizer state. Run the closure first, then the step without it, so
    activations and gradients count as such (an optimizer that calls its closure once does the same work)."""
    step = optimizer.step

    @functools.wraps(step)  # keeps the LR scheduler's mark on the step it wrapped
    def closure_then_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = closure() if closure is not None else None
        step(**kwargs)
        return loss

    optimizer.step = closure_then_step  # type: ignore[method-assign]  # patched on this one optimizer object only


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _host_loader(batch: Any) -> Any:
    """A training loader of two copies of `batch` (a pytree of tensors; only shapes and dtypes count) as host
    tensors of zeros (valid indices for embeddings and losses): the strategy copies them to the device as it copies
    real batches (host memory: one micro-batch, a few MB)."""
    batches = [tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), batch) for _ in range(2)]
    return _Batches(batches)


class _Batches:
    """The batches as they are, one at a time: a `DataLoader` would draw its seed from a tensor (fake here)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def simulate_rank(
    module_factory: Callable[[], Any], batch: Any, rank: int, **trainer_kwargs: Any
) -> tuple[RankMemory, list[Collective]]:
    """Train two steps as rank `rank` of the job `trainer_kwargs` describes, on fake tensors and a fake process
    group; returns that rank's memory at the second step's peak and that step's collectives."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch._subclasses.fake_tensor import FakeTensorMode

    devices, nodes = int(trainer_kwargs.get("devices", 1)), int(trainer_kwargs.get("num_nodes", 1))
    world_size = devices * nodes
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    result: dict[str, Any] = {}
    # the strategy sets it to the simulated rank
    printing_rank = rank_zero_only.rank  # type: ignore[attr-defined]  # Lightning sets it as an attribute of the function
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, rank_zero_only, "rank", printing_rank)
        # Lightning's launcher lowers the process's thread count for the simulated processes of one node (to 1
        # under 64 devices); the simulation runs in the caller's process, which keeps its own
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        root = stack.enter_context(tempfile.TemporaryDirectory())
        stack.enter_context(_fake_process_group(rank, world_size))
        stack.enter_context(_fake_tensor_fixes())
        trainer = pl.Trainer(
            **{
                **trainer_kwargs,
                "max_epochs": -1,
                "max_steps": 2,
                "accumulate_grad_batches": 1,
                "limit_val_batches": 0,
                "num_sanity_val_steps": 0,
                "logger": False,
                "enable_checkpointing": False,
                "enable_progress_bar": False,
                "enable_model_summary": False,
                "use_distributed_sampler": False,
                "default_root_dir": root,
                "callbacks": [_Measure.callback(result, fake_mode)],
                "plugins": [*_as_list(trainer_kwargs.get("plugins")), _cluster(world_size, rank, devices)],
            }
        )
        if isinstance(trainer.strategy, ModelParallelStrategy):  # ours (and FSDP) materialize a meta-built model
            module = module_factory()
        else:  # built on meta (no memory, however large), then fake where the strategy would move it
            with torch.device("meta"):
                module = module_factory()
            with fake_mode:
                module._apply(functools.partial(_fake_on, trainer.strategy.root_device))
        # logging is host bookkeeping of (here fake) scalars, not device memory
        module.log = lambda *args, **kwargs: None
        module.log_dict = lambda *args, **kwargs: None
        # the simulated module is thrown away: teardown's move to the host is skipped (torch cannot swap a fake
        # parameter for its host copy)
        module.cpu = lambda: module
        trainer.fit(module, train_dataloaders=_host_loader(batch))
    if "collectives" not in result:
        raise RuntimeError("lightning_trn.estimate: the simulated run ended before its second training step.")
    return _rank_memory(rank, _device_snapshot(result["tracker"].get_tracker_snapshot("peak"))), result["collectives"]


def _device_snapshot(snapshot: dict[torch.device, dict[Any, int]]) -> dict[Any, int]:
    return next((snap for device, snap in snapshot.items() if device.type != "cpu"), {})


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


def estimate(
    module_factory: Callable[[], Any],
    batch: Any,
    *,
    platform: str | None = None,
    ranks: Sequence[int] = (0,),
    **trainer_kwargs: Any,
) -> Estimate:
    """Estimate the device memory per rank and the collectives of one training step of the job
    `Trainer(**trainer_kwargs).fit(module_factory(), ...)` at its real world size, in this process.

    Args:
        module_factory: builds the LightningModule as the training script does (on the meta device where the job
            would); called once per simulated rank.
        batch: one micro-batch as the training loader yields it (a pytree of tensors of any device: meta tensors
            allocate nothing); only shapes and dtypes are used.
        platform: "trn1", "trn2" or "trn3": the capacity per rank (`CAPACITY_GIB`); default `default_platform`.
        ranks: the ranks to simulate; ranks whose shards have the same shapes use the same memory, so rank 0 stands
            for all of them under FSDP2 (evenly padded shards), tensor parallelism and ZeRO-1 (evenly padded chunks).
        trainer_kwargs: the Trainer arguments of the job (`accelerator="neuron"`, `devices`, `num_nodes`,
            `strategy`, `precision`, ...). Loop lengths, logging and checkpointing are the estimator's.

    On the stand-in, `devices` may be at most its device count (`LIGHTNING_TRN_STANDIN_DEVICES`, set before it
    loads; `python -m lightning_trn.estimate` sets 64).

    Raises:
        RuntimeError: a process group exists already.
    """
    platform = platform or default_platform(trainer_kwargs)
    memories: list[Any] = []
    collectives: list[Any] = []
    for rank in ranks:
        memory, step_collectives = simulate_rank(module_factory, batch, rank, **trainer_kwargs)
        memories.append(memory)
        collectives = collectives or step_collectives
    world_size = int(trainer_kwargs.get("devices", 1)) * int(trainer_kwargs.get("num_nodes", 1))
    notes = [XLA_NOTE] if platform in XLA_PLATFORMS else []
    return Estimate(world_size, platform, int(CAPACITY_GIB[platform] * _GIB), memories, collectives, notes)


__all__ = ["CAPACITY_GIB", "Collective", "Estimate", "RankMemory", "estimate", "simulate_rank"]
