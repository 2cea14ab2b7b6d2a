"""ZeRO-1: the optimizer state sharded over the data-parallel ranks, for the Trainer's and Fabric's `NeuronDDPStrategy`.

Every parameter is flattened, padded to a multiple of the world size N and cut into N equal chunks; rank r's optimizer
holds one fp32 Parameter per module parameter, its chunk r, so its state (Adam's moments) is 1/N of the unsharded one.
A step: the gradients are reduce-scattered (each rank receives the average of its chunks), clipped with the norm over
all shards, the optimizer updates the chunks, and the parameters are all-gathered back in their own dtype (bf16
parameters are rounded from the fp32 chunks, stochastically where bf16-true rounds in software). The collectives are
the runtime's (`lightning_trn.runtime.collectives`): `xm` ops inside the step's graph on Neuron, gloo on XLA:CPU, the
`neuron` process group natively.

The optimizer stays the user's object: its param groups (and so LR schedulers) keep their hyperparameters, only
`params` hold the chunks; `state_dict()` returns the full state in the unsharded optimizer's format (CPU tensors,
gathered over the host group, so every rank must call it, as checkpointing does) and `load_state_dict()` takes that
format from any world size, plain DDP or one device. bf16 parameters add their fp32 masters to it
(`MASTER_WEIGHT`), so a resume is exact. Only optimizers that update each element on its own are sharded
(`REFUSED`).

Sharded checkpoints (`state_dict_type="sharded"`) skip the gather: `state_dict()` then holds this rank's chunks as
`{CHUNK: tensor, ...}` markers; the strategy writes them to `<checkpoint dir>/zero1-rank<r>.pt` on every rank and
the rest to `<checkpoint dir>/checkpoint.pt` (`split_chunks`). Loading (`NeuronCheckpointIO`, or
`python -m lightning_trn.consolidate`) puts the full tensors back from all ranks' files (`consolidate`), so a sharded
checkpoint resumes on any world size too.
"""

from __future__ import annotations

import math
import weakref
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_trn.runtime.collectives import Collectives, buckets

#: per-parameter key of the optimizer state that carries the fp32 master weight of a bf16 parameter
MASTER_WEIGHT = "zero1_master_weight"
#: optimizers whose update of an element depends on other elements of the tensor (or that re-evaluate a closure)
REFUSED = ("LBFGS", "Adafactor", "SparseAdam", "Muon")

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


def sharding_of(optimizer: Optimizer) -> Optional[Zero1Sharding]:
    """The ZeRO-1 sharding of `optimizer`, or None if it is not sharded."""
    return _SHARDINGS.get(optimizer)


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


def consolidate(checkpoint: dict[str, Any], directory: str, load: Callable[[str], Any]) -> dict[str, Any]:
    """`checkpoint` (a sharded directory's main file) with each marker replaced by the full tensor, concatenated from
    every rank's chunk file in `directory` (read with `load`, once each)."""
    files: dict[int, list[Tensor]] = {}

    def chunks_of(rank: int) -> list[Tensor]:
        if rank not in files:
            files[rank] = load(os.path.join(directory, chunk_file(rank)))["chunks"]
        return files[rank]

    def full(marker: dict) -> Tensor:
        rows = [chunks_of(rank)[marker[CHUNK]] for rank in range(marker["world_size"])]
        return torch.cat(rows)[: marker["numel"]].view(marker["shape"]).clone()

    return _map_markers(checkpoint, full)


def _padded_flat(tensor: Tensor, numel: int) -> Tensor:
    flat = tensor.reshape(-1)
    return flat if flat.numel() == numel else torch.nn.functional.pad(flat, (0, numel - flat.numel()))


def _chunk_of(full: Tensor, chunk: int, rank: int, world_size: int) -> Tensor:
    """Rank `rank`'s chunk (of `chunk` elements) of `full`, flattened and padded to `chunk * world_size`."""
    return _padded_flat(full, chunk * world_size)[rank * chunk : (rank + 1) * chunk]


@dataclass
class _Slot:
    """A module parameter and this rank's chunk of it, the Parameter the optimizer updates."""

    param: Tensor
    shard: Parameter
    chunk: int

    def chunk_of(self, full: Tensor, rank: int, world_size: int) -> Tensor:
        """Rank `rank`'s chunk of `full` (a tensor of the parameter's shape), flattened."""
        return _chunk_of(full, self.chunk, rank, world_size)

    def unshard(self, rows: Tensor) -> Tensor:
        """The parameter-shaped tensor from every rank's chunk (`rows`: `[world_size, chunk]`)."""
        return rows.reshape(-1)[: self.param.numel()].view(self.param.shape)


class Zero1Sharding:
    """Shards `optimizer` in place over `world_size` ranks (see the module docstring).

    Args:
        collectives: the runtime's collectives over all ranks (gradients and parameters stay on the device).
        host_collectives: collectives on host tensors, for `state_dict()` (the full state never sits on the device).
        rounding: casts an fp32 chunk to its parameter's dtype.
        state_dict_type: "full": `state_dict()` gathers the state (the unsharded format); "sharded": it holds this
            rank's chunks as markers, for a sharded checkpoint.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        collectives: Collectives,
        host_collectives: Collectives,
        rank: int,
        rounding: Rounding,
        state_dict_type: str = "full",
    ) -> None:
        name = type(optimizer).__name__
        if name in REFUSED:
            raise ValueError(
                f"ZeRO-1 cannot shard {name}: it updates an element from other elements of the tensor (or re-runs a "
                "closure), so an update of one chunk would differ from the unsharded one. Use an element-wise "
                "optimizer (SGD, Adam, AdamW, ...) or `zero1=False`."
            )
        if optimizer in _SHARDINGS:
            raise ValueError(f"This {name} is already sharded with ZeRO-1 (set up once per optimizer).")
        self.optimizer = optimizer
        self.collectives = collectives
        self.host_collectives = host_collectives
        self.world_size = collectives.world_size
        self.rank = rank
        self.state_dict_type = state_dict_type
        self._rounding = rounding
        self._slots: list[_Slot] = []
        #: fp32 masters of bf16 parameters from the last `load_state_dict`, by slot index (applied by `refresh`)
        self._loaded_masters: dict[int, Tensor] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                shards = []
                for param in group["params"]:
                    chunk = max(1, math.ceil(param.numel() / self.world_size))
                    mine = _chunk_of(param.detach(), chunk, rank, self.world_size).to(torch.float32, copy=True)
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
        optimizer.register_state_dict_post_hook(self._state_dict_post_hook)
        optimizer.register_load_state_dict_pre_hook(self._load_state_dict_pre_hook)
        _SHARDINGS[optimizer] = self

    # -- the step ----------------------------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Reduce-scatter the module parameters' gradients into the chunks' (`.grad`, fp32), bucketed; the module
        parameters' gradients are then dropped (the optimizer's `zero_grad` only clears the chunks')."""
        slots = [slot for slot in self._slots if slot.param.grad is not None]
        with torch.no_grad():
            for bucket in buckets(slots, tensor=lambda slot: slot.param.grad):
                width = self.world_size
                rows = torch.cat([_padded_flat(s.param.grad, s.chunk * width).view(width, s.chunk) for s in bucket], 1)
                for slot in bucket:  # copied into `rows`: free them before the collective allocates its result
                    slot.param.grad = None
                mine = self.collectives.reduce_scatter(rows)
                del rows
                for slot, grad in zip(bucket, mine.split([s.chunk for s in bucket])):
                    slot.shard.grad = grad.float()

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
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
                for slot, rows in zip(bucket, every.split([s.chunk for s in bucket], dim=1)):
                    slot.param.copy_(slot.unshard(rows))

    def refresh(self) -> None:
        """Set the chunks from the module parameters (and from loaded fp32 masters): after a checkpoint restored the
        module's weights."""
        with torch.no_grad():
            for index, slot in enumerate(self._slots):
                source = self._loaded_masters.get(index)
                full = slot.param.detach() if source is None else source.to(slot.shard.device)
                slot.shard.copy_(slot.chunk_of(full, self.rank, self.world_size).float())

    # -- state dicts -------------------------------------------------------------------------------------------------

    def _is_chunk(self, slot: _Slot, key: str, value: Any) -> bool:
        return isinstance(value, Tensor) and key != "step" and value.shape == slot.shard.shape

    def _state_dict_post_hook(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Post-hook of `optimizer.state_dict()`: every chunked state tensor gathered into its parameter's shape, on
        the host, or (sharded) left as this rank's chunk in a marker; bf16 parameters also give their fp32 master."""
        pieces: list[tuple[int, str, Tensor]] = []
        for index, slot in enumerate(self._slots):
            state = state_dict["state"].get(index, {})
            pieces += [(index, key, value) for key, value in state.items() if self._is_chunk(slot, key, value)]
            if slot.param.dtype != torch.float32:
                pieces.append((index, MASTER_WEIGHT, slot.shard.detach()))
        full_state = {index: dict(state) for index, state in state_dict["state"].items()}
        if self.state_dict_type == "sharded":
            for index, key, value in pieces:
                slot = self._slots[index]
                marker = {CHUNK: value.detach(), "numel": slot.param.numel(), "shape": list(slot.param.shape),
                          "world_size": self.world_size}
                full_state.setdefault(index, {})[key] = marker
            return {**state_dict, "state": full_state}
        if self.world_size == 1:
            gathered = [value.detach().cpu() for _, _, value in pieces]
            full = [self._slots[index].unshard(value.view(1, -1)) for (index, _, _), value in zip(pieces, gathered)]
        else:
            full = self._gather_on_host(pieces)
        for (index, key, _), value in zip(pieces, full):
            full_state.setdefault(index, {})[key] = value
        return {**state_dict, "state": full_state}

    def _gather_on_host(self, pieces: list[tuple[int, str, Tensor]]) -> list[Tensor]:
        values: list[Tensor] = [value.detach().cpu() for _, _, value in pieces]
        full: list[Tensor] = [torch.empty(0)] * len(pieces)
        order = list(range(len(pieces)))
        for bucket in buckets(order, tensor=lambda i: values[i]):
            every = self.host_collectives.all_gather(torch.cat([values[i] for i in bucket]))
            for i, rows in zip(bucket, every.split([values[i].numel() for i in bucket], dim=1)):
                full[i] = self._slots[pieces[i][0]].unshard(rows).clone()
        return full

    def _load_state_dict_pre_hook(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Pre-hook of `optimizer.load_state_dict()`: a full state (from any world size) cut to this rank's chunks;
        masters are kept for `refresh`, which runs now (the Trainer restores the weights before the optimizer)."""
        state = {int(index): dict(value) for index, value in state_dict["state"].items()}
        self._loaded_masters = {
            index: value.pop(MASTER_WEIGHT).float() for index, value in state.items() if MASTER_WEIGHT in value
        }
        self._load_chunks(state)
        self.refresh()
        return {**state_dict, "state": state}

    def _load_chunks(self, state: dict[int, dict[str, Any]]) -> None:
        """In `state` (slot index -> per-parameter state), replace each parameter-shaped tensor by this rank's chunk."""
        for index, values in state.items():
            slot = self._slots[index]
            for key, value in values.items():
                if isinstance(value, Tensor) and key != "step" and value.shape == slot.param.shape:
                    chunk = slot.chunk_of(value, self.rank, self.world_size)
                    values[key] = chunk.to(torch.float32, copy=True) if chunk.is_floating_point() else chunk.clone()
