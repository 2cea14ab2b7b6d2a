"""What an estimate reports: each platform's memory budget (capacity, margin, runtime-reserved memory, and where
each number comes from), the per-rank memory and collectives of the simulated step, the verdict and the advice."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_trn.estimate.step_time import HARDWARE, StepTime, Work, predict

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
#: with pipeline stages a stage holds the activations of the microbatches in flight (up to the stages under 1F1B,
#: all of them under GPipe), so the micro-batch to lower is the pipeline's microbatch, not the batch
_PIPELINE_ADVICE = {
    RECIPE: (
        "activations dominate: split each batch into more, smaller microbatches (model.pipeline_microbatches), use "
        "model.pipeline_schedule=1F1B if it is GPipe (GPipe holds every microbatch's activations), or turn on "
        "activation checkpointing (model.activation_checkpointing=true)",
        "temporaries dominate: under FSDP2 a stage keeps its layers gathered and their gradients unsharded (in "
        "float32) from the first microbatch to the step's end, so that it gathers and reduces once per step "
        "(TorchTitan's layout); fewer layers per stage (more stages: model.pipeline_parallel_size) or more tensor "
        "parallelism (model.tensor_parallel_size) divide them",
    ),
    API: (
        "activations dominate: split each batch into more, smaller microbatches (NeuronModelParallelStrategy("
        "pipeline_microbatches=...)), use pipeline_schedule='1F1B' if it is GPipe (GPipe holds every microbatch's "
        "activations), or checkpoint the blocks' activations in configure_model",
        "temporaries dominate: under FSDP2 a stage keeps its layers gathered and their gradients unsharded (in "
        "float32) from the first microbatch to the step's end, so that it gathers and reduces once per step "
        "(TorchTitan's layout); fewer layers per stage (NeuronModelParallelStrategy(pipeline_parallel_size=...)) or "
        "more tensor parallelism (tensor_parallel_size=...) divide them",
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
    #: the operator (`c10d.` for FSDP2's and DDP's, `_c10d_functional.` for DTensor's); the bytes a rank sends for
    #: it in ring algorithms (`step_time.ring_factor`) in groups within one node; in groups that span nodes, those
    #: bytes over the group's ranks per node (each of the node's rings crosses the network once, so a node's
    #: network carries one share per ring: `step_time.predict`)
    op: str = ""
    wire_within: float = 0.0
    wire_across: float = 0.0


#: the part of a step each schedule leaves a pipeline rank idle (its "bubble"), with `p` pipeline ranks, `m`
#: microbatches and `v` stages per rank, and where the formula comes from
BUBBLE_FORMULAS = {
    "GPipe": (
        "(p-1)/(m+p-1)",
        "each rank idles p-1 of the m+p-1 forward and backward slots of a step (GPipe, arXiv 1811.06965; "
        "Megatron-LM, arXiv 2104.04473, section 2.2.1)",
    ),
    "1F1B": (
        "(p-1)/(m+p-1)",
        "1F1B reorders GPipe's slots without removing any (Megatron-LM, arXiv 2104.04473, section 2.2.1)",
    ),
    "Interleaved1F1B": (
        "(p-1)/(v*m+p-1)",
        "v stages per rank divide 1F1B's bubble by v (Megatron-LM, arXiv 2104.04473, section 2.2.2)",
    ),
    "ZBVZeroBubble": (
        "0",
        "weight gradients fill the bubble when forward, input-gradient and weight-gradient passes take equal time "
        "(torch's ScheduleZBVZeroBubble; Zero Bubble Pipeline Parallelism, arXiv 2401.10241, section 6); "
        "unequal passes leave some",
    ),
}
#: the rows of the stage transfers in a rank's collectives (`Pipeline.point_to_point`)
STAGE_SEND, STAGE_RECV = "stage send", "stage recv"


def bubble_fraction(schedule: str, ranks: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle part of a step of `schedule` (`BUBBLE_FORMULAS`) with `ranks` pipeline ranks, `microbatches` and
    `stages_per_rank` (Interleaved1F1B's v; the others ignore it)."""
    if schedule not in BUBBLE_FORMULAS:
        raise ValueError(f"schedule={schedule!r}: expected one of {', '.join(BUBBLE_FORMULAS)}.")
    if schedule == "ZBVZeroBubble":
        return 0.0
    slots = microbatches * (stages_per_rank if schedule == "Interleaved1F1B" else 1)
    return (ranks - 1) / (slots + ranks - 1)


@dataclass
class PipelineEstimate:
    """The pipeline stages of an estimated job: `schedule` over `ranks` pipeline ranks (p) with `microbatches` (m)
    and `stages_per_rank` (v), and for each simulated rank its stage indices and its step's collectives, stage
    transfers included (the stages differ: the first has the embedding, the last the head and the loss)."""

    schedule: str
    ranks: int
    microbatches: int
    stages_per_rank: int
    stages: dict[int, list[int]]
    collectives: dict[int, list[Collective]]

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.schedule, self.ranks, self.microbatches, self.stages_per_rank)

    def label(self, rank: int) -> str:
        """`rank`'s stages and their kind, e.g. `0 (first)`, `1, 2 (middle)`."""
        stages, last = self.stages[rank], self.ranks * self.stages_per_rank - 1
        kinds = [kind for kind, held in (("first", 0 in stages), ("last", last in stages)) if held]
        if any(stage not in (0, last) for stage in stages):
            kinds.insert(len(kinds) - ("last" in kinds), "middle")
        return f"{', '.join(map(str, stages))} ({', '.join(kinds)})"

    def point_to_point(self, rank: int) -> tuple[int, int]:
        """Bytes `rank` sent and received between stages in the step."""
        sizes = {collective.kind: collective.bytes_per_rank for collective in self.collectives[rank]}
        return sizes.get(STAGE_SEND, 0), sizes.get(STAGE_RECV, 0)

    def bubble_line(self) -> str:
        formula, source = BUBBLE_FORMULAS[self.schedule]
        per_rank = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
        return (
            f"pipeline: {self.schedule}, {self.ranks} pipeline ranks{per_rank}, {self.microbatches} microbatches: "
            f"bubble {formula} = {100 * self.bubble:.1f} % of a step idle; {source}"
        )


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
    pipeline: PipelineEstimate | None = None
    #: each simulated rank's operations and tokens (`step_time.Work`), for the step-time model
    work: dict[int, Work] = field(default_factory=dict)

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

    def step_time(self, hardware: str | None = None, compiled: bool | None = None) -> StepTime | None:
        """The step-time model's prediction on `hardware` (a key of `step_time.HARDWARE`; default this estimate's
        platform): the slowest simulated rank's (with pipeline stages, each stage's own collectives and the
        schedule's bubble). `compiled`: predict the step with its blocks compiled (memory-bound chains fused)
        though the simulation ran them eagerly; None: as simulated. None when no operations were recorded."""
        if not self.work:
            return None
        chosen = HARDWARE[hardware or self.platform]
        pipeline = self.pipeline
        times = [
            predict(
                work.ops,
                pipeline.collectives[rank] if pipeline is not None else self.collectives,
                chosen,
                compiled=work.compiled if compiled is None else compiled,
                bubble=pipeline.bubble if pipeline is not None else 0.0,
                tokens_per_step=work.tokens_per_step,
            )
            for rank, work in self.work.items()
        ]
        return max(times, key=lambda time: time.step_s)

    def advice(self) -> str:
        """One line naming what to change when it does not fit, from the category that dominates the peak, in the
        caller's terms (`caller`)."""
        if self.fits:
            return ""
        worst = max(self.ranks, key=lambda rank: rank.peak)
        over = (self.needed - self.capacity) / _GIB
        activations, state = _ADVICE[self.caller]
        if self.pipeline is not None:
            activations, temporaries = _PIPELINE_ADVICE[self.caller]
            activations = temporaries if worst.temporaries > worst.activations else activations
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
        `peak device memory per rank: <x> GiB of <y> GiB`. With pipeline stages: the schedule and its bubble, a
        `stages` column, and each simulated rank's collectives with its stage transfers."""
        pipeline = self.pipeline
        lines = [self.simulated] if self.simulated else []
        lines += [f"world size {self.world_size}, {self.platform}: {self.capacity / _GIB:.0f} GiB per rank"]
        lines += [pipeline.bubble_line()] if pipeline is not None else []
        lines.append("")
        stages = ("stages",) if pipeline is not None else ()
        labels = [pipeline.label(rank.rank) for rank in self.ranks] if pipeline is not None else []
        widths = {"stages": max(18, *map(len, labels))} if labels else {}
        header = (
            "rank",
            *stages,
            "parameters",
            "gradients",
            "optimizer",
            "activations",
            "temporaries",
            "total peak",
            "capacity",
        )
        lines.append(" | ".join(f"{name:>{widths.get(name, 11)}}" for name in header))
        for rank in self.ranks:
            cells = [
                f"{rank.rank}",
                *((pipeline.label(rank.rank),) if pipeline is not None else ()),
                *(f"{getattr(rank, row) / _GIB:.2f} GiB" for row in ROWS),
                f"{rank.peak / _GIB:.2f} GiB",
                f"{self.capacity / _GIB:.0f} GiB",
            ]
            lines.append(
                " | ".join(f"{cell:>{widths.get(name, 11)}}" for name, cell in zip(header, cells, strict=True))
            )
        if pipeline is None:
            lines += ["", *_collective_lines("collectives of one training step (per rank)", self.collectives)]
        else:
            for rank in self.ranks:
                title = f"collectives of one training step, rank {rank.rank} (stages {pipeline.label(rank.rank)})"
                lines += ["", *_collective_lines(title, pipeline.collectives[rank.rank])]
                sent, received = pipeline.point_to_point(rank.rank)
                lines.append(
                    f"point-to-point bytes per step, rank {rank.rank}: {_size(sent)} sent, {_size(received)} "
                    "received (activations forward, their gradients back)"
                )
        timing = self.step_time()
        if timing is not None:
            lines += ["", *timing.lines()]
        lines += ["", *self.notes, MARGIN_SOURCE, RESERVED_SOURCE, NOT_SIMULATED]
        if pipeline is not None:
            lines.append("every stage must fit: the verdict is the largest stage's")
        lines.append(self.budget_line())
        if not self.fits:
            lines.append(self.advice())
        lines.append(f"peak device memory per rank: {self.peak / _GIB:.2f} GiB of {self.capacity / _GIB:.2f} GiB")
        return "\n".join(line for index, line in enumerate(lines) if line or lines[index - 1])


def _collective_lines(title: str, collectives: list[Collective]) -> list[str]:
    """A collectives table: one row per kind, then the bytes in all, across nodes and within a node."""
    lines = [title, f"{'kind':>30} | {'count':>6} | {'bytes':>12} | {'across nodes':>12}"]
    for collective in collectives:
        sizes = f"{_size(collective.bytes_per_rank):>12} | {_size(collective.across_nodes):>12}"
        lines.append(f"{collective.kind:>30} | {collective.count:>6} | {sizes}")
    if not collectives:
        lines.append(f"{'(none)':>30} |")
    total = sum(collective.bytes_per_rank for collective in collectives)
    across = sum(collective.across_nodes for collective in collectives)
    lines.append(
        f"bytes per rank and step: {_size(total)} in all, {_size(across)} in groups that span nodes, "
        f"{_size(total - across)} within a node"
    )
    return lines


def _size(count: int) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", _MIB), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"
