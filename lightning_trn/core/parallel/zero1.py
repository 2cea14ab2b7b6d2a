"""ZeRO-1: the optimizer state sharded over the data-parallel ranks, for the Trainer's and Fabric's `NeuronDDPStrategy`.

Every parameter is flattened, padded to a multiple of the world size N and cut into N equal chunks; rank r's optimizer
holds one fp32 Parameter per module parameter, its chunk r, so its state (Adam's moments) is 1/N of the unsharded one.
A step: the gradients are reduce-scattered in fp32 whatever the parameters' dtype (`REDUCE_DTYPE`: a 64-way bf16 sum
loses about 2 significant bits), each rank receiving the average of its chunks; they are clipped with the norm over
all shards, the optimizer updates the chunks, and the parameters are all-gathered back in their own dtype (bf16
parameters are rounded from the fp32 chunks, stochastically where bf16-true rounds in software). The collectives are
the runtime's (`lightning_trn.runtime.collectives`): `xm` ops inside the step's graph on Neuron, gloo on XLA:CPU, the
`neuron` process group natively.

The optimizer stays the user's object: its param groups (and so LR schedulers) keep their hyperparameters, only
`params` hold the chunks, and its own `state_dict()` is this rank's chunks, with no collective. A checkpoint's state
comes from `optimizer_state(optimizer)` (the strategies' `optimizer_state` / `get_optimizer_state`, as Lightning's
strategies consolidate torch's `ZeroRedundancyOptimizer`): the full state in the unsharded optimizer's format (CPU
tensors) on rank 0, gathered to it bucket by bucket over the host group (a collective: every rank calls it, as
checkpointing does; the other ranks only send their chunks and get a stub without them, `GATHERED_ON`: only rank 0
writes a one-file checkpoint). `optimizer.load_state_dict()` takes that format from any world size, plain DDP or one
device. bf16 parameters add their fp32
masters to it (`MASTER_WEIGHT`), so a resume is exact. Only optimizers known to update each element on its own are
sharded (`ELEMENTWISE`; others opt in with `allow_zero1_optimizer`).

Sharded checkpoints (`state_dict_type="sharded"`) skip the gather: `optimizer_state` then holds this rank's chunks as
`{CHUNK: tensor, ...}` markers; the strategy writes them to `<checkpoint dir>/zero1-rank<r>.pt` on every rank and
the rest to `<checkpoint dir>/checkpoint.pt` (`split_chunks`). Loading (`NeuronCheckpointIO`, or
`python -m lightning_trn.consolidate`) resolves the markers from memory-mapped chunk files (`consolidate`): a ZeRO-1
rank gets only its own chunk (at the saved world size read from its own file alone, at another one sliced from the
files that hold it), anything else the full tensors, so a sharded checkpoint resumes on any world size too.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_trn.runtime.collectives import BUCKET_BYTES, Collectives, buckets
from lightning_trn.runtime.host_collectives import HostCollectives

#: per-parameter key of the optimizer state that carries the fp32 master weight of a bf16 parameter
MASTER_WEIGHT = "zero1_master_weight"
#: optimizers whose update of an element depends only on that element's gradient and state (Lion: lion-pytorch's
#: class, matched by name); any other is refused unless registered with `allow_zero1_optimizer`
ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)
ELEMENTWISE_NAMES = ("Lion",)
#: optimizer classes registered by `allow_zero1_optimizer`
_ALLOWED: set[type] = set()
#: the dtype gradients are reduce-scattered in (TorchTitan's `reduce_dtype`)
REDUCE_DTYPE = torch.float32
#: key of the stub that `state_dict()` returns on ranks other than the one a full state was gathered to
GATHERED_ON = "zero1_state_gathered_on_rank"

#: a sharded state dict's placeholder of one chunked tensor: {CHUNK: the chunk (index into the rank's file once
#: split), "numel": the parameter's element count, "shape": its shape, "world_size": how many chunks there are}
CHUNK = "zero1_chunk"
#: the file of a sharded checkpoint directory with everything but the chunks (written by rank 0)
SHARDED_MAIN_FILE = "checkpoint.pt"
STATE_DICT_TYPES = ("full", "sharded")

#: the `Zero1Sharding` of each sharded optimizer
_SHARDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: how a strategy turns an fp32 chunk into a parameter's dtype (`NeuronPrecisionCore.round_parameter`)
Rounding = Callable[[Tensor, torch.dtype], Tensor]


def allow_zero1_optimizer(optimizer_class: type[Optimizer]) -> None:
    """Let ZeRO-1 shard optimizers of exactly this class (not its subclasses), which `ELEMENTWISE` does not list.

    Only for optimizers whose update of each element reads nothing but that element's gradient and state: ZeRO-1 runs
    the optimizer on 1/N of each tensor, so per-tensor norms or shapes (LAMB, LARS, Adam-mini, Shampoo, Adafactor,
    Muon) would silently be those of the chunk.
    """
    _ALLOWED.add(optimizer_class)


def _is_elementwise(optimizer: Optimizer) -> bool:
    cls = type(optimizer)
    return cls in ELEMENTWISE or cls in _ALLOWED or cls.__name__ in ELEMENTWISE_NAMES


def sharding_of(optimizer: Optimizer) -> Zero1Sharding | None:
    """The ZeRO-1 sharding of `optimizer`, or None if it is not sharded."""
    return _SHARDINGS.get(optimizer)


def optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """What a checkpoint holds of `optimizer`: a ZeRO-1 optimizer's state gathered (`Zero1Sharding.state_dict`, a
    collective every rank calls), any other's `state_dict()`."""
    sharding = sharding_of(optimizer)
    return optimizer.state_dict() if sharding is None else sharding.state_dict()


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the tensors in `optimizer.state` on this rank (what ZeRO-1 divides by the world size; of a DTensor,
    this rank's shard)."""
    return sum(local_bytes(value) for state in optimizer.state.values() for value in state.values())


def local_bytes(value: Any) -> int:
    """Bytes `value` takes on this rank: a tensor's, a DTensor's local shard's; 0 for anything else."""
    if not isinstance(value, Tensor):
        return 0
    local = value.to_local() if hasattr(value, "to_local") else value
    return local.numel() * local.element_size()


def chunk_file(rank: int) -> str:
    """The file of a sharded checkpoint directory that holds rank `rank`'s chunks."""
    return f"zero1-rank{rank}.pt"


def _map_markers(obj: Any, function: Callable[[dict], Any]) -> Any:
    """`obj` with every chunk marker (a dict with `CHUNK`) replaced by `function(marker)`, containers copied."""
    if isinstance(obj, dict):
        return function(obj) if CHUNK in obj else {key: _map_markers(value, function) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_markers(value, function) for value in obj)
    return obj


def split_chunks(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[Tensor]]:
    """`checkpoint` with each marker's chunk replaced by its index in the returned list (this rank's file)."""
    chunks: list[Tensor] = []

    def take(marker: dict) -> dict:
        chunks.append(marker[CHUNK])
        return {**marker, CHUNK: len(chunks) - 1}

    return _map_markers(checkpoint, take), chunks


def _chunk_width(numel: int, world_size: int) -> int:
    """Elements per chunk of a tensor of `numel` elements cut over `world_size` ranks (at least 1)."""
    return max(1, math.ceil(numel / world_size))


def consolidate(
    checkpoint: dict[str, Any], directory: str, load: Callable[[str], Any], shard: tuple[int, int] | None = None
) -> dict[str, Any]:
    """`checkpoint` (a sharded directory's main file) with each marker resolved from the rank files in `directory`.

    `shard=None`: by the full tensor. `shard=(rank, world_size)`, for a ZeRO-1 optimizer of that rank: by a marker
    holding only that rank's chunk for `world_size` (plus `"rank"`), which `load_state_dict` takes as it is. `load`
    should memory-map (`torch.load(mmap=True)`): only the slices taken are then read, and a file is opened only when
    it holds part of one, once; at the saved world size a rank reads its own file alone.
    """
    files: dict[int, list[Tensor]] = {}

    def chunks_of(rank: int) -> list[Tensor]:
        if rank not in files:
            files[rank] = load(os.path.join(directory, chunk_file(rank)))["chunks"]
        return files[rank]

    def elements(marker: dict, start: int, size: int) -> Tensor:
        """A new tensor of `size` elements: elements [start, start + size) of the marker's flattened tensor, read
        from the files that hold them, zero past its end."""
        width = _chunk_width(marker["numel"], marker["world_size"])
        stop = min(start + size, marker["numel"])
        out: Tensor | None = None
        last = marker["world_size"] - 1  # at least one file is read, for the dtype
        for rank in range(min(start // width, last), min(max(stop - 1, start) // width, last) + 1):
            part = chunks_of(rank)[marker[CHUNK]][max(start - rank * width, 0) : max(stop - rank * width, 0)]
            if out is None:
                out = torch.zeros(size, dtype=part.dtype)
            offset = max(rank * width - start, 0)
            out[offset : offset + part.numel()] = part
        assert out is not None
        return out

    def full(marker: dict) -> Tensor:
        return elements(marker, 0, marker["numel"]).view(marker["shape"])

    if shard is None:
        return _map_markers(checkpoint, full)
    rank, world_size = shard

    def local(marker: dict) -> dict:
        width = _chunk_width(marker["numel"], world_size)
        mine = elements(marker, min(rank * width, marker["numel"]), width)
        return {**marker, CHUNK: mine, "world_size": world_size, "rank": rank}

    return _map_markers(checkpoint, local)


def _padded_flat(tensor: Tensor, numel: int) -> Tensor:
    flat = tensor.reshape(-1)
    return flat if flat.numel() == numel else torch.nn.functional.pad(flat, (0, numel - flat.numel()))


def _copy_chunk(full: Tensor, chunk: int, rank: int, out: Tensor) -> Tensor:
    """Rank `rank`'s chunk of `full` (elements [rank * chunk, (rank + 1) * chunk) of it flattened, zero past its end)
    copied into `out` (`chunk` elements) without a padded copy, so a memory-mapped `full` is read only there; returns
    `out`."""
    flat = full.reshape(-1)
    mine = flat[min(rank * chunk, flat.numel()) :][:chunk]
    out[: mine.numel()].copy_(mine)
    out[mine.numel() :].zero_()
    return out


@dataclass
class _Slot:
    """A module parameter and this rank's chunk of it, the Parameter the optimizer updates."""

    param: Tensor
    shard: Parameter
    chunk: int

    def unshard(self, rows: Tensor) -> Tensor:
        """The parameter-shaped tensor from every rank's chunk (`rows`: `[world_size, chunk]`)."""
        return rows.reshape(-1)[: self.param.numel()].view(self.param.shape)

    def param_grad(self) -> Tensor:
        """The module parameter's gradient, for slots known to have one."""
        assert self.param.grad is not None
        return self.param.grad


class Zero1Sharding:
    """Shards `optimizer` in place over `world_size` ranks (see the module docstring).

    Args:
        collectives: the runtime's collectives over all ranks (gradients and parameters stay on the device).
        host_collectives: collectives on host tensors, for `state_dict()` (the full state never sits on the device).
        rounding: casts an fp32 chunk to its parameter's dtype.
        state_dict_type: "full": `state_dict()` gathers the state to rank 0 (the unsharded format); "sharded": it
            holds this rank's chunks as markers, for a sharded checkpoint.
        gather_bucket_bytes: how much of its chunks a rank sends to rank 0 at a time in a full `state_dict()`: what
            the other ranks hold beyond their chunks while it runs (rank 0 receives N such pieces at a time).

    Raises:
        ValueError: for an optimizer not known to be element-wise (`ELEMENTWISE`, `allow_zero1_optimizer`).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        collectives: Collectives,
        host_collectives: HostCollectives,
        rank: int,
        rounding: Rounding,
        state_dict_type: str = "full",
        gather_bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        name = type(optimizer).__name__
        if not _is_elementwise(optimizer):
            known = ", ".join([cls.__name__ for cls in ELEMENTWISE] + list(ELEMENTWISE_NAMES))
            raise ValueError(
                f"ZeRO-1 does not shard {type(optimizer).__module__}.{name}: it only shards optimizers known to update "
                f"every element from that element's gradient and state alone ({known}). ZeRO-1 runs the optimizer on "
                "1/N of each tensor, so an optimizer that reads per-tensor norms or shapes (LAMB, LARS, Adam-mini, "
                "Shampoo, Adafactor, Muon, LBFGS's closure) would silently compute them over a chunk and train "
                "differently. If this optimizer is element-wise, opt in before the strategy sets it up with "
                f"`lightning_trn.core.parallel.zero1.allow_zero1_optimizer({name})`; otherwise use `zero1=False` "
                "(strategy='neuron_ddp')."
            )
        if optimizer in _SHARDINGS:
            raise ValueError(f"This {name} is already sharded with ZeRO-1 (set up once per optimizer).")
        self.optimizer = optimizer
        self.collectives = collectives
        self.host_collectives = host_collectives
        self.world_size = collectives.world_size
        self.rank = rank
        self.state_dict_type = state_dict_type
        self.gather_bucket_bytes = gather_bucket_bytes
        self._rounding = rounding
        self._slots: list[_Slot] = []
        #: this rank's chunks of the fp32 masters of bf16 parameters from the last `load_state_dict`, by slot index
        #: (applied by `refresh`)
        self._loaded_masters: dict[int, Tensor] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                shards = []
                for param in group["params"]:
                    chunk = _chunk_width(param.numel(), self.world_size)
                    mine = _copy_chunk(param.detach(), chunk, rank, param.new_empty(chunk, dtype=torch.float32))
                    slot = _Slot(param, Parameter(mine), chunk)
                    self._slots.append(slot)
                    shards.append(slot.shard)
                group["params"] = shards
        state = dict(optimizer.state)
        optimizer.state.clear()
        if state:  # an optimizer that already stepped: keep its state, sharded
            by_param = {id(slot.param): index for index, slot in enumerate(self._slots)}
            full = {by_param[id(param)]: dict(value) for param, value in state.items() if id(param) in by_param}
            self._load_chunks(full)
            for index, value in full.items():
                optimizer.state[self._slots[index].shard] = value
        optimizer.register_load_state_dict_pre_hook(self._load_state_dict_pre_hook)
        _SHARDINGS[optimizer] = self

    # -- the step ----------------------------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Reduce-scatter the module parameters' gradients into the chunks' (`.grad`), bucketed, in `REDUCE_DTYPE`
        whatever the parameters' dtype; the module parameters' gradients are then dropped (the optimizer's `zero_grad`
        only clears the chunks')."""
        slots = [slot for slot in self._slots if slot.param.grad is not None]
        with torch.no_grad():
            for bucket in buckets(slots, tensor=_Slot.param_grad):
                width = self.world_size
                padded = [_padded_flat(s.param_grad(), s.chunk * width).view(width, s.chunk) for s in bucket]
                rows = torch.cat(padded, 1)
                del padded
                for slot in bucket:  # copied into `rows`: free them before the collective allocates its result
                    slot.param.grad = None
                rows = rows.to(REDUCE_DTYPE)
                mine = self.collectives.reduce_scatter(rows)
                del rows
                for slot, grad in zip(bucket, mine.split([s.chunk for s in bucket]), strict=True):
                    slot.shard.grad = grad

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole model: the norm of all ranks' chunks, each rank scaling its
        own. Returns the total norm."""
        grads = [slot.shard.grad for slot in self._slots if slot.shard.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norm_type = float(norm_type)
        if math.isinf(norm_type):
            local = torch.stack([grad.abs().max() for grad in grads]).max()
            total = self.collectives.all_reduce(local, "max")
        else:
            local = torch.stack([grad.abs().pow(norm_type).sum() for grad in grads]).sum()
            total = self.collectives.all_reduce(local, "sum").pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for grad in grads:
                grad.mul_(scale)
        return total

    def gather_parameters(self) -> None:
        """All-gather the updated chunks into the module parameters (after `optimizer.step()`), bucketed."""
        self._loaded_masters.clear()
        with torch.no_grad():
            for bucket in buckets(self._slots, tensor=lambda slot: slot.param):
                mine = torch.cat([self._rounding(slot.shard.detach(), slot.param.dtype) for slot in bucket])
                every = self.collectives.all_gather(mine)
                for slot, rows in zip(bucket, every.split([s.chunk for s in bucket], dim=1), strict=True):
                    slot.param.copy_(slot.unshard(rows))

    def refresh(self) -> None:
        """Set the chunks from the module parameters (and from loaded fp32 masters): after a checkpoint restored the
        module's weights."""
        with torch.no_grad():
            for index, slot in enumerate(self._slots):
                master = self._loaded_masters.get(index)
                if master is None:
                    _copy_chunk(slot.param.detach(), slot.chunk, self.rank, slot.shard)
                else:
                    slot.shard.copy_(master.to(slot.shard.device))

    # -- state dicts -------------------------------------------------------------------------------------------------

    def _is_chunk(self, slot: _Slot, key: str, value: Any) -> bool:
        return isinstance(value, Tensor) and key != "step" and value.shape == slot.shard.shape

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state for a checkpoint, in the unsharded optimizer's format: every chunked state tensor
        gathered into its parameter's shape on rank 0's host (a collective over the host group: every rank calls it;
        the others get a stub without them), or (sharded) left as this rank's chunk in a marker; bf16 parameters also
        give their fp32 master."""
        state_dict = self.optimizer.state_dict()
        pieces: list[tuple[int, str, Tensor]] = []
        for index, slot in enumerate(self._slots):
            state = state_dict["state"].get(index, {})
            pieces += [(index, key, value.detach()) for key, value in state.items() if self._is_chunk(slot, key, value)]
            if slot.param.dtype != torch.float32:
                pieces.append((index, MASTER_WEIGHT, slot.shard.detach()))
        full_state = {index: dict(state) for index, state in state_dict["state"].items()}
        if self.state_dict_type == "sharded":
            for index, key, value in pieces:
                slot = self._slots[index]
                marker = {
                    CHUNK: value,
                    "numel": slot.param.numel(),
                    "shape": list(slot.param.shape),
                    "world_size": self.world_size,
                }
                full_state.setdefault(index, {})[key] = marker
            return {**state_dict, "state": full_state}
        full = self._gather_to_rank0(pieces)
        if full is None:
            for index, key, _ in pieces:
                full_state.get(index, {}).pop(key, None)
            return {**state_dict, "state": full_state, GATHERED_ON: 0}
        for (index, key, _), value in zip(pieces, full, strict=True):
            full_state.setdefault(index, {})[key] = value
        return {**state_dict, "state": full_state}

    def _gather_to_rank0(self, pieces: list[tuple[int, str, Tensor]]) -> list[Tensor] | None:
        """The parameter-shaped host tensors of `pieces` (this rank's chunks) on rank 0, None on the others.

        Sent in buckets of at most `gather_bucket_bytes` (a chunk larger than that in several slices); a chunk is
        copied to the host whole (one transfer, no per-slice device graph) when its first slice is sent and dropped
        after its last, so a rank holds one bucket and one chunk beyond its state. Rank 0 writes each bucket into the
        full tensors as it arrives.
        """
        if self.world_size == 1:
            return [self._slots[index].unshard(value.cpu().view(1, -1)).clone() for index, _, value in pieces]
        slices = []  # (piece, start, stop) of at most gather_bucket_bytes each
        for number, (_, _, value) in enumerate(pieces):
            step = max(1, self.gather_bucket_bytes // value.element_size())
            slices += [(number, start, min(start + step, value.numel())) for start in range(0, value.numel(), step)]
        host: dict[int, Tensor] = {}  # the chunk being sent

        def host_slice(number: int, start: int, stop: int) -> Tensor:
            if number not in host:
                host.clear()
                host[number] = pieces[number][2].cpu()
            return host[number][start:stop]

        def size(piece_slice: tuple[int, int, int]) -> Tensor:  # for `buckets`: dtype and bytes, no data
            number, start, stop = piece_slice
            return torch.empty(stop - start, dtype=pieces[number][2].dtype, device="meta")

        rows: dict[int, Tensor] = {}  # rank 0's `[world_size, chunk]` of each piece, filled as buckets arrive
        for bucket in buckets(slices, self.gather_bucket_bytes, tensor=size):
            every = self.host_collectives.gather(torch.cat([host_slice(*piece_slice) for piece_slice in bucket]), dst=0)
            if every is None:
                continue
            widths = [stop - start for _, start, stop in bucket]
            for (number, start, stop), received in zip(bucket, every.split(widths, dim=1), strict=True):
                if number not in rows:
                    value = pieces[number][2]
                    rows[number] = torch.empty((self.world_size, value.numel()), dtype=value.dtype)
                rows[number][:, start:stop] = received
        if self.rank != 0:
            return None
        return [self._slots[index].unshard(rows[number]) for number, (index, _, _) in enumerate(pieces)]

    def _load_state_dict_pre_hook(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Pre-hook of `optimizer.load_state_dict()`: a full state (from any world size) cut to this rank's chunks, or
        the chunks a sharded load resolved for this rank (`consolidate`) taken as they are; masters are kept for
        `refresh`, which runs now (the Trainer restores the weights before the optimizer)."""
        if GATHERED_ON in state_dict:
            raise ValueError(
                f"This ZeRO-1 optimizer state is the stub of a rank other than {state_dict[GATHERED_ON]}, which holds "
                "the full state: load the checkpoint that rank wrote."
            )
        state = {int(index): dict(value) for index, value in state_dict["state"].items()}
        self._loaded_masters = {
            index: self._own_chunk(index, value.pop(MASTER_WEIGHT)).float()
            for index, value in state.items()
            if MASTER_WEIGHT in value
        }
        self._load_chunks(state)
        self.refresh()
        return {**state_dict, "state": state}

    def _own_chunk(self, index: int, value: Any) -> Any:
        """This rank's chunk (a copy, floats in fp32) of `value`, a tensor of slot `index`'s parameter's shape or a
        resolved marker; anything else (step counts, scalars) as it is."""
        slot = self._slots[index]
        if isinstance(value, dict) and CHUNK in value:
            if (value.get("rank"), value["world_size"], value["numel"]) != (
                self.rank,
                self.world_size,
                slot.param.numel(),
            ):
                raise ValueError(
                    f"A sharded ZeRO-1 state resolved for rank {value.get('rank')} of {value['world_size']} (a tensor "
                    f"of {value['numel']} elements) reached rank {self.rank} of {self.world_size}: load it through "
                    "the strategy's checkpoint IO, or consolidate it first (`python -m lightning_trn.consolidate`)."
                )
            chunk = value[CHUNK]  # a new tensor (`consolidate`): no copy needed
            return chunk.to(torch.float32) if chunk.is_floating_point() else chunk
        if isinstance(value, Tensor) and value.shape == slot.param.shape:
            dtype = torch.float32 if value.is_floating_point() else value.dtype
            return _copy_chunk(value, slot.chunk, self.rank, torch.empty(slot.chunk, dtype=dtype, device=value.device))
        return value

    def _load_chunks(self, state: dict[int, dict[str, Any]]) -> None:
        """In `state` (slot index -> per-parameter state), replace each parameter-shaped tensor or resolved marker by
        this rank's chunk, and copy the other tensors (step counts): nothing keeps a memory-mapped file alive."""
        for index, values in state.items():
            for key, value in values.items():
                if key != "step":
                    values[key] = self._own_chunk(index, value)
                elif isinstance(value, Tensor):
                    values[key] = value.clone()
