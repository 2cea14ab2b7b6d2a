"""The random state a resumed run needs to continue exactly where the interrupted one was (docs/fault-tolerance.md).

Three sources of randomness decide what a training run does next:

- the host generators the data pipeline draws from: torch's CPU generator, numpy's and Python's `random` (random
  augmentation in a dataset, a `DataLoader`'s worker seeds, a `RandomSampler` without a generator of its own);
- the generators a training loader owns (`DataLoader(generator=...)`, `RandomSampler(generator=...)`), which decide
  the shuffling order;
- the device generator the step draws from (dropout, stochastic rounding).

The host and loader states are taken where the resumed run's training iteration starts again: at the start of the
interrupted epoch when it resumes mid-epoch (the skipped batches are then drawn again, on the host, exactly as
before), at the checkpoint otherwise. The device generator is re-seeded at every training batch from a base seed and
the batch's index (`step_seed`), so the step's random numbers depend on where it is in the run, not on how many graph
cuts happened before it (on XLA every cut advances the device seed).

Where it is stored: in a one-file checkpoint, every rank's entry under `RANDOM_STATE_KEY` (gathered to rank 0, which
writes the file); in a sharded checkpoint (a directory every rank writes part of), each rank's entry in its own file
`random-state-rank<r>.pt` beside the shards and a header under `RANDOM_STATE_KEY` (`RankFiles`), so that a rank
saving or resuming reads and writes its own entry only: O(1) bytes per rank whatever the world size.

Everything is stored as CPU tensors and plain Python values, so `torch.load(..., weights_only=True)` loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

#: top-level checkpoint key: {"version": 1, "ranks": [one entry per rank]}
RANDOM_STATE_KEY = "lightning_trn_random_state"
RANDOM_STATE_VERSION = 1
#: the format of a sharded checkpoint's header: each rank's entry in its own file
RANK_FILES_VERSION = 2


def rank_file_name(rank: int) -> str:
    """The file of rank `rank`'s random state in a sharded checkpoint."""
    return f"random-state-rank{rank}.pt"


@dataclass(frozen=True)
class RankFiles:
    """A sharded checkpoint's random-state header: how many ranks wrote a file; with this rank's entry once read."""

    world_size: int
    entry: dict[str, Any] | None = None

    def header(self) -> dict[str, Any]:
        return {"version": RANK_FILES_VERSION, "world_size": self.world_size}

    @classmethod
    def from_header(cls, saved: Any) -> RankFiles | None:
        if isinstance(saved, dict) and saved.get("version") == RANK_FILES_VERSION:
            return cls(int(saved["world_size"]))
        return None

    def with_entry(self, entry: dict[str, Any] | None) -> dict[str, Any]:
        """The header with this rank's entry (what `rank_entry` reads)."""
        return {**self.header(), "entry": entry}


_MASK_63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: consecutive steps get well-separated seeds


def host_states() -> dict[str, Any]:
    """The host generators' states, as Lightning collects them (torch's CPU generator, numpy's global one if numpy is
    installed, Python's), with numpy's key array as a tensor: `weights_only=True` does not load numpy arrays."""
    states = _collect_rng_states(include_cuda=False)
    if "numpy" in states:
        kind, keys, position, has_gauss, cached_gaussian = states["numpy"]
        states["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    return states


def set_host_states(states: dict[str, Any]) -> None:
    """Put back what `host_states` returned (with Lightning's `_set_rng_states`)."""
    states = dict(states)
    if "numpy" in states:
        saved = states["numpy"]
        states["numpy"] = (
            saved["kind"],
            saved["keys"].numpy().astype("uint32"),
            saved["position"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    _set_rng_states(states)


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The distinct `torch.Generator`s a DataLoader draws its order and worker seeds from, in a fixed order: its own,
    its sampler's, its batch sampler's and that one's sampler's (a `DataLoader(shuffle=True, generator=g)` hands `g`
    to its `RandomSampler`, so that is one generator)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    found: list[torch.Generator] = []
    for owner in owners:
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and not any(generator is g for g in found):
            found.append(generator)
    return found


def generator_states(generators: list[torch.Generator]) -> list[torch.Tensor]:
    return [generator.get_state() for generator in generators]


def set_generator_states(generators: list[torch.Generator], states: list[torch.Tensor]) -> bool:
    """Restore `states` into `generators`; False (nothing changed) when they do not pair up one to one."""
    if len(generators) != len(states):
        return False
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)
    return True


def step_seed(base: int, batch_index: int) -> int:
    """The device seed of training batch `batch_index` (counted over the whole run) of a run seeded with `base`."""
    return (base + (batch_index + 1) * _GOLDEN) & _MASK_63


def base_device_seed(global_seed: str | None) -> int:
    """The run's base device seed: `seed_everything`'s (`PL_GLOBAL_SEED`), else the CPU generator's initial seed."""
    return int(global_seed) if global_seed is not None else torch.initial_seed()


def rank_entry(saved: Any, rank: int, world_size: int) -> tuple[dict[str, Any] | None, str]:
    """This rank's entry of a checkpoint's `RANDOM_STATE_KEY` value, or None with the reason it cannot be used."""
    if saved is None:
        return None, (
            "the checkpoint holds no lightning_trn random state (it was written by Lightning on a CPU or GPU, or by "
            "an older lightning_trn)"
        )
    files = RankFiles.from_header(saved)
    if files is not None:
        if files.world_size != world_size:
            return None, f"the checkpoint was written by {files.world_size} process(es) and this run has {world_size}"
        if saved.get("entry") is None:
            return None, f"the checkpoint has no {rank_file_name(rank)}"
        return saved["entry"], ""
    if not isinstance(saved, dict) or saved.get("version") != RANDOM_STATE_VERSION:
        return None, "the checkpoint's lightning_trn random state has a format this version does not read"
    ranks = saved.get("ranks") or []
    if len(ranks) != world_size:
        return None, f"the checkpoint was written by {len(ranks)} process(es) and this run has {world_size}"
    return ranks[rank], ""


def not_exact_notice(reason: str) -> str:
    """The one line a resume without usable random state logs."""
    return (
        f"lightning_trn: this resume is not exact: {reason}. The data order and the random ops (dropout, "
        "augmentation) continue from freshly seeded generators, so the run will not end exactly where an "
        "uninterrupted one would (docs/fault-tolerance.md)."
    )
