"""A process group in this one process over torch's fake backend (collectives do nothing): enough for DeviceMesh,
DTensor and FSDP2 to decide what they would do on `world_size` ranks, without launching any."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
