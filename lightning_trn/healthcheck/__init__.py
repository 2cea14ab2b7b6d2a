"""Health check before training: the checks `python -m lightning_trn.healthcheck` and `NeuronHealthCheck` run.

Every rank runs a device op with a known result and a host<->device copy, then all ranks run an all-gather and an
all-reduce with known results and a timed all-reduce (bus bandwidth), through the same collectives training uses.
Ranks report to each other through the process group's key-value store (host TCP, not the device), so a rank that
returns a wrong result is named with its host and core, and one that stops answering is named after `timeout`
seconds instead of hanging the job. A rank stuck inside a device call cannot be interrupted: a watchdog ends that
process after twice the timeout (exit code 3), once the others have named it.

Runs the same checks on NeuronCores, XLA:CPU and the native stand-in (there the collectives are host collectives).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

#: exit code of a process whose own device call did not return in time (the others exit 1, naming it)
EXIT_HUNG = 3
#: seconds a rank waits for the others at each phase, by default
DEFAULT_TIMEOUT_S = 120.0
#: MiB moved by the host<->device copy and by each timed all-reduce, by default
DEFAULT_SIZE_MB = 64
_POLL_S = 0.05
_runs = itertools.count()  # every rank runs the checks in the same order: the n-th run's keys are its own


class HealthCheckError(RuntimeError):
    """A check failed or a rank did not answer in time; the message names rank, host and core."""


@dataclass
class RankReport:
    """One rank's results: where it runs and what it measured."""

    rank: int
    host: str
    core: str
    ok: bool = True
    failures: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)

    def where(self) -> str:
        return f"rank {self.rank} (host {self.host}, {self.core})"

    def check(self, ok: bool, failure: str) -> None:
        if not ok:
            self.ok = False
            self.failures.append(failure)


@dataclass
class HealthReport:
    """The whole job's health: every rank's report, the runtime's versions, and the collective figures."""

    world_size: int
    versions: dict[str, str]
    ranks: list[RankReport]
    collectives: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        """The lines `python -m lightning_trn.healthcheck` prints."""
        lines = [f"lightning_trn health check: {self.world_size} process(es), all checks passed."]
        lines += [f"  {name}: {version}" for name, version in self.versions.items()]
        for report in self.ranks:
            figures = ", ".join(f"{k} {v:.3g}" for k, v in report.figures.items())
            lines.append(f"  {report.where()}: device op ok; {figures}")
        if self.collectives:
            lines.append("  collectives: " + ", ".join(f"{k} {v:.3g}" for k, v in self.collectives.items()))
        else:
            lines.append("  collectives: skipped (1 process)")
        return "\n".join(lines)


class _Board:
    """Where the ranks post their results: the process group's key-value store (None: a single process)."""

    def __init__(self, world_size: int, rank: int, run: int) -> None:
        self.world_size, self.rank = world_size, rank
        self._store = None
        if world_size > 1:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = dist.PrefixStore(f"lightning_trn/healthcheck/{run}/", _get_default_store())

    def post(self, phase: str, value: Any) -> None:
        if self._store is not None:
            self._store.set(f"{phase}/{self.rank}", json.dumps(value))

    def missing(self, phase: str) -> list[int]:
        if self._store is None:
            return []
        return [r for r in range(self.world_size) if not self._store.check([f"{phase}/{r}"])]

    def collect(self, phase: str, timeout: float, hello: dict[int, RankReport], what: str) -> list[Any]:
        """Every rank's post for `phase`; raises naming the ranks that did not post within `timeout` seconds."""
        if self._store is None:
            return []
        deadline = time.monotonic() + timeout
        try:
            while (missing := self.missing(phase)) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            posts = [] if missing else [json.loads(self._store.get(f"{phase}/{r}")) for r in range(self.world_size)]
        except RuntimeError as err:  # torch's DistNetworkError
            raise HealthCheckError(
                f"lightning_trn health check: rank {self.rank} lost the connection to the job's key-value store "
                f"during {what}: {hello[0].where() if 0 in hello else 'rank 0'}, which serves it, exited or its host "
                f"is unreachable ({err})."
            ) from err
        if missing:
            names = "; ".join(hello[r].where() if r in hello else f"rank {r}" for r in missing)
            raise HealthCheckError(
                f"lightning_trn health check: {names} did not finish {what} within {timeout:g} s, while the other "
                f"ranks of the {self.world_size} did. That process is hung or has died: check its host's Neuron "
                "devices (`neuron-ls`, `neuron-top`), the driver's kernel log (`dmesg | grep -i neuron`), and the "
                "network between the hosts, then restart the job without that node."
            )
        return posts


@contextmanager
def _watchdog(seconds: float, what: str, where: str) -> Iterator[None]:
    """End this process (exit code `EXIT_HUNG`) if the block has not returned after `seconds`: a device call that
    hangs cannot be interrupted, and a health check must never hang the job."""

    def fire() -> None:
        sys.stderr.write(
            f"lightning_trn health check: {where} is stuck in {what} after {seconds:g} s; ending this process (exit "
            f"code {EXIT_HUNG}). The device or its runtime is not answering: check `neuron-ls` / `neuron-top` and "
            "the kernel log on this host.\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_HUNG)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _timed(runtime: Any, fn: Any) -> tuple[Any, float]:
    """`fn()` and the seconds it took, the device finished."""
    start = time.perf_counter()
    result = fn()
    runtime.sync(wait=True)
    return result, time.perf_counter() - start


def _device_op(report: RankReport, runtime: Any, device: torch.device) -> None:
    """A matmul and a reduction with an exact known result (small integers: exact in float32)."""
    host = (torch.arange(64 * 64, dtype=torch.float32) % 7).reshape(64, 64)
    expected = float((host.double() @ host.double().T + 1).sum())
    x = host.to(device)
    value, seconds = _timed(runtime, lambda: float((x @ x.T + 1).sum().cpu()))
    report.check(value == expected, f"device op: (x @ x.T + 1).sum() returned {value}, expected {expected}")
    report.figures["device op ms (first, incl. compile)"] = seconds * 1e3


def _copy_bandwidth(report: RankReport, runtime: Any, device: torch.device, size_mb: int) -> None:
    """Host->device and device->host copies of `size_mb` MiB: bandwidth, and that the data came back unchanged."""
    host = torch.arange(size_mb * 2**18, dtype=torch.float32)
    on_device, up = _timed(runtime, lambda: host.to(device))
    back, down = _timed(runtime, lambda: on_device.cpu())
    report.check(torch.equal(back, host), f"host<->device copy of {size_mb} MiB came back changed")
    report.figures["host->device GB/s"] = host.nbytes / up / 1e9
    report.figures["device->host GB/s"] = host.nbytes / down / 1e9


def _collectives(report: RankReport, strategy: Any, size_mb: int, iters: int) -> dict[str, float]:
    """All-gather and all-reduce with known results; a timed all-reduce of `size_mb` MiB (bus bandwidth as
    nccl-tests reports it: algorithm bandwidth x 2(n-1)/n)."""
    runtime, device, world, rank = strategy.runtime, strategy.root_device, strategy.world_size, strategy.global_rank
    mine = torch.tensor([rank, rank * rank + 1], dtype=torch.float32)
    gathered = strategy.all_gather(mine.to(device)).cpu()
    for other in range(world):
        expected = torch.tensor([other, other * other + 1], dtype=torch.float32)
        report.check(torch.equal(gathered[other], expected),
                     f"all-gather: rank {other}'s slot held {gathered[other].tolist()}, expected {expected.tolist()}")
    total = strategy.all_reduce(torch.full((8,), rank + 1.0, device=device), reduce_op="sum").cpu()
    expected_sum = world * (world + 1) / 2
    report.check(bool((total == expected_sum).all()),
                 f"all-reduce (sum of rank+1): got {total.tolist()}, expected {expected_sum} everywhere")

    payload = torch.ones(size_mb * 2**18, dtype=torch.float32, device=device)
    strategy.all_reduce(payload, reduce_op="sum")
    runtime.sync(wait=True)  # warm-up: compiles on XLA
    start = time.perf_counter()
    for _ in range(iters):
        reduced = strategy.all_reduce(payload, reduce_op="sum")
    runtime.sync(wait=True)
    seconds = (time.perf_counter() - start) / iters
    low, high = float(reduced.min().cpu()), float(reduced.max().cpu())
    report.check(low == high == world, f"all-reduce of {size_mb} MiB: values from {low} to {high}, expected {world}")
    algorithm = payload.nbytes / seconds / 1e9
    return {"all-reduce ms": seconds * 1e3, "all-reduce bus GB/s": algorithm * 2 * (world - 1) / world}


def _fail(reports: Sequence[RankReport], what: str) -> None:
    failed = [r for r in reports if not r.ok]
    if failed:
        details = "; ".join(f"{r.where()}: {', '.join(r.failures)}" for r in failed)
        raise HealthCheckError(
            f"lightning_trn health check failed {what} on {len(failed)} of {len(reports)} rank(s): {details}. Do not "
            "train on this node: a wrong result here means wrong gradients later. Check the named host's devices "
            "(`neuron-ls`, `neuron-top`, `dmesg | grep -i neuron`), then restart the job without it."
        )


def run_health_check(
    strategy: Any, timeout: float = DEFAULT_TIMEOUT_S, size_mb: int = DEFAULT_SIZE_MB, iters: int = 5,
) -> HealthReport:
    """Run every check on every rank of `strategy` (a Neuron strategy of the Trainer or Fabric, set up), collectively.

    Returns the same report on every rank; raises `HealthCheckError` on every rank when a check failed or a rank did
    not answer within `timeout` seconds.
    """
    runtime, device = strategy.runtime, strategy.root_device
    world, rank = strategy.world_size, strategy.global_rank
    board = _Board(world, rank, next(_runs))
    mine = RankReport(rank=rank, host=socket.gethostname(), core=runtime.core_label(device))

    board.post("hello", asdict(mine))
    hello = {r: RankReport(**p) for r, p in enumerate(board.collect("hello", timeout, {}, "starting the health check"))}
    with _watchdog(2 * timeout, "the device op and host<->device copy", mine.where()):
        _device_op(mine, runtime, device)
        _copy_bandwidth(mine, runtime, device, size_mb)
    board.post("device", asdict(mine))
    reports = [RankReport(**p) for p in board.collect("device", timeout, hello, "the device op")] or [mine]
    _fail(reports, "the device op")

    collectives: dict[str, float] = {}
    if world > 1:
        with _watchdog(2 * timeout, "the all-gather / all-reduce", mine.where()):
            collectives = _collectives(mine, strategy, size_mb, iters)
        board.post("collectives", asdict(mine))
        reports = [RankReport(**p) for p in board.collect("collectives", timeout, hello, "the collectives")]
        _fail(reports, "the collectives")
    return HealthReport(world_size=world, versions=runtime.versions(), ranks=reports, collectives=collectives)
