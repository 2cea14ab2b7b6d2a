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

import faulthandler
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
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
    versions: dict[str, str] = field(default_factory=dict)

    def where(self) -> str:
        return f"rank {self.rank} (host {self.host}, {self.core})"

    def check(self, ok: bool, failure: str) -> None:
        if not ok:
            self.ok = False
            self.failures.append(failure)


@dataclass
class HealthReport:
    """The whole job's health: every rank's report, the versions (the same on every rank, checked), and this rank's
    collective figures."""

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
    """Where the ranks post their results: the process group's key-value store (None: a single process), served by
    rank 0 or the launcher (torchrun's agent), over host TCP."""

    def __init__(self, world_size: int, rank: int, run: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.hello: dict[int, RankReport] = {}
        self._store = None
        if world_size > 1:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = dist.PrefixStore(f"lightning_trn/healthcheck/{run}/", _get_default_store())

    def _keys(self, phase: str, ranks: Iterable[int]) -> list[str]:
        return [f"{phase}/{r}" for r in ranks]

    def name(self, ranks: Iterable[int]) -> str:
        return "; ".join(self.hello[r].where() if r in self.hello else f"rank {r}" for r in ranks)

    def post(self, phase: str, value: Any) -> None:
        if self._store is not None:
            with self._store_errors(phase):
                self._store.set(f"{phase}/{self.rank}", json.dumps(value))

    def missing(self, phase: str) -> list[int]:
        """Ranks that have not posted `phase` (one store round trip when all have)."""
        if self._store is None or self._store.check(self._keys(phase, range(self.world_size))):
            return []
        return [r for r in range(self.world_size) if not self._store.check(self._keys(phase, [r]))]

    @contextmanager
    def _store_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except HealthCheckError:
            raise
        except RuntimeError as err:  # torch's DistNetworkError / DistStoreError
            raise HealthCheckError(
                f"lightning_trn health check: rank {self.rank} lost the connection to the job's key-value store "
                f"during {what}: its server (rank 0, or the launcher's agent) exited or its host is unreachable "
                f"({err})."
            ) from err

    def collect(self, phase: str, timeout: float, what: str) -> list[Any]:
        """Every rank's post for `phase`; raises naming the ranks that did not post within `timeout` seconds."""
        if self._store is None:
            return []
        deadline = time.monotonic() + timeout
        everyone = self._keys(phase, range(self.world_size))
        with self._store_errors(what):
            while not self._store.check(everyone):
                if time.monotonic() >= deadline:
                    raise HealthCheckError(
                        f"lightning_trn health check: {self.name(self.missing(phase))} did not finish {what} within "
                        f"{timeout:g} s, while the other ranks of the {self.world_size} did. That process is hung or "
                        "has died: check its host's Neuron devices (`neuron-ls`, `neuron-top`), the driver's kernel "
                        "log (`dmesg | grep -i neuron`), and the network between the hosts, then restart the job "
                        "without that node."
                    )
                time.sleep(_POLL_S)
            values = self._store.multi_get(everyone)  # type: ignore[attr-defined]  # in torch, not in its stubs
            return [json.loads(value) for value in values]


@contextmanager
def _watchdog(seconds: float, what: str, board: _Board, phase: str) -> Iterator[None]:
    """End this process (exit code `EXIT_HUNG`) if the block has not returned after `seconds`: a device call that
    hangs cannot be interrupted, and a health check must never hang the job. Before the block every rank posts
    `<phase>-start`; the message names the ranks that never started (a peer that died leaves the others blocked in
    the collective) or, if all did, this rank. `faulthandler` ends the process 10 s later should the stuck call hold
    the GIL, which the timer's thread needs."""
    where = board.hello[board.rank].where() if board.rank in board.hello else f"rank {board.rank}"

    def fire() -> None:
        try:
            absent = board.missing(f"{phase}-start")
        except RuntimeError:  # the store is gone too
            absent = []
        blame = (
            f"{board.name(absent)} never started it, so the others wait for them"
            if absent
            else f"{where} is stuck in it; the device or its runtime is not answering: check `neuron-ls` / "
            "`neuron-top` and the kernel log on this host"
        )
        sys.stderr.write(
            f"lightning_trn health check: {what} did not finish within {seconds:g} s on {where}: "
            f"{blame}. Ending this process (exit code {EXIT_HUNG}).\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_HUNG)

    board.post(f"{phase}-start", True)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    with suppress(ValueError, RuntimeError, AttributeError, OSError):  # no usable stderr file descriptor: timer only
        faulthandler.dump_traceback_later(seconds + 10, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
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
        report.check(
            torch.equal(gathered[other], expected),
            f"all-gather: rank {other}'s slot held {gathered[other].tolist()}, expected {expected.tolist()}",
        )
    total = strategy.all_reduce(torch.full((8,), rank + 1.0, device=device), reduce_op="sum").cpu()
    expected_sum = world * (world + 1) / 2
    report.check(
        bool((total == expected_sum).all()),
        f"all-reduce (sum of rank+1): got {total.tolist()}, expected {expected_sum} everywhere",
    )

    payload = torch.ones(size_mb * 2**18, dtype=torch.float32, device=device)
    reduced = strategy.all_reduce(payload, reduce_op="sum")
    runtime.sync(wait=True)  # warm-up: compiles on XLA; each timed all-reduce below runs that graph once
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


def check_arguments(timeout: float, size_mb: int, iters: int = 1) -> None:
    """Raise `ValueError` unless timeout > 0, size_mb >= 1 and iters >= 1."""
    if timeout <= 0 or size_mb < 1 or iters < 1:
        raise ValueError(
            f"The health check needs timeout > 0, size_mb >= 1 and iters >= 1; got timeout={timeout}, "
            f"size_mb={size_mb}, iters={iters}."
        )


def _guarded(report: RankReport, what: str, check: Callable[[], Any]) -> Any:
    """`check()`; an exception it raises fails this rank's report (so the others learn it) instead of this process."""
    try:
        return check()
    except Exception as err:  # noqa: BLE001  (any device or runtime error is a failed check here)
        report.check(False, f"{what} raised {type(err).__name__}: {err}")
        return {}


def _check_versions(reports: Sequence[RankReport]) -> None:
    first = reports[0].versions
    differing = [
        (r, sorted(k for k in set(first) | set(r.versions) if first.get(k) != r.versions.get(k))) for r in reports[1:]
    ]
    differing = [(r, keys) for r, keys in differing if keys]
    if differing:
        details = "; ".join(
            f"{r.where()}: "
            + ", ".join(f"{k} {r.versions.get(k)} (rank {reports[0].rank}: {first.get(k)})" for k in keys)
            for r, keys in differing
        )
        raise HealthCheckError(
            f"lightning_trn health check: the ranks run different software: {details}. Mixed driver, runtime, "
            "compiler or torch versions give wrong results or hangs: install the same Neuron SDK release on every node."
        )


def run_health_check(
    strategy: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    size_mb: int = DEFAULT_SIZE_MB,
    iters: int = 5,
) -> HealthReport:
    """Run every check on every rank of `strategy` (a Neuron strategy of the Trainer or Fabric, set up), collectively.

    Returns the report (every rank's results; the collective figures as this rank measured them); raises
    `HealthCheckError` on every rank that can when a check failed, the versions differ, or a rank did not answer
    within `timeout` seconds.
    """
    check_arguments(timeout, size_mb, iters)
    runtime, device = strategy.runtime, strategy.root_device
    world, rank = strategy.world_size, strategy.global_rank
    board = _Board(world, rank, next(_runs))
    mine = RankReport(
        rank=rank, host=socket.gethostname(), core=runtime.core_label(device), versions=runtime.versions()
    )

    board.post("hello", asdict(mine))
    board.hello = {r: RankReport(**p) for r, p in enumerate(board.collect("hello", timeout, "starting the check"))}
    board.hello.setdefault(rank, mine)
    _check_versions(list(board.hello.values()))
    with _watchdog(2 * timeout, "the device op and host<->device copy", board, "device"):
        _guarded(mine, "device op", lambda: _device_op(mine, runtime, device))
        _guarded(mine, "host<->device copy", lambda: _copy_bandwidth(mine, runtime, device, size_mb))
    board.post("device", asdict(mine))
    reports = [RankReport(**p) for p in board.collect("device", timeout, "the device op")] or [mine]
    _fail(reports, "the device op")

    collectives: dict[str, float] = {}
    if world > 1:
        with _watchdog(2 * timeout, "the all-gather / all-reduce", board, "collectives"):
            collectives = _guarded(mine, "collectives", lambda: _collectives(mine, strategy, size_mb, iters))
        board.post("collectives", asdict(mine))
        reports = [RankReport(**p) for p in board.collect("collectives", timeout, "the collectives")]
        _fail(reports, "the collectives")
        # the last use of the store: rank 0 (which may serve it) returns only once every rank is done reading
        board.post("done", True)
        if rank == 0:
            board.collect("done", timeout, "the health check")
    return HealthReport(world_size=world, versions=mine.versions, ranks=reports, collectives=collectives)
