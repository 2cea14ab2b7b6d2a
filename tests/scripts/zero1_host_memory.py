"""Worker script for tests/strategies/test_zero1.py's host-memory test: one rank of ZeRO-1 checkpoint saves and loads
on host tensors (a gloo group of `WORLD_SIZE` processes), printing each phase's host peak as a JSON line.

The model is three fp32 parameters of `--numel` elements in all (sizes that need padding); the sharded optimizer is
Adam whose moments are a known function of the element index, so every load is checked element by element. A phase
starts from a fresh model and optimizer; its figure is the peak resident set during the phase (`VmHWM`, what
`ru_maxrss` reports, reset through `/proc/self/clear_refs` when the phase starts) less the resident set before the
optimizer was sharded. The script fixes glibc's mmap and trim thresholds first (`mallopt`, what
`MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536` do at a process's start), so freed tensors go back to the
system at once and the phases do not inherit each other's heap; set at run time, the ranks can start from the test
suite's warm interpreter (tests/warm_python.py), which a variable read at start-up would rule out.

All phases run twice: first on a model of `BASELINE_NUMEL` elements (`"model": "baseline"`: the fixed overhead, e.g.
the first use of the gather and of `torch.save`), then on one of `--numel` (`"model": "measured"`). Phases, in
order: `save-full` (`optimizer_state(optimizer)`, gathered to rank 0, which writes `<out>/full-<N>.ckpt`, as the
strategies do for `state_dict_type="full"`), `save-sharded` (each rank writes its chunks to
`<out>/sharded-<N>/zero1-rank<r>.pt`, rank 0 the rest to its `checkpoint.pt`, as `_split_checkpoint` does), then
`load:<path>` for these two and each `--load` path: `NeuronCheckpointIO.reading_shard` of this rank, then
`optimizer.load_state_dict`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO, atomic_local_save
from lightning_trn.core.parallel.zero1 import (
    SHARDED_MAIN_FILE,
    Zero1Sharding,
    chunk_file,
    optimizer_state,
    split_chunks,
)
from lightning_trn.runtime.host_collectives import HostCollectives

#: parameter sizes as fractions of --numel (odd sizes: padded at 2 and 4 ranks)
FRACTIONS = (0.5, 0.3, 0.2)
#: how much of its chunks a rank sends to rank 0 at a time in a full save
BUCKET_BYTES = 2 * 1024 * 1024
BASELINE_NUMEL = 30_000
STEP = 3.0
#: glibc's `mallopt` parameters, and the threshold in bytes above which an allocation is its own mapping
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 65536


def fix_malloc_thresholds() -> None:
    """Allocations over 64 KiB get mappings of their own, unmapped at `free`, and the heap's free top is trimmed past
    64 KiB: a freed tensor leaves the resident set at once."""
    libc = ctypes.CDLL("libc.so.6")
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, MMAP_THRESHOLD)):
        raise RuntimeError("mallopt refused the thresholds")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def expected_moments(index: int, start: int, stop: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's moments of elements [start, stop) of parameter `index` (zero past its end, as padding keeps them)."""
    element = torch.arange(start, stop, dtype=torch.float32)
    inside = element < numel
    exp_avg = torch.sin(element * 0.001 + index) * inside
    return exp_avg, exp_avg.square() + 0.5 * inside


class Rank:
    def __init__(self, numel: int, model: str) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.sizes = [int(numel * fraction) | 1 for fraction in FRACTIONS]
        self.model = model
        self.collectives = HostCollectives(self.world_size)

    def phase(
        self, name: str, state_dict_type: str, filled: bool, work: Callable[[torch.optim.Optimizer], None]
    ) -> None:
        """Run `work` on a freshly sharded Adam (its moments `filled` or empty) and print this rank's figures."""
        params = [torch.nn.Parameter(torch.zeros(size)) for size in self.sizes]
        optimizer = torch.optim.Adam(params, lr=1e-3)
        gc.collect()
        before = _status_kb("VmRSS")
        Zero1Sharding(
            optimizer,
            self.collectives,
            self.collectives,
            self.rank,
            torch.Tensor.to,
            state_dict_type,
            gather_bucket_bytes=BUCKET_BYTES,
        )
        if filled:
            for index, shard in enumerate(self._shards(optimizer)):
                exp_avg, exp_avg_sq = self._moments(index, shard)
                optimizer.state[shard] = {"step": torch.tensor(STEP), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")
        work(optimizer)
        gc.collect()
        peak = _status_kb("VmHWM")
        record = {
            "model": self.model,
            "phase": name,
            "rank": self.rank,
            "world_size": self.world_size,
            "sizes": self.sizes,
            "peak_kb": peak - before,
            "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "mismatches": 0 if filled else self._mismatches(optimizer),
        }
        print("HOST_MEMORY " + json.dumps(record), flush=True)
        dist.barrier()

    @staticmethod
    def _shards(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def _moments(self, index: int, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.rank * shard.numel()
        return expected_moments(index, start, start + shard.numel(), self.sizes[index])

    def _mismatches(self, optimizer: torch.optim.Optimizer) -> int:
        """State entries that differ from what the saving ranks held (the loaded chunks are this rank's)."""
        wrong = 0
        for index, shard in enumerate(self._shards(optimizer)):
            state = optimizer.state[shard]
            exp_avg, exp_avg_sq = self._moments(index, shard)
            wrong += int(not torch.equal(state["exp_avg"], exp_avg))
            wrong += int(not torch.equal(state["exp_avg_sq"], exp_avg_sq))
            wrong += int(float(state["step"]) != STEP)
        return wrong


def run_phases(me: Rank, out: Path, more: list[str]) -> None:
    full = out / f"full-{me.world_size}.ckpt"
    sharded = out / f"sharded-{me.world_size}"

    def save_full(optimizer: torch.optim.Optimizer) -> None:
        checkpoint = {"optimizer_states": [optimizer_state(optimizer)]}
        if me.rank == 0:
            NeuronCheckpointIO().save_checkpoint(checkpoint, full)

    def save_sharded(optimizer: torch.optim.Optimizer) -> None:
        checkpoint, chunks = split_chunks({"optimizer_states": [optimizer_state(optimizer)]})
        atomic_local_save({"chunks": chunks}, sharded / chunk_file(me.rank))
        if me.rank == 0:
            NeuronCheckpointIO().save_checkpoint(checkpoint, sharded / SHARDED_MAIN_FILE)

    def load(path: str) -> Callable[[torch.optim.Optimizer], None]:
        def work(optimizer: torch.optim.Optimizer) -> None:
            io = NeuronCheckpointIO()
            with io.reading_shard(me.rank, me.world_size):
                checkpoint = io.load_checkpoint(path)
            optimizer.load_state_dict(checkpoint["optimizer_states"][0])

        return work

    me.phase("save-full", "full", True, save_full)
    me.phase("save-sharded", "sharded", True, save_sharded)
    for path in [str(full), str(sharded), *more]:
        me.phase(f"load:{Path(path).name}", "full", False, load(path))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory of this world size's checkpoints")
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--load", nargs="*", default=[], help="more checkpoints to load (other world sizes)")
    args = parser.parse_args()
    fix_malloc_thresholds()
    # the imports' objects are never garbage: each phase's `gc.collect()` then walks only what the phases made
    gc.freeze()
    dist.init_process_group("gloo")
    run_phases(Rank(BASELINE_NUMEL, "baseline"), Path(args.out) / "baseline", [])
    run_phases(Rank(args.numel, "measured"), Path(args.out), args.load)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
