"""What torch cannot do on fake tensors and a fake process group, done another way while `lightning_trn.estimate`
simulates a job (`registry.SIMULATION_HOOKS`, installed for one simulation only):

- device meshes and DTensor shard offsets are host bookkeeping (a mesh's rank lists, a shard's offsets) that torch
  reads back (`tolist`, `nonzero`, `int`), which fake tensors cannot answer: they are computed on real tensors
  (FSDP2 over a tensor-parallel mesh builds a mesh while sharding; `materialize` asks for offsets);
- `Module.to(device)` swaps every fake parameter for a copy of itself, which torch refuses once the fake parameter
  has a weak reference (any fake `Parameter` has): a move that changes nothing keeps the parameter;
- DTensor's sharding propagation runs each operator once more on fake tensors of the global shape, for the output's
  metadata only, in the fake mode it finds active: the simulation's own, whose tensors the tracker counts (the full
  vocabulary's log-softmax and its input under loss parallelism: +12 % on the checkpointed test model's peak; the
  unsharded parameters' optimizer state in the first step). It gets a fake mode of its own, as it does in a real
  run, where it allocates no device memory; the tracker skips that mode's tensors;
- device meshes compare equal across simulated ranks (torch compares the layout, not the rank's coordinates), so
  DTensor's caches would hand a later rank the earlier one's mesh and its destroyed process groups: meshes also
  compare their groups' names;
- groups asked for with the gloo backend (the strategies' host group) are fake as well, since a real gloo group
  needs its peers;
- a broadcast of host objects leaves each rank its own (on a rank other than the source the fake group would leave
  the objects' sizes uninitialized): what every rank broadcasts in a training step (the log directory) is alike;
- pipeline stages (`torch.distributed.pipelining`) learn their neighbours' tensor shapes from objects sent over the
  process group, and vote on how with a tensor read back (`item`): on a fake group nothing arrives. One rank is
  simulated at a time, earliest pipeline rank first: the shapes a stage sends forward are kept (`STAGE_TRANSFERS`)
  for the later simulations of the stages that receive them; a stage never simulated (a middle stage like the one
  that was) stands in by the nearest earlier stage that was; gradients coming back have their outputs' shapes (what
  torch derives when shapes are given). The vote is what every stage of `lightning_trn.pipeline_split` votes: its
  shapes are inferred. The tensors the schedules hand between stages are counted (`STAGE_TRANSFERS`), not sent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def on_real_tensors(function: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`function` run with the active fake mode set aside."""
    if function is None:
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return wrapper


def mesh_equal_with_groups(eq: Callable[[Any, object], bool] | None) -> Callable[[Any, object], bool] | None:
    """`DeviceMesh.__eq__` that also compares the meshes' process-group names. torch's compares the layout and the
    whole rank map, not which coordinates the current rank has, so the meshes of two simulated ranks are equal while
    the first rank's groups were destroyed with its fake process group; DTensor's sharding-propagation caches, keyed
    by meshes, would then hand the next rank tensors on those groups ("Could not resolve the process group": the
    second stage of a pipeline x tensor-parallel job). Meshes on groups of the same names are interchangeable."""
    if eq is None:
        return None

    @functools.wraps(eq)
    def equal(mesh: Any, other: object) -> bool:
        groups = getattr(mesh, "_dim_group_names", None), getattr(other, "_dim_group_names", None)
        return eq(mesh, other) and (mesh is other or groups[0] == groups[1])

    return equal


def mesh_hash_with_groups(hash_: Callable[[Any], int] | None) -> Callable[[Any], int] | None:
    """`DeviceMesh.__hash__` consistent with `mesh_equal_with_groups` (torch's hash, with the group names)."""
    if hash_ is None:
        return None

    @functools.wraps(hash_)
    def hashed(mesh: Any) -> int:
        return hash((hash_(mesh), tuple(getattr(mesh, "_dim_group_names", ()))))

    return hashed


def swap_unless_unchanged(swap: Callable[[torch.Tensor, torch.Tensor], None] | None) -> Callable[..., None] | None:
    """`torch.utils.swap_tensors` that keeps a fake tensor whose replacement would change nothing."""
    if swap is None:
        return None
    from torch._subclasses.fake_tensor import FakeTensor

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        same = (t1.device, t1.dtype, t1.shape, t1.stride()) == (t2.device, t2.dtype, t2.shape, t2.stride())
        if not (same and isinstance(t1, FakeTensor)):
            swap(t1, t2)

    return swap_tensors


def own_propagation_mode(detect: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Sharding propagation's `detect_fake_mode`: a fake mode of its own (one per simulation), never the
    simulation's."""
    if detect is None:
        return None
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    return lambda *args, **kwargs: mode


def fake_host_groups(new_group: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`torch.distributed.new_group` that makes a gloo group a fake one."""
    if new_group is None:
        return None

    @functools.wraps(new_group)
    def fake_new_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = "fake"
        return new_group(*args, **kwargs)

    return fake_new_group


def own_objects(broadcast_object_list: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`torch.distributed.broadcast_object_list` that leaves every rank's objects as they are."""
    if broadcast_object_list is None:
        return None

    @functools.wraps(broadcast_object_list)
    def kept(object_list: list[Any], *args: Any, **kwargs: Any) -> None:
        return None

    return kept


@dataclass
class StageTransfers:
    """What the pipeline stages of one estimate hand each other: the forward shapes each stage sent (`metas`, by
    sending stage, kept across the estimate's simulated ranks) and, while `counting` is a list, every tensor a
    schedule sends or receives as `(sent, bytes, peer's global rank)`."""

    metas: dict[int, Any] = field(default_factory=dict)
    counting: list[tuple[bool, int, int]] | None = None

    def clear(self) -> None:
        self.metas.clear()
        self.counting = None


#: the stage transfers of the estimate running in this process (one at a time: the fake process group is global)
STAGE_TRANSFERS = StageTransfers()


def recorded_stage_inputs(recv_meta: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`PipelineStage._recv_meta` answered without the process group: the shapes the previous stage sent in an
    earlier simulation (else the nearest earlier stage's), or, for gradients, this stage's outputs' shapes."""
    if recv_meta is None:
        return None
    from torch.distributed.pipelining._utils import (  # type: ignore[attr-defined]  # torch 2.13's; mypy reads 2.9
        _derive_grad_metas,
    )
    from torch.distributed.pipelining.stage import _StageBackwardMeta  # type: ignore[attr-defined]  # as above

    def received(stage: Any, src_stage: int) -> Any:
        if src_stage > stage.stage_index:
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(stage._stage_meta.outputs))
        earlier = [index for index in STAGE_TRANSFERS.metas if index <= src_stage]
        if not earlier:
            raise RuntimeError(
                f"stage {stage.stage_index} needs the shapes stage {src_stage} sends, and no earlier stage was "
                "simulated: simulate the pipeline's ranks earliest first."
            )
        return STAGE_TRANSFERS.metas[max(earlier)]

    return received


def recording_stage_outputs(send_meta: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`PipelineStage._send_meta` that keeps the forward shapes for the stages simulated later."""
    if send_meta is None:
        return None

    def send(stage: Any, meta: Any, dst_stage: int) -> None:
        if dst_stage > stage.stage_index:
            STAGE_TRANSFERS.metas[stage.stage_index] = meta

    return send


def warmup_without_vote(warmup: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """A schedule's warm-up that sets each stage's shape inference as the vote would: inferred unless every stage
    of the rank was given its shapes (a fake group's vote reads back nothing)."""
    if warmup is None:
        return None
    from torch.distributed.pipelining.stage import (  # type: ignore[attr-defined]  # torch 2.13's vote; 2.9 has none
        InferenceMode,
        PipelineStage,
    )

    def warmup_p2p(schedule: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        if not all(isinstance(stage, PipelineStage) for stage in stages):
            warmup(schedule, stages, has_backward, p2p_done)
            return
        dynamic = any(InferenceMode.needs_dynamic(stage._user_meta, has_backward) for stage in stages)
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    return warmup_p2p


def counted_stage_transfers(batch_p2p: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The schedules' `_batch_p2p` that counts each tensor sent or received (while `STAGE_TRANSFERS.counting`)
    and runs none: on a fake group a transfer carries nothing and the receiving stage allocated its buffer already
    (from the shapes); the broadcast transport's threads would run fake-tensor ops beside the main thread's, which a
    fake mode does not allow (the interleaved schedules wait for their sends late)."""
    if batch_p2p is None:
        return None
    import torch.distributed as dist

    @functools.wraps(batch_p2p)
    def counted(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        if STAGE_TRANSFERS.counting is not None:
            for op in p2p_ops:
                size = op.tensor.numel() * op.tensor.element_size()
                STAGE_TRANSFERS.counting.append((op.op is dist.isend, size, op.peer))
        return []

    return counted
