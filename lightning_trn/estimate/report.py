"""What an estimate reports: each platform's memory budget (capacity, margin, runtime-reserved memory, and where
each number comes from), the per-rank memory and collectives of the simulated step, the verdict and the advice."""

from __future__ import annotations

from dataclasses import dataclass, field

_GIB = 2**30
_MIB = 2**20


@dataclass(frozen=True)
class PlatformBudget:
    """The device memory one rank (one process: a NeuronCore, or a logical core at LNC=2) may use on a platform.

    A job fits when `peak * (1 + margin) + reserved <= capacity`: `margin` covers what the simulation's exact,
    uncached allocator does not see (a real allocator's rounding and fragmentation), `reserved` what the Neuron
    runtime takes before the model allocates anything.
    """

    capacity_gib: float
    capacity_source: str
    physical_cores: int  # NeuronCores per rank: 1 on Trn1, 2 at LNC=2 on Trn2/Trn3
    margin: float
    reserved: int

    def needed(self, peak: int) -> int:
        """Bytes of device memory a job whose simulated peak is `peak` needs on this platform."""
        return int(peak * (1 + self.margin)) + self.reserved


#: AWS's device-memory page (Neuron 2.33, "Neuron device memory"): the runtime's model code includes "a micro-code
#: overhead of 96MB per physical Neuron Core"
MICROCODE_PER_CORE = 96 * _MIB
#: scratchpad, DMA rings and collective buffers, which that page lists without a size: a conservative default, not a
#: measurement
RUNTIME_DEFAULT = 1 * _GIB
#: PyTorch's trackers were 0.6-0.7 % under CUDA's caching allocator's peak for one training step (measured on an
#: H100); AWS publishes no figure for Neuron's allocator, so the larger H100 figure stands in
MARGIN = 0.007

MARGIN_SOURCE = (
    "margin 0.7 %: the H100 measurement (PyTorch's trackers 0.6-0.7 % under the real allocator's peak for a "
    "training step; AWS publishes no figure for Neuron's allocator)"
)
RESERVED_SOURCE = (
    "reserved: AWS's 96 MB of runtime micro-code per physical NeuronCore (Neuron device-memory docs) + 1 GiB for "
    "scratchpad, DMA rings and collective buffers (a conservative default: AWS gives no size)"
)
NOT_SIMULATED = (
    "not simulated: validation, checkpoint saving, the first step's compilation, other processes on the device "
    "(their peaks can exceed the training step's)"
)


def _reserved(physical_cores: int) -> int:
    return physical_cores * MICROCODE_PER_CORE + RUNTIME_DEFAULT


PLATFORMS: dict[str, PlatformBudget] = {
    "trn1": PlatformBudget(16.0, "a NeuronCore-v2: 32 GiB of HBM per Trainium chip, 2 cores", 1, MARGIN, _reserved(1)),
    "trn2": PlatformBudget(
        24.0, "a logical core at LNC=2: 96 GiB of HBM per Trainium2 chip, 4 logical cores", 2, MARGIN, _reserved(2)
    ),
    "trn3": PlatformBudget(
        36.0,
        "unconfirmed: 144 GB of HBM per Trainium3 chip (AWS's announcement), 4 logical cores at LNC=2",
        2,
        MARGIN,
        _reserved(2),
    ),
}
#: device memory per rank, in GiB (each platform's `PlatformBudget.capacity_gib`)
CAPACITY_GIB = {name: budget.capacity_gib for name, budget in PLATFORMS.items()}
#: what each platform trains with: the native stack (TorchNeuron) on Trn2/Trn3, the XLA stack on Trn1
XLA_PLATFORMS = ("trn1",)
XLA_NOTE = (
    "XLA stack: the training state (parameters, gradients, ZeRO-1 chunks, fp32 masters) is exact; activations and "
    "temporaries come from the eager trace, an upper bound (the Neuron compiler schedules the device's real peak)."
)
ROWS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
#: who asked: the advice names what that caller can change
RECIPE, API = "recipe", "api"
_ADVICE = {
    RECIPE: (
        "activations dominate: turn on activation checkpointing (model.activation_checkpointing=true) if it is off, "
        "lower the micro-batch (data.batch_size), or shard activations with more tensor parallelism "
        "(model.tensor_parallel_size)",
        "shard the training state further: more tensor parallelism (model.tensor_parallel_size), FSDP over more "
        "ranks (trainer.num_nodes), or ZeRO-1 where the state is replicated",
    ),
    API: (
        "activations dominate: checkpoint the blocks' activations (FSDPStrategy(activation_checkpointing_policy="
        "{Block}), or torch.utils.checkpoint in your module), lower the micro-batch (your DataLoader's batch_size), "
        "or shard activations with more tensor parallelism (ModelParallelStrategy(tensor_parallel_size=...) and "
        "its plan in configure_model)",
        "shard the training state further: FSDP (strategy='fsdp') over more ranks (Trainer(num_nodes=...)), more "
        "tensor parallelism (ModelParallelStrategy(tensor_parallel_size=...)), or ZeRO-1 (strategy='neuron_zero1') "
        "where the state is replicated",
    ),
}


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
    of an all-reduce), and `across_nodes`, the part of them in groups whose ranks are on more than one node (EFA
    between nodes rather than NeuronLink within one)."""

    kind: str
    count: int
    bytes_per_rank: int
    across_nodes: int = 0


@dataclass
class Estimate:
    """What `estimate` found: per simulated rank its memory, the step's collectives, the capacity of a core;
    `simulated` says in one line which stack and platform were simulated, `caller` whose advice to give (`"api"`:
    Trainer and strategy arguments, `"recipe"`: the recipe's keys)."""

    world_size: int
    platform: str
    capacity: int
    ranks: list[RankMemory]
    collectives: list[Collective] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    simulated: str = ""
    caller: str = API

    @property
    def peak(self) -> int:
        """The largest rank's peak, bytes."""
        return max(rank.peak for rank in self.ranks)

    @property
    def budget(self) -> PlatformBudget:
        return PLATFORMS[self.platform]

    @property
    def needed(self) -> int:
        """Bytes the job needs per rank on the platform: `peak * (1 + margin) + reserved`."""
        return self.budget.needed(self.peak)

    @property
    def fits(self) -> bool:
        """Whether `peak * (1 + margin) + reserved <= capacity` (`PlatformBudget`)."""
        return self.needed <= self.capacity

    def advice(self) -> str:
        """One line naming what to change when it does not fit, from the category that dominates the peak, in the
        caller's terms (`caller`)."""
        if self.fits:
            return ""
        worst = max(self.ranks, key=lambda rank: rank.peak)
        over = (self.needed - self.capacity) / _GIB
        activations, state = _ADVICE[self.caller]
        dominated = worst.activations + worst.temporaries >= worst.parameters + worst.gradients + worst.optimizer_state
        return f"does not fit: {over:.2f} GiB over; {activations if dominated else state}."

    def budget_line(self) -> str:
        """The verdict's arithmetic: the peak with its margin and the reserved memory, against the capacity."""
        budget = self.budget
        return (
            f"needed per rank: {self.peak / _GIB:.2f} GiB peak x {1 + budget.margin:.3f} + "
            f"{budget.reserved / _GIB:.2f} GiB reserved = {self.needed / _GIB:.2f} GiB of {self.capacity / _GIB:.2f} "
            f"GiB: {'fits' if self.fits else 'does not fit'}"
        )

    def format(self) -> str:
        """The report `python -m lightning_trn.estimate` prints; its last line is
        `peak device memory per rank: <x> GiB of <y> GiB`."""
        lines = [self.simulated] if self.simulated else []
        lines += [f"world size {self.world_size}, {self.platform}: {self.capacity / _GIB:.0f} GiB per rank", ""]
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
        lines += [
            "",
            "collectives of one training step (per rank)",
            f"{'kind':>30} | {'count':>6} | {'bytes':>12} | {'across nodes':>12}",
        ]
        for collective in self.collectives:
            sizes = f"{_size(collective.bytes_per_rank):>12} | {_size(collective.across_nodes):>12}"
            lines.append(f"{collective.kind:>30} | {collective.count:>6} | {sizes}")
        if not self.collectives:
            lines.append(f"{'(none)':>30} |")
        total = sum(collective.bytes_per_rank for collective in self.collectives)
        across = sum(collective.across_nodes for collective in self.collectives)
        lines.append(
            f"bytes per rank and step: {_size(total)} in all, {_size(across)} in groups that span nodes, "
            f"{_size(total - across)} within a node"
        )
        lines += ["", *self.notes, MARGIN_SOURCE, RESERVED_SOURCE, NOT_SIMULATED, self.budget_line()]
        if not self.fits:
            lines.append(self.advice())
        lines.append(f"peak device memory per rank: {self.peak / _GIB:.2f} GiB of {self.capacity / _GIB:.2f} GiB")
        return "\n".join(line for index, line in enumerate(lines) if line or lines[index - 1])


def _size(count: int) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", _MIB), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"
