"""How long a simulated training step takes on a platform: the step-time model.

The simulation (`simulation.simulate_rank`) runs the rank's real step on fake tensors; `OpCount` sees every operation
it runs on the device, with the shapes the rank holds (a DTensor's local shard), and `Collective` every collective
with its group. From them and a platform's published constants (`HARDWARE`, each with its source):

- a matrix product (mm, addmm, bmm, baddbmm) takes `max(flops / (peak x matmul_efficiency), bytes / HBM)`: its FLOPs
  from torch's own formulas (`torch.utils.flop_counter`), its bytes the operands and result; attention the same at
  `attention_efficiency` (a flash kernel's measured fraction), causal attention at half its FLOPs (flash kernels
  skip the masked blocks);
- any other operation is memory-bound: `bytes / HBM`, its bytes every tensor it reads and writes; in blocks compiled
  with `torch.compile` (seen on the module) a chain of such operations between two matrix products fuses into one
  kernel: an input another operation of the chain produced is not read back from HBM (its outputs are still
  written: which of them a later kernel reads is not known when they are made);
- a collective moves `factor x bytes` per rank (ring algorithms: all-gather and reduce-scatter `(n-1)/n`,
  all-reduce `2(n-1)/n`): within a node over the chip's link (NeuronLink, NVLink) shared by the chip's ranks; in a
  group that spans nodes, the slowest hop is the one between nodes, and the node's network (EFA) is shared by the
  node's rings, one per group with ranks there, each carrying a share of `g` of the node's ranks (`g`: the group's
  ranks on that node), so `factor x bytes / g` at the network's per-rank share;
- overlap: the collectives FSDP2 and DDP issue from their hooks (`c10d` ops) run beside the computation as FSDP2's
  prefetch allows, so only what exceeds the compute shows; DTensor's collectives (tensor parallel, loss parallel)
  and pipeline transfers wait for their inputs and add up; a pipeline's bubble idles the rank for its share of the
  step: `step = (compute + exposed) / (1 - bubble) + max(0, overlapped - compute)`.

MFU is TorchTitan's: the model's FLOPs (three times the forward's matrix products, attention counted whole, no
recomputation) over the step time and the peak. Not modelled: kernel launch and collective latency, host overhead,
the first step's compilation, stragglers; the constants are peaks. `benchmarks/step_time.py` checks the model
against published throughput (docs/sharding.md, "How fast?").
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from lightning_trn.estimate.report import Collective


@dataclass(frozen=True)
class Hardware:
    """One platform's constants for the step-time model, per chip (a Trainium chip, a GPU), with their sources.

    `ranks_per_chip`: processes per chip (Trn1: 2 NeuronCores; Trn2/Trn3 at LNC=2: 4 logical cores; a GPU: 1); a
    rank gets its share of the chip's peak, HBM and link. `matmul_efficiency`: the fraction of the peak a large
    matrix product reaches (measured where published)."""

    name: str
    peak_flops: float
    matmul_efficiency: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    network_bytes_per_s: float
    chips_per_node: int
    ranks_per_chip: int
    sources: tuple[str, ...]
    attention_efficiency: float = 1.0

    @property
    def ranks_per_node(self) -> int:
        return self.chips_per_node * self.ranks_per_chip


_T, _G = 1e12, 1e9
#: Stas Bekman's "Maximum Achievable Matmul FLOPS" table (ml-engineering, compute/accelerator): H100 SXM 792.1 of
#: 989 TFLOPS (80.1 %); AWS publishes no such measurement for Trainium, so the same fraction stands in there
_MAMF = 0.801
_MAMF_SOURCE = "matmul efficiency 80.1 %: the H100 SXM's measured maximum achievable matmul FLOPS (ml-engineering)"
_TRAINIUM_MAMF_SOURCE = (
    "matmul efficiency 80.1 %: an assumption (the H100's measured fraction; AWS publishes none for Trainium)"
)
#: FlashAttention-3's paper (Shah et al., arXiv 2407.08608, abstract): FlashAttention-2 "achieving only 35%
#: utilization on H100 GPUs", the kernel torch's SDPA ran in TorchTitan's published H100 runs (December 2024)
_ATTENTION = 0.35
_ATTENTION_SOURCE = "attention efficiency 35 %: FlashAttention-2's utilization on H100 (FlashAttention-3 paper)"
_TRAINIUM_ATTENTION_SOURCE = (
    "attention efficiency 35 %: an assumption (FlashAttention-2's on H100; AWS publishes none for its kernels)"
)

HARDWARE: dict[str, Hardware] = {
    "trn1": Hardware(
        "trn1.32xlarge",
        190 * _T,
        _MAMF,
        820 * 2**30,
        384 * _G,
        800 / 8 * _G,
        16,
        2,
        (
            "190 BF16 TFLOPS and 820 GiB/s of HBM per Trainium chip (AWS Neuron docs, Trainium architecture)",
            "NeuronLink-v2 384 GB/s per chip (AWS Neuron docs, Trn1 architecture); EFA 800 Gbps per trn1.32xlarge",
            _TRAINIUM_MAMF_SOURCE,
            _TRAINIUM_ATTENTION_SOURCE,
        ),
        _ATTENTION,
    ),
    "trn2": Hardware(
        "trn2.48xlarge",
        667 * _T,
        _MAMF,
        2.9 * 1e12,
        1.28 * 1e12,
        3200 / 8 * _G,
        16,
        4,
        (
            "667 BF16 TFLOPS, 2.9 TB/s of HBM and NeuronLink-v3 1.28 TB/s per Trainium2 chip (AWS Neuron docs, "
            "Trainium2 architecture); EFA 3.2 Tbps per trn2.48xlarge; 4 logical cores per chip at LNC=2",
            _TRAINIUM_MAMF_SOURCE,
            _TRAINIUM_ATTENTION_SOURCE,
        ),
        _ATTENTION,
    ),
    "trn3": Hardware(
        "trn3 (16 chips)",
        671 * _T,
        _MAMF,
        4.9 * 1e12,
        2.56 * 1e12,
        3200 / 8 * _G,
        16,
        4,
        (
            "671 BF16 TFLOPS, 4.9 TB/s of HBM and NeuronLink-v4 2.56 TB/s per Trainium3 chip (AWS Neuron docs, "
            "Trainium3 architecture); unconfirmed: 16 chips and Trn2's EFA 3.2 Tbps per node",
            _TRAINIUM_MAMF_SOURCE,
            _TRAINIUM_ATTENTION_SOURCE,
        ),
        _ATTENTION,
    ),
    # TorchTitan's published runs (benchmarks/llama3_h100_202412_torchtitan.md): Grand Teton hosts of 8 H100s with
    # 96 GB HBM2e at 2.4 TB/s, 500 W, 400 Gb/s RDMA per GPU; "the actual peak TFLOPs number is between SXM and NVL"
    "h100": Hardware(
        "H100 96GB HBM2e 500 W (TorchTitan's Grand Teton)",
        (989 + 835) / 2 * _T,
        _MAMF,
        2.4 * 1e12,
        450 * _G,
        400 / 8 * _G * 8,
        8,
        1,
        (
            "peak 912 TFLOPS: midway between the H100 SXM's 989 and NVL's 835, as TorchTitan's benchmark page says "
            "its 500 W HBM2e H100s are; 2.4 TB/s HBM, 400 Gb/s RDMA per GPU (the same page); NVLink 4 450 GB/s "
            "each way (NVIDIA)",
            _MAMF_SOURCE,
            _ATTENTION_SOURCE,
        ),
        _ATTENTION,
    ),
    "h200": Hardware(
        "H200 SXM",
        989 * _T,
        _MAMF,
        4.8 * 1e12,
        450 * _G,
        3200 / 8 * _G,
        8,
        1,
        (
            "989 BF16 TFLOPS, 4.8 TB/s HBM3e, NVLink 4 450 GB/s each way (NVIDIA H200 SXM); EFA 3.2 Tbps per "
            "8-GPU node (p5en)",
            "matmul efficiency 80.1 %: the H100 SXM's (same compute die)",
            _ATTENTION_SOURCE,
        ),
        _ATTENTION,
    ),
}

#: operations that move no data: views, metadata, allocation without a write
_FREE = {
    "aten::detach",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::lift_fresh",
    "aten::_local_scalar_dense",
    "prim::device",
    "aten::sym_size",
    "aten::sym_stride",
    "aten::sym_numel",
    "aten::is_same_size",
    "aten::set_",
    "aten::resize_",
    "aten::_has_compatible_shallow_copy_type",
}
#: torch's CPU attention (what the stand-in runs) is missing from torch's flop registry
_CPU_ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"
_CPU_ATTENTION_BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Forward FLOPs of attention: Q K^T and P V over every query head (grouped-query heads repeat their key)."""
    *batch, heads, queries, depth = query.shape
    keys, value_depth = key.shape[-2], value.shape[-1]
    size = heads * math.prod(batch)
    return 2 * size * queries * keys * (depth + value_depth)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@dataclass
class OpCount:
    """The device operations of a measured step, filed for the model: matrix products and attention as
    `(flops, bytes) -> count` (executed FLOPs: causal attention at half), the other operations' bytes read and
    written (`memory_bytes`) and what the same operations move fused between matrix products (`fused_bytes`), the
    optimizer step's bytes, and the model FLOPs of the forward's matrix products (TorchTitan's convention: attention
    whole)."""

    matmuls: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    attention: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    memory_bytes: int = 0
    fused_bytes: int = 0
    optimizer_bytes: int = 0
    forward_flops: int = 0
    #: outputs of the memory-bound operations since the last matrix product, by storage: a fused kernel's own
    _chain: weakref.WeakValueDictionary[int, torch.Tensor] = field(
        default_factory=weakref.WeakValueDictionary, repr=False, compare=False
    )

    def add(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """File one operation the rank ran (its local tensors)."""
        from torch.utils.flop_counter import flop_registry

        if not isinstance(func, torch._ops.OpOverload):  # a higher-order operator: its operations come one by one
            return
        name = func._overloadpacket._qualified_op_name
        if name in _FREE or func.is_view:
            return
        kwargs = kwargs or {}
        packet = func._overloadpacket
        flops = executed = None
        if packet in flop_registry:
            flops = executed = int(flop_registry[packet](*args, **kwargs, out_val=out))
        elif name == _CPU_ATTENTION:
            flops = _attention_flops(*args[:3])
            causal = bool(args[4] if len(args) > 4 else kwargs.get("is_causal", False))
            executed = flops // 2 if causal else flops
        elif name == _CPU_ATTENTION_BACKWARD:
            flops = 2 * _attention_flops(*args[1:4])
            causal = bool(args[7] if len(args) > 7 else kwargs.get("is_causal", False))
            executed = flops // 2 if causal else flops
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        written = _nbytes(outputs)
        moved = _nbytes(inputs) + written
        if flops is not None and executed is not None:
            attention = name in (_CPU_ATTENTION, _CPU_ATTENTION_BACKWARD) or "attention" in name
            (self.attention if attention else self.matmuls)[(executed, moved)] += 1
            self._chain.clear()
            if torch._C._current_graph_task_id() == -1 and not _OPTIMIZER_STEP.active:
                self.forward_flops += flops
        elif _OPTIMIZER_STEP.active:
            self.optimizer_bytes += moved
        else:
            self.memory_bytes += moved
            self.fused_bytes += written + _nbytes([t for t in inputs if _storage(t) not in self._chain])
            for tensor in outputs:
                self._chain[_storage(tensor)] = tensor

    @property
    def model_flops(self) -> int:
        """FLOPs of the model per step (TorchTitan's MFU numerator: forward and backward, no recomputation)."""
        return 3 * self.forward_flops

    @staticmethod
    def total(counts: Iterable[OpCount]) -> OpCount:
        whole = OpCount()
        for count in counts:
            for key, number in count.matmuls.items():
                whole.matmuls[key] += number
            for key, number in count.attention.items():
                whole.attention[key] += number
            whole.memory_bytes += count.memory_bytes
            whole.fused_bytes += count.fused_bytes
            whole.optimizer_bytes += count.optimizer_bytes
            whole.forward_flops += count.forward_flops
        return whole


class _OptimizerStep:
    """Whether the rank is in its optimizer's step (`optimizer_step`): its operations are filed apart (elementwise
    over the parameters' shards, never fused into the blocks)."""

    active = False


_OPTIMIZER_STEP = _OptimizerStep()


@contextlib.contextmanager
def optimizer_step() -> Iterator[None]:
    """Around an optimizer's step in the simulation: its operations count as the optimizer's."""
    _OPTIMIZER_STEP.active = True
    try:
        yield
    finally:
        _OPTIMIZER_STEP.active = False


@dataclass
class Work:
    """What the time model needs of a simulated rank beyond its collectives: its operations, whether its blocks are
    compiled (`torch.compile` seen on a submodule) and the tokens it trains on per step (None: the batch has no
    token ids)."""

    ops: OpCount
    compiled: bool
    tokens_per_step: float | None


def ring_factor(kind: str, group_size: int) -> float:
    """Bytes a rank sends per byte of a collective's buffer in a ring of `group_size` ranks."""
    if group_size <= 1:
        return 0.0
    if "all_reduce" in kind or "allreduce" in kind:
        return 2 * (group_size - 1) / group_size
    if any(part in kind for part in ("gather", "scatter", "all_to_all", "alltoall")):
        return (group_size - 1) / group_size
    return 1.0  # broadcast, send/recv


def overlapped(kind: str) -> bool:
    """Whether a collective runs beside the computation: FSDP2's and DDP's (c10d ops issued from their hooks on
    their own streams), not DTensor's functional collectives (tensor and loss parallel wait for their input) nor
    pipeline transfers."""
    return kind.startswith("c10d.")


def seconds(value: float) -> str:
    """A duration for the report: milliseconds below a tenth of a second (small jobs), else seconds."""
    return f"{value * 1e3:.3f} ms" if value < 0.1 else f"{value:.3f} s"


@dataclass(frozen=True)
class StepTime:
    """The model's prediction for one optimizer step of one rank, seconds; `tokens_per_s_per_chip` when the tokens
    of a step are known."""

    hardware: Hardware
    matmul_s: float
    memory_s: float
    exposed_s: float
    overlapped_s: float
    bubble: float
    step_s: float
    mfu: float
    tokens_per_s_per_chip: float | None
    compiled: bool

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.memory_s

    def lines(self) -> list[str]:
        """The report's time rows and the constants' sources."""
        hw = self.hardware
        tokens = (
            f"{self.tokens_per_s_per_chip:,.0f} tokens/s per chip, " if self.tokens_per_s_per_chip is not None else ""
        )
        bubble = f", pipeline bubble {100 * self.bubble:.1f} %" if self.bubble else ""
        shown = max(0.0, self.overlapped_s - self.compute_s)
        lines = [
            f"step time (model, {hw.name}{', compiled blocks' if self.compiled else ''}): {seconds(self.step_s)}: "
            f"{tokens}MFU {100 * self.mfu:.1f} %",
            f"  compute {seconds(self.compute_s)} (matrix products {seconds(self.matmul_s)}, memory-bound "
            f"operations {seconds(self.memory_s)}); collectives on the critical path {seconds(self.exposed_s)}; "
            f"beside the compute {seconds(self.overlapped_s)} ({seconds(shown)} of it exposed){bubble}",
        ]
        return lines + [f"  constants: {source}" for source in hw.sources]


def collective_seconds(collectives: Sequence[Collective], hardware: Hardware) -> tuple[float, float]:
    """Seconds of `collectives` on `hardware` (module docstring's link rule): those on the critical path, and those
    beside the compute (`overlapped`)."""
    link = hardware.link_bytes_per_s / hardware.ranks_per_chip
    network = hardware.network_bytes_per_s / hardware.ranks_per_node
    exposed = beside = 0.0
    for collective in collectives:
        duration = collective.wire_within / link + collective.wire_across / network
        if overlapped(collective.op):
            beside += duration
        else:
            exposed += duration
    return exposed, beside


def predict(
    ops: OpCount,
    collectives: Sequence[Collective],
    hardware: Hardware,
    *,
    compiled: bool = False,
    bubble: float = 0.0,
    tokens_per_step: float | None = None,
) -> StepTime:
    """The step time of one rank whose step ran `ops` and `collectives` on `hardware` (module docstring's rules);
    `tokens_per_step`: the tokens this rank's data stream trains on per step, shared by the ranks that split one
    stream (tensor parallel, pipeline stages), for tokens/s per chip."""
    peak = hardware.peak_flops / hardware.ranks_per_chip
    hbm = hardware.hbm_bytes_per_s / hardware.ranks_per_chip
    matmul_s = sum(
        count * max(flops / (peak * efficiency), moved / hbm)
        for products, efficiency in (
            (ops.matmuls, hardware.matmul_efficiency),
            (ops.attention, hardware.attention_efficiency),
        )
        for (flops, moved), count in products.items()
    )
    memory_s = ((ops.fused_bytes if compiled else ops.memory_bytes) + ops.optimizer_bytes) / hbm
    exposed, beside = collective_seconds(collectives, hardware)
    compute = matmul_s + memory_s
    step = (compute + exposed) / (1 - bubble) + max(0.0, beside - compute)
    mfu = ops.model_flops / (step * peak) if step else 0.0
    per_chip = None
    if tokens_per_step is not None and step:
        per_chip = tokens_per_step * hardware.ranks_per_chip / step
    return StepTime(hardware, matmul_s, memory_s, exposed, beside, bubble, step, mfu, per_chip, compiled)
