"""A process group in this one process over torch's fake backend (collectives do nothing): enough for DeviceMesh,
DTensor and FSDP2 to decide what they would do on `world_size` ranks, without launching any."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """The group as `rank` of `world_size` sees it: what that rank would hold (its shards) is computed here."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor caches sharding decisions by meshes that compare equal whatever the rank they were built on: the
        # next group, as another rank, would get this one's meshes back (and their coordinates)
        _clear_sharding_prop_cache()
