"""ZeRO-1 (`strategy="neuron_zero1"`), on whichever backend the suite runs (XLA:CPU, or the native stand-in).

`tests/scripts/zero1_train.py` (AdamW, clipping, accumulation, a per-step LR schedule, parameter sizes that need
padding) runs on 2 processes with the optimizer state sharded and must end where one unsharded process ends: weights
and Adam moments within float summation order, each rank holding half the state. Checkpoints hold the full state, so
runs resume across world sizes in both directions, from full checkpoints (one file) and sharded ones (a directory
with one file per rank). The in-process tests use one-rank process groups.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_trn import consolidate
from lightning_trn.core.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.stochastic_rounding import stochastic_round_to_bf16
from lightning_trn.core.zero1 import MASTER_WEIGHT, Zero1Sharding, optimizer_state_bytes, sharding_of
from lightning_trn.runtime import get_runtime
from lightning_trn.runtime.host_collectives import HostCollectives
from tests.launch import child_env

SCRIPT = Path(__file__).parent / "scripts" / "zero1_train.py"
#: float32 Adam on a 2-process mean of micro-batch means vs a 1-process mean: equal up to summation order
TOLERANCE = 1e-6
RUN_TIMEOUT_S = 150
#: element counts of the script's parameters (Linear(7, 13), Linear(13, 3))
NUMELS = (13 * 7, 13, 3 * 13, 3)


def _launch(out: Path, *args: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SCRIPT), "--out", str(out), *args]
    result = subprocess.run(command, env=child_env(), cwd=out, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _zero1(out: Path, *args: str) -> Path:
    return _launch(out, "--devices", "2", "--strategy", "neuron_zero1", *args)


def _assert_same_training_state(saved: dict, reference: dict, optimizer_key: str = "optimizer_states") -> None:
    """Weights and the full optimizer state (moments, step counts, hyperparameters) equal the reference run's."""
    for name, value in reference["state_dict"].items():
        torch.testing.assert_close(saved["state_dict"][name], value, atol=TOLERANCE, rtol=0, msg=name)
    expected = reference["optimizer_states"][0]
    optimizer = saved[optimizer_key][0] if optimizer_key == "optimizer_states" else saved[optimizer_key]
    assert optimizer["param_groups"] == expected["param_groups"]  # the LR schedule went through the same steps
    assert optimizer["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert optimizer["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert optimizer["state"][index][key].shape == value.shape  # gathered into the parameter's shape
            torch.testing.assert_close(optimizer["state"][index][key], value, atol=TOLERANCE, rtol=0, msg=key)


def _checkpoint(path: Path) -> dict:
    """A checkpoint file's contents, or a sharded checkpoint directory's, consolidated."""
    return NeuronCheckpointIO().load_checkpoint(path) if path.is_dir() else torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, unsharded: what every sharded or resumed run must end with."""
    return _launch(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two processes, ZeRO-1, sharded checkpoints (directories, one file per rank)."""
    return _zero1(tmp_path_factory.mktemp("zero1"), "--state-dict-type", "sharded")


@pytest.mark.slow
def test_two_processes_with_sharded_state_end_like_one_process(reference: Path, sharded: Path, tmp_path: Path) -> None:
    _assert_same_training_state(_checkpoint(sharded / "final.ckpt"), _checkpoint(reference / "final.ckpt"))
    # each rank wrote its own half of the optimizer state; the main file holds none of it
    files = sorted(p.name for p in (sharded / "final.ckpt").iterdir())
    assert files == ["checkpoint.pt", "zero1-rank0.pt", "zero1-rank1.pt"]
    chunks = [torch.load(sharded / "final.ckpt" / f"zero1-rank{r}.pt", weights_only=True)["chunks"] for r in (0, 1)]
    assert [sum(c.numel() for c in rank) for rank in chunks] == [2 * sum(math.ceil(n / 2) for n in NUMELS)] * 2
    # the consolidation tool writes one portable file (CPU, no process group) that `torch.load` reads as it is
    consolidate.main([str(sharded / "final.ckpt"), str(tmp_path / "one.ckpt")])
    one_file = torch.load(tmp_path / "one.ckpt", weights_only=True)
    _assert_same_training_state(one_file, _checkpoint(reference / "final.ckpt"))
    # each rank holds its half of every parameter's moments (padded to an even length) and the step counters
    chunks = sum(math.ceil(numel / 2) for numel in NUMELS)
    steps = 4 * len(NUMELS)
    unsharded = json.loads((reference / "rank0.json").read_text())
    assert unsharded["state_bytes"] == 2 * 4 * sum(NUMELS) + steps
    for rank in (0, 1):
        record = json.loads((sharded / f"rank{rank}.json").read_text())
        assert record["state_bytes"] == 2 * 4 * chunks + steps
    # between steps nothing is read from the device and no graph is compiled
    run = json.loads((sharded / "run.json").read_text())
    assert (run["scalar_reads"], run["compiles"]) == (0, 0)


@pytest.mark.slow
# one direction per suite (CI time): the state-dict hooks that re-shard are host code shared by both backends
@pytest.mark.parametrize("direction", [pytest.param("2->1", marks=pytest.mark.xla_only),
                                       pytest.param("1->2", marks=pytest.mark.native_only)])
def test_resume_on_another_world_size_ends_like_the_uninterrupted_run(
    tmp_path: Path, reference: Path, sharded: Path, direction: str
) -> None:
    """A sharded checkpoint (a directory) from step 3 of the ZeRO-1 run resumes on one unsharded process, and a file
    from the unsharded run on two sharded ones (which write full checkpoints); both end where the uninterrupted run
    ends."""
    if direction == "2->1":
        out = _launch(tmp_path, "--resume", str(sharded / "step=3.ckpt"))
    else:
        out = _zero1(tmp_path, "--resume", str(reference / "step=3.ckpt"))
    _assert_same_training_state(_checkpoint(out / "final.ckpt"), _checkpoint(reference / "final.ckpt"))


@pytest.mark.slow
# plain DDP's Fabric clipping is backend-independent host logic: checked in the native suite only (CI time)
@pytest.mark.parametrize("strategy", ["neuron_zero1", pytest.param("neuron_ddp", marks=pytest.mark.native_only)])
def test_fabric_loop_on_two_processes_ends_like_the_trainer_on_one_process(
    tmp_path: Path, reference: Path, strategy: str
) -> None:
    """The job as a Fabric loop on 2 processes, saved with `fabric.save`. `fabric.clip_gradients` clips the gradients
    averaged over the ranks (ZeRO-1: by the norm over both ranks' chunks), as one process does."""
    out = _launch(tmp_path, "--api", "fabric", "--devices", "2", "--strategy", strategy)
    _assert_same_training_state(_checkpoint(out / "final.ckpt"), _checkpoint(reference / "final.ckpt"), "optimizer")
    state_bytes = json.loads((out / "rank1.json").read_text())["state_bytes"]
    unsharded = json.loads((reference / "rank0.json").read_text())["state_bytes"]
    assert state_bytes < unsharded if strategy == "neuron_zero1" else state_bytes == unsharded


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-process gloo group, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _shard(optimizer: torch.optim.Optimizer, rounding=torch.Tensor.to) -> Zero1Sharding:  # type: ignore[no-untyped-def]
    collectives = HostCollectives(world_size=1)
    return Zero1Sharding(optimizer, collectives, collectives, rank=0, rounding=rounding)


def _linear(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Linear(5, 3) on the suite's device (a CPU backward before the device starts would break later tests)."""
    return torch.nn.Linear(5, 3).to(device=get_runtime().device(), dtype=dtype)


def _ones(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(4, 5, dtype=dtype, device=get_runtime().device())


def _step(model: torch.nn.Module, sharding: Zero1Sharding) -> None:
    model(_ones(next(model.parameters()).dtype)).float().square().mean().backward()
    sharding.reduce_gradients()
    sharding.optimizer.step()
    sharding.optimizer.zero_grad()
    sharding.gather_parameters()


def test_bf16_parameters_keep_fp32_masters_that_checkpoints_carry(one_rank_group: None) -> None:
    """bf16 parameters: the optimizer updates fp32 chunks and keeps fp32 state; the parameters are the chunks
    stochastically rounded; `state_dict()` carries the masters and `load_state_dict` puts them back exactly."""
    torch.manual_seed(0)
    model = _linear(torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sharding = _shard(optimizer, rounding=lambda value, dtype: stochastic_round_to_bf16(value))
    for _ in range(3):
        _step(model, sharding)
    assert {p.dtype for group in optimizer.param_groups for p in group["params"]} == {torch.float32}
    assert {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    masters = [p.detach().cpu() for group in optimizer.param_groups for p in group["params"]]
    # updates of 1e-3 are below bf16's spacing: the masters moved, the bf16 weights are only their rounding
    assert not torch.equal(masters[0].view(3, 5).bfloat16().float(), masters[0].view(3, 5))
    saved = optimizer.state_dict()
    torch.testing.assert_close(saved["state"][0][MASTER_WEIGHT], masters[0].view(3, 5), atol=0, rtol=0)

    restored_model = _linear(torch.bfloat16)
    restored_model.load_state_dict(model.state_dict())
    restored = torch.optim.Adam(restored_model.parameters(), lr=1e-3)
    _shard(restored).optimizer.load_state_dict(saved)
    for master, shard in zip(masters, (p for group in restored.param_groups for p in group["params"])):
        torch.testing.assert_close(shard.detach().cpu(), master, atol=0, rtol=0)
    torch.testing.assert_close(restored.state_dict()["state"][0][MASTER_WEIGHT], masters[0].view(3, 5), atol=0, rtol=0)


def test_sharding_an_optimizer_that_stepped_keeps_its_state(one_rank_group: None) -> None:
    """An optimizer sharded after it stepped (state keyed by the module's parameters) keeps that state: its
    `state_dict()` is the unsharded one, and so is its next step."""
    torch.manual_seed(0)
    model = _linear()
    twin = _linear()
    twin.load_state_dict(model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    plain = torch.optim.Adam(twin.parameters(), lr=0.1)
    for net, opt in ((model, optimizer), (twin, plain)):
        net(_ones()).square().mean().backward()
        opt.step()
        opt.zero_grad()
    sharding = _shard(optimizer)
    assert sharding_of(optimizer) is sharding
    assert optimizer_state_bytes(optimizer) == optimizer_state_bytes(plain)
    _step(model, sharding)
    twin(_ones()).square().mean().backward()
    plain.step()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-7, rtol=0)
    for index, state in plain.state_dict()["state"].items():
        for key, value in state.items():
            mine = optimizer.state_dict()["state"][index][key]
            torch.testing.assert_close(mine.cpu(), value.cpu(), atol=1e-7, rtol=0)


def test_clipping_uses_the_norm_of_all_chunks(one_rank_group: None) -> None:
    torch.manual_seed(0)
    model = _linear()
    twin = _linear()
    twin.load_state_dict(model.state_dict())
    sharding = _shard(torch.optim.SGD(model.parameters(), lr=0.1))
    for net in (model, twin):
        net(_ones()).square().sum().backward()
    sharding.reduce_gradients()
    norm = sharding.clip_grad_norm_(0.5)
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    torch.testing.assert_close(norm, expected)
    clipped = [p.grad for group in sharding.optimizer.param_groups for p in group["params"]]
    for mine, theirs in zip(clipped, twin.parameters()):
        torch.testing.assert_close(mine, theirs.grad.reshape(-1), atol=1e-7, rtol=0)


@pytest.mark.xla_only
def test_on_neuron_the_step_is_one_graph_with_xla_collectives() -> None:
    """What a Trn1 rank runs: `XlaCollectives` (`xm` ops), one process here (XLA:CPU's runtime collectives do not span
    processes). The whole step, reduce-scatter included, stays one pending graph without a device read, and updates
    the weights as the unsharded optimizer does (clipped)."""
    import torch_xla

    from lightning_trn.runtime.xla_collectives import XlaCollectives

    runtime = get_runtime()
    torch.manual_seed(0)
    model, twin = _linear(), _linear()
    twin.load_state_dict(model.state_dict())
    collectives = XlaCollectives(world_size=1)
    sharding = Zero1Sharding(torch.optim.Adam(model.parameters(), lr=0.1), collectives, collectives, 0, torch.Tensor.to)
    plain = torch.optim.Adam(twin.parameters(), lr=0.1)
    runtime.sync()
    before = runtime.metrics()
    model(_ones()).square().mean().backward()
    sharding.reduce_gradients()
    sharding.clip_grad_norm_(0.05)
    sharding.optimizer.step()
    sharding.gather_parameters()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(model.parameters()))
    assert (runtime.metrics() - before).device_to_host == 0 and (runtime.metrics() - before).scalar_reads == 0
    assert "reduce-scatter(" in hlo
    twin(_ones()).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    plain.step()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.cpu(), theirs.cpu(), atol=1e-7, rtol=0)


@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_neuron_zero1_names_the_sharded_ddp_strategy(api: str) -> None:
    import lightning_trn

    if api == "trainer":
        from lightning.pytorch.strategies import StrategyRegistry as registry

        expected = lightning_trn.NeuronDDPStrategy
    else:
        from lightning.fabric.strategies import STRATEGY_REGISTRY as registry

        expected = lightning_trn.fabric.NeuronDDPStrategy
    strategy = registry.get("neuron_zero1")
    assert type(strategy) is expected and strategy.zero1
    assert not registry.get("neuron_ddp").zero1
