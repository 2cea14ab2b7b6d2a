"""Asynchronous sharded saves: training goes on while a torch.distributed.checkpoint (DCP) directory is written.

A save through `AsyncCheckpointer` blocks its caller only while the state is staged: every tensor of the state dict
copied to host memory by DCP's blocking stager, so that the steps that follow cannot change what is written. The
Trainer's and Fabric's sharded state dicts are host tensors already (Lightning's state-dict functions offload them,
`cpu_offload=True`), but some are the live ones (the optimizers' CPU step counters), which the next step would change
under a background write: so staging is a host-to-host copy, and pinned memory (which speeds copies from a device)
has nothing to speed up here.

DCP's `async_save` then plans and writes the files in a background thread, over a gloo group of its own (its
collectives never interleave with those of the training thread), and the commit that makes the staged directory the
checkpoint (`lightning_trn.core.checkpoint.sharded_save.staged_directory`'s `defer`; on rank 0) runs in a second
background thread once the write is done. DCP's coordinator writes `.metadata` only after every rank's files are written
and synced, so rank 0's write being done means every rank's is.

At most one save is in flight: a new save, `wait()`, and `close()` (the strategy's teardown: the end of `fit`, the
exception path a SIGTERM takes) wait for the previous one, on every rank together, and every rank raises when any
rank's write or rank 0's commit failed: a failure that only rank 0 sees (its commit) stops every rank with its error
instead of leaving the others waiting in the next save's barrier. The write group has the strategy's timeout. A process
killed during the background write leaves the previous checkpoint as it was: the commit never ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter, async_save
from torch.distributed.checkpoint.staging import BlockingAsyncStager

#: how a save hands its commit to the background writer, to run once the write is done, and what to run after it
#: in any case (`AsyncCheckpointer.defer`)
Deferral = Callable[[Callable[[], None], Callable[[], None]], None]


class WriteFailedError(RuntimeError):
    """An asynchronous save failed on some rank; raised on every rank."""


class AsyncCheckpointer:
    """Writes DCP directories in the background, one at a time (module docstring). Held by the strategy's
    checkpointer (`lightning_trn.core.checkpoint.checkpointer`) when `NeuronCheckpointIO(async_save=True)` asks for it;
    every rank of the job calls `save`, `defer` and `wait` in the same order.

    Args:
        timeout: of the write group's collectives (the strategy's process-group timeout).
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        #: whether a save was launched since the last `wait` (every rank alike): `wait` then exchanges outcomes
        self._unsettled = False
        #: the save in flight: its write, then its commit (None: nothing in flight)
        self._in_flight: Future | None = None
        #: the write of the latest `save`, until `defer` chains its commit
        self._write: Future | None = None
        #: gloo group for the background writes' collectives (made at the first save, on every rank together)
        self._group: Any | None = None
        self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_trn-checkpoint-commit")
        #: seconds the latest `save` blocked its caller (staging and launch), for benchmarks.async_save
        self.last_blocked_s = 0.0

    @property
    def in_flight(self) -> bool:
        """Whether a save's write or commit has not finished yet."""
        return self._in_flight is not None and not self._in_flight.done()

    def wait(self, exchange: bool = True) -> None:
        """Wait for the save in flight, if any, to be written and committed; raise if it failed. `exchange` (every rank
        together, where all ranks are known to call it: the next save, a load): raise on every rank if it failed on
        any."""
        pending, self._in_flight, self._write = self._in_flight, None, None
        error: BaseException | None = None
        if pending is not None:
            try:
                pending.result()
            except Exception as failure:  # noqa: BLE001  # any failure is exchanged below and raised on every rank
                error = failure
        unsettled, self._unsettled = self._unsettled, False
        if not (exchange and unsettled) or self._group is None:
            if error is not None:
                raise error
            return
        outcomes: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(
            outcomes, None if error is None else f"{type(error).__name__}: {error}", group=self._group
        )
        failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
        if failed:
            said = "; ".join(f"rank {rank}: {outcome}" for rank, outcome in failed)
            raise WriteFailedError(
                f"lightning_trn: an asynchronous checkpoint save failed ({said}); the previous checkpoint is unchanged."
            ) from error

    def save(self, state_dict: dict[str, Any], directory: str) -> None:
        """Stage `state_dict` (this rank's part of a sharded checkpoint) on the host and write it into `directory`
        in the background; `defer` then says what to run once it is written. Waits for the previous save first."""
        self.wait()
        start = time.perf_counter()
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        write = async_save(
            state_dict,
            storage_writer=FileSystemWriter(directory, sync_files=True),
            process_group=self._group,
            # staged here, in the caller: every tensor copied to host memory (see the module docstring)
            async_stager=BlockingAsyncStager(),
        )
        # a stager that stages in the caller gets the write's future (a background stager, a response with two)
        assert isinstance(write, Future)
        self._write = self._in_flight = write
        self._unsettled = True
        self.last_blocked_s = time.perf_counter() - start

    def defer(self, commit: Callable[[], None], cleanup: Callable[[], None]) -> None:
        """Run `commit` (what makes the written directory the checkpoint: a rename on local disk, a commit object on
        object storage) in the background once the latest `save`'s write is done, then `cleanup` (the writer's
        lease), also when the write or the commit failed."""
        write, self._write = self._write, None
        if write is None:
            cleanup()
            raise RuntimeError("lightning_trn: a commit was deferred with no asynchronous write to wait for.")
        self._in_flight = self._commits.submit(_after, write, commit, cleanup)

    def then(self, action: Callable[[], None]) -> None:
        """Run `action` once the save in flight is committed (now if none is): deleting an older checkpoint
        (`ModelCheckpoint`'s `save_top_k`) must not leave a kill during the write with neither the old checkpoint nor
        the new one."""
        if self._in_flight is None:
            action()
            return
        self._in_flight = self._commits.submit(_after, self._in_flight, action)

    def close(self) -> None:
        """Wait for the save in flight (teardown), this rank's alone: a teardown after an error on one rank must not
        wait for ranks that are elsewhere; each rank raises its own failure."""
        self.wait(exchange=False)


def _after(previous: Future, action: Callable[[], None], cleanup: Callable[[], None] | None = None) -> None:
    try:
        previous.result()  # a failed write raises here: nothing is committed or deleted, the previous checkpoint stays
        action()
    finally:
        if cleanup is not None:
            cleanup()
