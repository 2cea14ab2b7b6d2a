"""Run under torchrun with 2 processes: every collective of the stand-in's `neuron` backend, DDP, functional
collectives, DTensor and FSDP2, each against the value a single process computes. Writes rank<N>.json to argv[1]:
each check's result, or the error its section raised (a 30 s group timeout turns a hang into an error)."""

import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from lightning_trn import standin

dist.init_process_group("neuron", timeout=timedelta(seconds=30))
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2
results: dict[str, object] = {}


def section(*names: str) -> Callable[[Callable[[], None]], None]:
    """Run the decorated checks now; if they raise, record the error under each name they would have set."""

    def run(body: Callable[[], None]) -> None:
        try:
            body()
        except Exception:  # noqa: BLE001  any failing check is a result: recorded, the other sections still run
            for name in names:
                results.setdefault(name, traceback.format_exc(limit=3))

    return run


def check(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    # exact: every check moves small integers, or sums, halves and extremes of two of them, all exact in float32
    results[name] = got.device.type == "neuron" and torch.allclose(got.cpu(), expected, rtol=0, atol=0)


def on_device(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to("neuron")


# rank 0 holds [1, 5], rank 1 holds [3, 2]
mine = [[1.0, 5.0], [3.0, 2.0]][rank]
peer = 1 - rank


@section(
    "all_reduce_SUM",
    "all_reduce_AVG",
    "all_reduce_MAX",
    "all_reduce_MIN",
    "all_reduce_AVG_int",
    "collectives_read_nothing_to_the_host",
    "async_work_completes",
)
def all_reduce() -> None:
    for op, expected in [("SUM", [4.0, 7.0]), ("AVG", [2.0, 3.5]), ("MAX", [3.0, 5.0]), ("MIN", [1.0, 2.0])]:
        x = on_device(mine)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        check(f"all_reduce_{op}", x, torch.tensor(expected))
    x = on_device([int(v) for v in mine], torch.int64)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    check("all_reduce_AVG_int", x, torch.tensor([2, 3]))
    x = on_device(mine)
    standin.reset_counters()
    dist.all_reduce(x)
    results["collectives_read_nothing_to_the_host"] = standin.counters()["device_to_host"] == 0
    work = dist.all_reduce(on_device(mine), async_op=True)
    results["async_work_completes"] = work.wait() and work.is_completed()


@section("broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "object_collectives")
def other_collectives() -> None:
    x = on_device(mine)
    dist.broadcast(x, src=1)
    check("broadcast", x, torch.tensor([3.0, 2.0]))
    outs = [torch.zeros(2, device="neuron") for _ in range(2)]
    dist.all_gather(outs, on_device(mine))
    check("all_gather", torch.stack(outs), torch.tensor([[1.0, 5.0], [3.0, 2.0]]))
    out = torch.zeros(4, device="neuron")
    dist.all_gather_into_tensor(out, on_device(mine))
    check("all_gather_into_tensor", out, torch.tensor([1.0, 5.0, 3.0, 2.0]))
    out = torch.zeros(1, device="neuron")
    dist.reduce_scatter_tensor(out, on_device(mine))
    check("reduce_scatter_tensor", out, torch.tensor([[4.0], [7.0]][rank]))
    x = on_device(mine)
    dist.reduce(x, dst=0)
    if rank == 0:
        check("reduce", x, torch.tensor([4.0, 7.0]))
    objects = [{"rank": rank}] if rank == 1 else [None]
    dist.broadcast_object_list(objects, src=1)
    gathered = [None, None]
    dist.all_gather_object(gathered, f"r{rank}")
    results["object_collectives"] = objects == [{"rank": 1}] and gathered == ["r0", "r1"]
    dist.barrier()


@section("no_point_to_point", "barrier_default_group_only", "no_monitored_barrier", "visible_cores_from_local_rank")
def what_torchneuron_lacks() -> None:  # refused as TorchNeuron's backend refuses it
    def refused(call: Callable[[], object], error: type, match: str) -> bool:
        try:
            call()
        except error as err:
            return match in str(err)
        return False

    results["no_point_to_point"] = refused(
        lambda: dist.send(on_device([9.0]), dst=peer), NotImplementedError, "send is not supported"
    ) and refused(
        lambda: dist.irecv(torch.zeros(1, device="neuron"), src=peer), NotImplementedError, "recv is not supported"
    )
    subgroups = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group
    results["barrier_default_group_only"] = refused(
        lambda: dist.barrier(group=subgroups[rank]), NotImplementedError, "only for default group"
    )
    results["no_monitored_barrier"] = refused(lambda: dist.monitored_barrier(), ValueError, "GLOO")
    results["visible_cores_from_local_rank"] = os.environ["NEURON_RT_VISIBLE_CORES"] == os.environ["LOCAL_RANK"]


@section("ddp_equals_single_process")
def ddp() -> None:  # 2 processes x batch 4 equal 1 process x batch 8
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model.load_state_dict(reference.state_dict())
    data, target = torch.randn(8, 6), torch.randn(8, 3)
    ddp_model = nn.parallel.DistributedDataParallel(model.to("neuron"))
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt_ddp = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    shard = slice(4 * rank, 4 * rank + 4)
    for _ in range(3):
        opt_ref.zero_grad()
        nn.functional.mse_loss(reference(data), target).backward()
        opt_ref.step()
        opt_ddp.zero_grad()
        nn.functional.mse_loss(ddp_model(data[shard].to("neuron")), target[shard].to("neuron")).backward()
        opt_ddp.step()
    # SGD, lr 0.1, 3 steps: a mean of 2 means vs 1 mean differs by a few ulps of each gradient (<= ~1: ~4e-7),
    # which moves a weight by lr x that a step, ~1e-7 after 3, under 1e-6
    results["ddp_equals_single_process"] = all(
        torch.allclose(p.cpu(), q, rtol=0, atol=1e-6)
        for p, q in zip(ddp_model.module.parameters(), reference.parameters(), strict=True)
    )


@section("funcol_all_reduce", "dtensor_shard", "dtensor_redistribute")
def dtensor() -> None:  # functional collectives and DTensor dispatch from C++ to the backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    reduced = funcol.all_reduce(on_device(mine), "sum", dist.group.WORLD).wait()
    check("funcol_all_reduce", reduced, torch.tensor([4.0, 7.0]))
    mesh = init_device_mesh("neuron", (2,))
    full = torch.arange(8.0).reshape(4, 2)
    sharded = distribute_tensor(full.to("neuron"), mesh, [Shard(0)])
    check("dtensor_shard", sharded.to_local(), full[2 * rank : 2 * rank + 2])
    check("dtensor_redistribute", sharded.redistribute(mesh, [Replicate()]).to_local(), full)


@section("fsdp2_grads_equal_single_process")
def fsdp2() -> None:  # sharded gradients equal the single process's
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    single = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    sharded = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    sharded.load_state_dict(single.state_dict())
    sharded.to("neuron")
    mesh = init_device_mesh("neuron", (2,))
    for layer in (sharded[0], sharded[2], sharded):
        fully_shard(layer, mesh=mesh)
    data, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    nn.functional.mse_loss(single(data), target).backward()
    shard = slice(4 * rank, 4 * rank + 4)
    nn.functional.mse_loss(sharded(data[shard].to("neuron")), target[shard].to("neuron")).backward()
    # one float64 backward (eps 2.2e-16) in another summation order: gradients of order 1 a few 1e-16 apart, far
    # under 1e-9
    results["fsdp2_grads_equal_single_process"] = all(
        torch.allclose(p.grad.full_tensor().cpu(), q.grad, rtol=0, atol=1e-9)
        for p, q in zip(sharded.parameters(), single.parameters(), strict=True)
    )


Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(results))
dist.destroy_process_group()
