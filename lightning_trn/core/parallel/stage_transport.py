"""How pipeline stages hand activations and gradients to each other on a backend without point-to-point.

`torch.distributed.pipelining` moves tensors between stages with `isend`/`irecv` (`batch_isend_irecv`,
`send_object_list` for the shapes, `send`/`recv` for its warm-up vote) on the pipeline group it is given. TorchNeuron's
`neuron` process group has no `send`/`recv` in the source snapshot we have, and its docs do not say whether its
pipeline support has them (the stand-in refuses them as that snapshot does). Its broadcast is documented, so here a
send from rank `a` to rank `b` is a broadcast from `a` in a 2-rank group of `(a, b)`, and the matching receive is the
same broadcast on `b`.

The order that makes this correct is the one NCCL's point-to-point already imposes and torch's schedules keep: the
sends from `a` to `b` are received by `b` in the order they were sent. Each ordered pair `(a, b)` has a group of its
own and a worker thread that runs that pair's broadcasts one after another; different pairs (and the two directions
of one pair) run at the same time, as NCCL's sends and receives do. Without the threads a backend whose collectives
finish before they return (the stand-in) would deadlock as soon as two neighbours both send first (1F1B's steady
state: a forward send one way, a gradient send the other).

`TRANSPORTS` names the choices: "broadcast" (this module) or "send_recv" (the backend's own point-to-point, once a
backend is known to have it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # missing from torch's stubs
from typing_extensions import override

#: the backend name the pipeline groups of the broadcast transport are created with
BACKEND = "neuron_pipeline"
#: how stages exchange tensors: each send/recv as a broadcast in a 2-rank group, or the backend's own send/recv
TRANSPORTS = ("broadcast", "send_recv")


class _Pair:
    """One ordered pair of ranks: its 2-rank group and the thread that runs its broadcasts in issue order."""

    def __init__(self, group: dist.ProcessGroup, source: int) -> None:
        self.group = group
        self.source = source  # the sender's global rank
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_trn-stage-transport")

    def transfer(self, tensor: torch.Tensor) -> dist.Work:
        """Broadcast `tensor` from the pair's sender (the send on one side, the receive on the other)."""
        future: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                with torch.no_grad():  # a received activation is a leaf its stage's autograd starts from
                    dist.broadcast(tensor, src=self.source, group=self.group)
                future.set_result([tensor])
            except Exception as error:  # noqa: BLE001  any failure must reach the waiting rank, not hang it
                future.set_exception(error)

        self.worker.submit(run)
        return _create_work_from_future(future)


class BroadcastPointToPoint(dist.ProcessGroup):
    """A pipeline group whose `send`/`recv` are broadcasts in per-pair groups (`_Pair`); it has no collectives of its
    own (the pipeline's collectives use the device mesh's group)."""

    def __init__(self, rank: int, size: int, global_ranks: Sequence[int], pairs: dict[tuple[int, int], _Pair]) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # a Python subclass is built from (rank, size)
        self._global_ranks = list(global_ranks)
        self._pairs = pairs

    def _pair(self, source: int, destination: int) -> _Pair:
        key = (self._global_ranks[source], self._global_ranks[destination])
        if key not in self._pairs:
            raise RuntimeError(
                f"lightning_trn's stage transport has no group for ranks {key[0]} -> {key[1]}: only neighbouring "
                "stages exchange tensors in torch's pipeline schedules (the last with the first in the looped "
                "interleaved ones only)."
            )
        return self._pairs[key]

    @override
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        (tensor,) = tensors
        return self._pair(self.rank(), dst).transfer(tensor)

    @override
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        (tensor,) = tensors
        return self._pair(src, self.rank()).transfer(tensor)

    def getBackendName(self) -> str:  # the name c10d asks a Python process group for
        return BACKEND

    @override
    def shutdown(self) -> None:
        """The pairs' threads end with the group (`destroy_process_group`)."""
        for pair in self._pairs.values():
            pair.worker.shutdown(wait=False)


def _create(options: Any, pairs: dict[tuple[int, int], _Pair]) -> BroadcastPointToPoint:
    """The backend's constructor (`register_backend(..., extended_api=True)`): the group's pairs come as its
    options."""
    return BroadcastPointToPoint(options.group_rank, options.group_size, options.global_ranks_in_group, pairs)


def _register() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            BACKEND, lambda options, pairs: _create(options, pairs), extended_api=True, devices=["neuron", "cpu"]
        )


def ring_pairs(pipeline_groups: Iterable[Sequence[int]], wrap: bool = True) -> list[tuple[int, int]]:
    """The ordered pairs of global ranks that exchange tensors: each pipeline rank with the next one in its group,
    both ways, and with `wrap` the last with the first (only the looped interleaved schedules hand the last rank's
    stage to the first rank's next stage: GPipe and 1F1B end on the last rank, and a V turns on it). Sorted, so every
    process creates their groups in the same order."""
    pairs = set()
    for ranks in pipeline_groups:
        for index, rank in enumerate(ranks[: None if wrap else -1]):
            following = ranks[(index + 1) % len(ranks)]
            if following != rank:
                pairs |= {(rank, following), (following, rank)}
    return sorted(pairs)


def pipeline_groups(
    groups: Sequence[Sequence[int]],
    transport: str,
    backend: str | None,
    timeout: timedelta | None = None,
    wrap: bool = True,
) -> list[dist.ProcessGroup | None]:
    """One pipeline group per entry of `groups` (every process creates all of them, in this order, as
    `new_group` requires): with the "broadcast" transport a `BroadcastPointToPoint` over one 2-rank group per
    neighbouring pair the schedule uses (`ring_pairs`, `wrap`); with "send_recv" a group of `backend`. Returns the
    groups, None where this rank is not in one."""
    if transport not in TRANSPORTS:
        raise ValueError(f"Unknown stage transport {transport!r}: choose one of {', '.join(TRANSPORTS)}.")
    if transport == "send_recv":
        return [dist.new_group(list(ranks), backend=backend, timeout=timeout) for ranks in groups]
    _register()
    rank = dist.get_rank()
    pairs: dict[tuple[int, int], _Pair] = {}
    for source, destination in ring_pairs(groups, wrap):
        group = dist.new_group(sorted((source, destination)), backend=backend, timeout=timeout)
        if rank in (source, destination):
            pairs[(source, destination)] = _Pair(group, source)
    return [dist.new_group(list(ranks), backend=BACKEND, timeout=timeout, pg_options=pairs) for ranks in groups]
