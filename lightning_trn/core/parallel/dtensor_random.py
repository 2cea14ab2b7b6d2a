"""Random ops on DTensors on the `neuron` device: one rule for `nn.init.*`, `normal_`, `uniform_`, `trunc_normal_`,
`rand*`, `bernoulli` and dropout, so that a model initialised after parallelization (`init_weights()` in
`on_train_start`, as Lightning's tensor-parallel example and TorchTitan's models do) gets independent values on every
shard.

torch runs every random op on a DTensor inside `torch.distributed.tensor._random._rng_tracker._distribute_region`
(the op then draws the local shard from the device's default generator). Its default tracker,
`OffsetBasedRNGTracker`, reads the generator's state as a CUDA Philox (seed, offset) pair and moves the offset to
give each shard its own part of one stream. The `neuron` generators cannot serve that: the stand-in's state is a CPU
MT19937 one (torch's tracker fails an assertion on it) and TorchNeuron's ignores the offset in its random ops (every
shard would silently draw the same numbers).

The rule here (`NeuronRNGTracker`, in place of torch's tracker during Neuron runs): for one random op, let `key` be
the state of the generator the op draws from (the device's, or a `generator=` the user passed) before the op. Each
rank draws its shard from the device generator seeded with `digest(key, shard index)`, where the shard index is
torch's own linear index of the shard the rank holds (`Replicate` and `Partial` mesh dimensions do not count);
afterwards the generator is seeded with `digest(key)` on every rank. So:

- ranks holding the same shard (replicas) draw the same values, different shards independent ones;
- every rank's generator moves in step, as long as all were seeded alike (DTensor's own contract; Lightning's
  `seed_everything` seeds them alike), and the next op draws new values;
- the same seed gives the same values run after run, whatever the device's random kernels do with an offset.

As with torch's tracker on GPUs, the values depend on the mesh: a dp 2 x tp 2 run does not draw what one process
draws. The alternative, drawing every tensor at full size from a generator seeded alike on every rank and keeping the
local slice (what `core.parallel.model_parallel.materialize` does for meta-device init), would be mesh-independent, but
would draw and hold the whole tensor on every rank for every op: for an 8 B model's embedding 2 GB per rank, and for
dropout on sequence-parallel activations the full activation's mask on every rank at every step. Drawing only the
shard costs nothing beyond the op itself (one hash of the generator state, on the host).

Meshes on other devices keep torch's behaviour: the tracker that was in place before (if any) serves them, else the
op runs as torch runs it without a tracker (the CPU: each rank draws from its own generator).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from packaging.version import Version
from torch import nn

#: torch versions whose DTensor random-op dispatch (`_random._rng_tracker`, `_distribute_region(spec, generator)`,
#: `_calc_shard_info`) this was written and tested against
TESTED_TORCH = (Version("2.13.0"), Version("2.15.0"))


def supported() -> bool:
    """Whether the installed torch routes DTensor random ops the way `NeuronRNGTracker` expects."""
    if not TESTED_TORCH[0] <= Version(Version(torch.__version__).base_version) < TESTED_TORCH[1]:
        return False
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import _random

    return all(
        hasattr(_random, name)
        for name in ("_rng_tracker", "_RNGStateTracker", "_calc_shard_info", "_calc_shard_linear_idx")
    )


def _digest(*parts: bytes) -> int:
    """A seed (below 2**63) that depends on every byte of `parts`."""
    return int.from_bytes(hashlib.blake2b(b"\0".join(parts), digest_size=8).digest(), "little") >> 1


def shard_index(spec: Any) -> int:
    """The linear index of the shard of a DTensor (its `_spec`) this rank holds: torch's own, the same on replicas."""
    from torch.distributed.tensor import _random

    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    # torch 2.13's helpers (`supported()` checks them); mypy runs on torch 2.9, which lacks them
    info = _random._calc_shard_info  # type: ignore[attr-defined]  # torch 2.13 only
    linear_index = _random._calc_shard_linear_idx  # type: ignore[attr-defined]  # torch 2.13 only
    shard_by_dim, shards_by_dim = info(coordinate, spec)
    return int(linear_index(shard_by_dim, shards_by_dim))


def _tracker_base() -> type:
    """torch's private tracker base, looked up only when a tracker is made (after `supported()`), so that importing
    lightning_trn never depends on it."""
    from torch.distributed.tensor import _random

    return _random._RNGStateTracker


def neuron_rng_tracker(device_type: str, previous: Any | None) -> Any:
    """A `NeuronRNGTracker` for `device_type` meshes; `previous`, the tracker in place before, serves the others."""

    class NeuronRNGTracker(_tracker_base()):  # type: ignore[misc]  # torch's private base, found at run time
        """torch's `_RNGStateTracker` interface with the rule of `lightning_trn.core.parallel.dtensor_random`."""

        def __init__(self) -> None:
            super().__init__(torch.device(device_type))
            self.previous = previous

        @contextlib.contextmanager
        def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
            if spec.mesh.device_type != device_type:
                region = (
                    self.previous._distribute_region(spec, generator)
                    if self.previous is not None
                    else contextlib.nullcontext()
                )
                with region:
                    yield
                return
            if not self.distribute_region_enabled:
                yield
                return
            handle = self._device_handle
            index = handle.current_device()
            state = generator.get_state() if generator is not None else handle.get_rng_state(index)
            key = state.cpu().contiguous().numpy().tobytes()
            with torch.random.fork_rng(devices=[index], device_type=device_type):
                handle.manual_seed(_digest(key, str(shard_index(spec)).encode()))
                yield
            # the op's draws are undone with the fork: every rank moves its generator to the same next state
            (generator if generator is not None else handle).manual_seed(_digest(key))

    return NeuronRNGTracker()


def tracker_for_neuron_run(previous: Any | None) -> Any | None:
    """The registry's hook (`lightning_trn.hooks.registry`): the tracker for a run on the native backend's device, or
    None (nothing replaced) on the XLA backend, which has no DTensors, or a torch this was not tested against."""
    from lightning_trn.runtime import get_runtime

    runtime = get_runtime()
    if not runtime.shards_models or not supported():
        return None
    return neuron_rng_tracker(runtime.device_type, previous)


def _refuse_local_dropout(module: nn.Module, args: tuple) -> None:
    from torch.distributed.tensor import DTensor

    if module.training and args and not isinstance(args[0], DTensor):
        raise RuntimeError(
            f"{type(module).__name__}(p={module.p}) runs on a plain (local) tensor in a tensor-parallel model "
            "on `neuron`. Every tensor-parallel rank has the same device seed, so on a sharded local tensor (the "
            "attention heads or MLP columns of one rank) every rank would draw the same mask, and a dp x tp run "
            "would not train as one process does; lightning_trn cannot tell a local shard from a replicated "
            "activation, so it refuses rather than train differently. Either set the dropout to 0 (Lightning's "
            "tensor-parallel example and TorchTitan's models have none), or apply it to DTensors (e.g. keep "
            "`use_local_output=False` in the parallel styles, or use `SequenceParallel`): each shard of a DTensor "
            "draws its own mask (docs/sharding.md, 'Random ops on DTensors')."
        )


def refuse_local_dropout(module: nn.Module, strategy: Any) -> None:
    """Under tensor parallelism, make each dropout module of `module` with `p > 0` refuse (one paragraph, at its
    first training call) a plain-tensor input: its mask would repeat on every tensor-parallel rank. DTensor inputs
    pass (the rule above gives each shard its own mask). Functional `F.dropout` calls are not seen."""
    from lightning_trn.core.parallel.fsdp import FSDPSharding

    # an FSDP strategy (it holds its sharding) has no tensor parallelism, though its hybrid mesh calls the shard
    # dimension "tensor_parallel"
    if isinstance(getattr(strategy, "_fsdp", None), FSDPSharding):
        return
    if strategy.device_mesh["tensor_parallel"].size() <= 1:
        return
    for submodule in module.modules():
        if isinstance(submodule, nn.modules.dropout._DropoutNd) and submodule.p > 0:
            submodule.register_forward_pre_hook(_refuse_local_dropout)
