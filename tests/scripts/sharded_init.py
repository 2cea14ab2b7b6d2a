"""Worker script for tests/strategies/test_sharded_init.py: how a model reaches 2 stand-in `neuron` devices under
Fabric's `ModelParallelStrategy(parallelize_fn)`, each way measured on each rank.

`parallelize` gives the three kinds of tensors a sharded model holds: `big` sharded over both ranks (FSDP2,
`Shard(0)`), `replica` replicated over them (FSDP2 on the (2, 1) mesh: HSDP's replicate dimension, NO_SHARD's layout)
and `plain` left as it is (plain tensors, as tensor parallelism leaves norms).

Phases, one `fabric.setup_module` each: `meta` (built on the meta device, materialized), `host` (built on the host),
`seed` (built on meta with another seed, read from a seed checkpoint written from the reference build, nothing drawn:
`reset_parameters` raises), `diverged` (built on the host after rank 1 drew one extra random number). For each: the
bytes copied host->device during setup, the allocator's peak during setup, this rank's resident bytes (the shards
and the unsharded tensors), whether the gathered weights equal the reference build bit for bit; for `seed` the bytes
read from the seed checkpoint (counted at `safetensors.safe_open`); and for `diverged` whether the replicated and
plain tensors equal rank 0's. Each rank writes them to --out/run-<rank>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn import standin
from lightning_trn.core.parallel.model_parallel import write_seed_checkpoint
from lightning_trn.fabric import NeuronModelParallelStrategy
from tests.standin.safetensors_reads import counting_reads

SEED = 7


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(256, 1024)
        self.replica = nn.Linear(64, 64)
        self.plain = nn.Linear(64, 64)


def parallelize(model: Net, mesh: object) -> Net:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.big, mesh=mesh["data_parallel"])
    fully_shard(model.replica, mesh=mesh)  # (data_parallel=2, tensor_parallel=1): replicated, shards of one
    return model


def reference() -> Net:
    torch.manual_seed(SEED)
    return Net()


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def resident_bytes(model: nn.Module) -> int:
    """Bytes of this rank's tensors on the device: local shards of DTensors, all of the others."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors(model).values()]
    return sum(t.numel() * t.element_size() for t in local)


def setup(fabric: Fabric, model: nn.Module, expected: dict[str, torch.Tensor]) -> tuple[nn.Module, dict]:
    device = fabric.device
    # the previous phase's model is in reference cycles (FSDP's hooks): freed by the cyclic collector at any moment,
    # it would lower the memory below `before` during this setup and hide this model's peak
    gc.collect()
    standin.reset_counters()
    torch.neuron.reset_peak_memory_stats(device)
    before = torch.neuron.memory_allocated(device)
    model = fabric.setup_module(model).module  # the model itself, not Fabric's wrapper
    record = {
        "host_to_device_bytes": standin.counters()["host_to_device_bytes"],
        "peak_bytes": torch.neuron.max_memory_allocated(device) - before,
        "resident_bytes": resident_bytes(model),
    }
    full = {
        name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu() for name, t in tensors(model).items()
    }
    record["equals_reference"] = all(torch.equal(full[name], value) for name, value in expected.items())
    return model, record


def replicas_agree(fabric: Fabric, model: nn.Module) -> dict[str, bool]:
    """Whether each replicated or plain tensor's local values equal rank 0's."""
    local = {
        name: (t.to_local() if hasattr(t, "to_local") else t).detach().cpu()
        for name, t in tensors(model).items()
        if not name.startswith("big.")
    }
    gathered = fabric.all_gather(local)  # stacked over ranks
    return {
        name: all(torch.equal(values[rank].cpu(), values[0].cpu()) for rank in range(values.shape[0]))
        for name, values in gathered.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    strategy = NeuronModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="neuron", devices=2, strategy=strategy)
    fabric.launch()
    expected = {name: t.detach() for name, t in tensors(reference()).items()}
    run: dict = {"full_bytes": resident_bytes(reference())}

    fabric.seed_everything(SEED)
    with fabric.init_module(empty_init=True):
        model = Net()
    _, run["meta"] = setup(fabric, model, expected)

    fabric.seed_everything(SEED)
    _, run["host"] = setup(fabric, Net(), expected)

    seed_dir = out / "seed"
    if fabric.global_rank == 0:
        write_seed_checkpoint(reference, seed_dir)
    fabric.barrier()
    fabric.strategy._seed_checkpoint = seed_dir  # the constructor's `seed_checkpoint=`, set for this phase only
    fabric.seed_everything(SEED + 1)
    with fabric.init_module(empty_init=True):
        model = Net()
    reset = nn.Linear.reset_parameters
    nn.Linear.reset_parameters = lambda self: (_ for _ in ()).throw(AssertionError("drawn"))  # type: ignore
    try:
        with counting_reads() as reads:
            _, run["seed"] = setup(fabric, model, expected)
    finally:
        nn.Linear.reset_parameters = reset  # type: ignore[method-assign]
    run["seed"]["read_bytes"] = reads.bytes
    fabric.strategy._seed_checkpoint = None

    fabric.seed_everything(SEED)
    if fabric.global_rank == 1:
        torch.rand(1)  # one draw more than rank 0: a data loader's shuffle, a dropout
    model, run["diverged"] = setup(fabric, Net(), expected)
    run["diverged"]["agree"] = replicas_agree(fabric, model)
    (out / f"run-{fabric.global_rank}.json").write_text(json.dumps(run))


if __name__ == "__main__":
    main()
