"""ZeRO-1 (`strategy="neuron_zero1"`), on whichever backend the suite runs (XLA:CPU, or the native stand-in).

`tests/scripts/zero1_train.py` (AdamW, clipping, accumulation, a per-step LR schedule, parameter sizes that need
padding) runs on 2 processes with the optimizer state sharded and must end where one unsharded process ends: weights
and Adam moments within float summation order, each rank holding half the state. Checkpoints hold the full state, so
runs resume across world sizes in both directions, from full checkpoints (one file) and sharded ones (a directory
with one file per rank). Saving and loading them holds each rank's share of the optimizer state in host memory, not
the whole state (rank 0 of a full save excepted), measured at 2 and 4 ranks. The in-process tests use one-rank process
groups; the optimizer allow-list and the fp32 reduction of bf16 gradients are checked without one.
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
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.parallel.zero1 import (
    CHUNK,
    MASTER_WEIGHT,
    Zero1Sharding,
    optimizer_state,
    optimizer_state_bytes,
    sharding_of,
)
from lightning_trn.core.stochastic_rounding import stochastic_round_to_bf16
from lightning_trn.runtime import get_runtime
from lightning_trn.runtime.host_collectives import HostCollectives
from tests.launch import child_env
from tests.tolerance import assert_moments_match, assert_weights_match, weights_error

pytestmark = pytest.mark.both

SCRIPT = Path(__file__).parents[1] / "scripts" / "zero1_train.py"
#: the reference's float64 twin (tests/tolerance.py): Lightning's own 64-true on the CPU, one process
FLOAT64 = ("--accelerator", "cpu", "--precision", "64-true")
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


def _assert_same_training_state(
    saved: dict, reference: dict, exact: dict, optimizer_key: str = "optimizer_states"
) -> None:
    """Weights and the full optimizer state (moments, step counts, hyperparameters) equal the reference run's, the
    weights and moments within the tolerance tests/tolerance.py derives from the reference's float32 error (`exact`:
    its float64 twin)."""
    weights = reference["state_dict"]
    assert_weights_match(saved["state_dict"], weights, weights_error(weights, exact["state_dict"]))
    expected = reference["optimizer_states"][0]
    optimizer = saved[optimizer_key][0] if optimizer_key == "optimizer_states" else saved[optimizer_key]
    assert optimizer["param_groups"] == expected["param_groups"]  # the LR schedule went through the same steps
    assert optimizer["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert optimizer["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert optimizer["state"][index][key].shape == value.shape  # gathered into the parameter's shape
            if not value.dim():  # Adam's step counter
                assert torch.equal(optimizer["state"][index][key].cpu(), value.cpu()), (index, key)
    assert_moments_match(optimizer, expected, exact["optimizer_states"][0])


def _checkpoint(path: Path) -> dict:
    """A checkpoint file's contents, or a sharded checkpoint directory's, consolidated."""
    return NeuronCheckpointIO().load_checkpoint(path) if path.is_dir() else torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, unsharded: what every sharded or resumed run must end with."""
    return _launch(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference's float64 twin: its final checkpoint."""
    return _checkpoint(_launch(tmp_path_factory.mktemp("reference64"), *FLOAT64) / "final.ckpt")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two processes, ZeRO-1, sharded checkpoints (directories, one file per rank)."""
    return _zero1(tmp_path_factory.mktemp("zero1"), "--state-dict-type", "sharded")


@pytest.mark.slow
@pytest.mark.numerics
def test_two_processes_with_sharded_state_end_like_one_process(
    reference: Path, exact: dict, sharded: Path, tmp_path: Path
) -> None:
    _assert_same_training_state(_checkpoint(sharded / "final.ckpt"), _checkpoint(reference / "final.ckpt"), exact)
    # each rank wrote its own half of the optimizer state; the main file holds none of it
    files = sorted(p.name for p in (sharded / "final.ckpt").iterdir())
    # each rank's chunks and random state in its own files
    assert files == [
        "checkpoint.pt",
        "random-state-rank0.pt",
        "random-state-rank1.pt",
        "zero1-rank0.pt",
        "zero1-rank1.pt",
    ]
    chunks = [torch.load(sharded / "final.ckpt" / f"zero1-rank{r}.pt", weights_only=True)["chunks"] for r in (0, 1)]
    assert [sum(c.numel() for c in rank) for rank in chunks] == [2 * sum(math.ceil(n / 2) for n in NUMELS)] * 2
    # the consolidation tool writes one portable file (CPU, no process group) that `torch.load` reads as it is
    consolidate.main([str(sharded / "final.ckpt"), str(tmp_path / "one.ckpt")])
    one_file = torch.load(tmp_path / "one.ckpt", weights_only=True)
    _assert_same_training_state(one_file, _checkpoint(reference / "final.ckpt"), exact)
    # what a recipe's `export` loads of it: the weights, none of the optimizer state
    weights = consolidate.model_checkpoint(sharded / "final.ckpt")
    assert "optimizer_states" not in weights and weights["state_dict"].keys() == one_file["state_dict"].keys()
    for name, value in one_file["state_dict"].items():
        assert torch.equal(weights["state_dict"][name], value), name
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
def test_the_zero1_strategys_load_gives_this_ranks_chunks_and_only_in_that_call(
    sharded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ZeRO-1 strategy's load passes its rank and world size to its checkpoint IO for that call only
    (`DataParallelCore.load_checkpoint`, `NeuronCheckpointIO.reading_shard`): rank 1 of 2 gets its half of each
    moment (a chunk marker, which `load_state_dict` takes as it is), and the same IO outside the call the full
    state."""
    from lightning_trn.pytorch.strategies import NeuronDDPStrategy

    strategy = NeuronDDPStrategy(zero1=True, state_dict_type="sharded")
    monkeypatch.setattr(NeuronDDPStrategy, "global_rank", property(lambda self: 1))
    monkeypatch.setattr(NeuronDDPStrategy, "world_size", property(lambda self: 2))

    def moments(checkpoint: dict) -> list[tuple[int | None, int]]:
        """Each parameter's first moment: (its rank, its elements) for a chunk marker, (None, elements) in full."""
        states = [state["exp_avg"] for state in checkpoint["optimizer_states"][0]["state"].values()]
        return [(m["rank"], m[CHUNK].numel()) if isinstance(m, dict) else (None, m.numel()) for m in states]

    chunks = moments(strategy.load_checkpoint(sharded / "final.ckpt"))
    assert chunks == [(1, math.ceil(n / 2)) for n in NUMELS]
    assert moments(strategy.checkpoint_io.load_checkpoint(sharded / "final.ckpt")) == [(None, n) for n in NUMELS]


@pytest.mark.slow
# one direction per suite (CI time): the state-dict hooks that re-shard are host code shared by both backends
@pytest.mark.parametrize(
    "direction",
    [
        pytest.param("2->1", marks=pytest.mark.xla_only),
        pytest.param("1->2", marks=pytest.mark.native_only),
        pytest.param("2->2", marks=pytest.mark.native_only),
    ],
)
@pytest.mark.numerics
def test_resume_on_another_world_size_ends_like_the_uninterrupted_run(
    tmp_path: Path, reference: Path, exact: dict, sharded: Path, direction: str
) -> None:
    """A sharded checkpoint (a directory) from step 3 of the ZeRO-1 run resumes on one unsharded process, and a file
    from the unsharded run on two sharded ones (which write full checkpoints); both end where the uninterrupted run
    ends. So does the sharded checkpoint on two sharded processes, each rank reading only its own chunk file."""
    if direction == "2->1":
        out = _launch(tmp_path, "--resume", str(sharded / "step=3.ckpt"))
    elif direction == "1->2":
        out = _zero1(tmp_path, "--resume", str(reference / "step=3.ckpt"))
    else:
        out = _zero1(tmp_path, "--resume", str(sharded / "step=3.ckpt"), "--state-dict-type", "sharded")
    _assert_same_training_state(_checkpoint(out / "final.ckpt"), _checkpoint(reference / "final.ckpt"), exact)


@pytest.mark.slow
# plain DDP's Fabric clipping is backend-independent host logic: checked in the native suite only (CI time)
@pytest.mark.parametrize("strategy", ["neuron_zero1", pytest.param("neuron_ddp", marks=pytest.mark.native_only)])
@pytest.mark.numerics
def test_fabric_loop_on_two_processes_ends_like_the_trainer_on_one_process(
    tmp_path: Path, reference: Path, exact: dict, strategy: str
) -> None:
    """The job as a Fabric loop on 2 processes, saved with `fabric.save`. `fabric.clip_gradients` clips the gradients
    averaged over the ranks (ZeRO-1: by the norm over both ranks' chunks), as one process does."""
    out = _launch(tmp_path, "--api", "fabric", "--devices", "2", "--strategy", strategy)
    reference_state = _checkpoint(reference / "final.ckpt")
    _assert_same_training_state(_checkpoint(out / "final.ckpt"), reference_state, exact, "optimizer")
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
    stochastically rounded; the checkpoint's state (`optimizer_state`) carries the masters and `load_state_dict` puts
    them back exactly."""
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
    saved = optimizer_state(optimizer)
    torch.testing.assert_close(saved["state"][0][MASTER_WEIGHT], masters[0].view(3, 5), atol=0, rtol=0)

    restored_model = _linear(torch.bfloat16)
    restored_model.load_state_dict(model.state_dict())
    restored = torch.optim.Adam(restored_model.parameters(), lr=1e-3)
    _shard(restored).optimizer.load_state_dict(saved)
    for master, shard in zip(masters, (p for group in restored.param_groups for p in group["params"]), strict=True):
        torch.testing.assert_close(shard.detach().cpu(), master, atol=0, rtol=0)
    restored_state = optimizer_state(restored)["state"][0][MASTER_WEIGHT]
    torch.testing.assert_close(restored_state, masters[0].view(3, 5), atol=0, rtol=0)


def test_sharding_an_optimizer_that_stepped_keeps_its_state(one_rank_group: None) -> None:
    """An optimizer sharded after it stepped (state keyed by the module's parameters) keeps that state: the
    checkpoint's state (`optimizer_state`) is the unsharded one, and so is its next step; the optimizer's own
    `state_dict()` is its chunks, gathered by nothing (no collective)."""
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
    # the same gradients, the same elementwise Adam step on flat padded chunks: at most the last-bit rounding of
    # another vectorised or fused evaluation, an ulp of the weights and moments (< 0.7: <= 6e-8)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-7, rtol=0)
    gathered = optimizer_state(optimizer)
    for index, state in plain.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(gathered["state"][index][key].cpu(), value.cpu(), atol=1e-7, rtol=0)
    assert optimizer.state_dict()["state"][0]["exp_avg"].shape == (15,)  # the 3 x 5 weight's one chunk


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
    # the norm of 18 gradients summed in another grouping, a few ulps (eps 1.2e-7) off, scales clipped gradients of
    # at most 0.5 / sqrt(6) = 0.2 (6 equal entries per output): ~6e-8 apart
    for mine, theirs in zip(clipped, twin.parameters(), strict=True):
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
    # Adam's first step moves w by lr x cg / (|cg| + 1e-8), blind to the clip factor c's rounding (|cg| >> 1e-8): the
    # weights differ by their last-bit rounding (< 0.7: <= 6e-8)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
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


# -- host memory of checkpoints ----------------------------------------------------------------------------------------

MEMORY_SCRIPT = Path(__file__).parents[1] / "scripts" / "zero1_host_memory.py"
#: parameters of the memory runs' model: 64 MB of Adam moments, the state that dominates a rank's host memory
MEMORY_NUMEL = 8_000_000
#: the script's BUCKET_BYTES: what a rank sends to rank 0 at a time in a full save
MEMORY_BUCKET = 2 * 1024 * 1024
MIB = 1024 * 1024
#: file pages the kernel maps around the pages a memory-mapped read touches, per state tensor read (about 1.3 MiB
#: measured on this machine's filesystem)
READ_AROUND = 2 * MIB


def _memory_run(world_size: int, out: Path, *load: Path) -> list[dict]:
    """The script's records from `world_size` gloo processes; freed tensors go back to the system at once (the script
    fixes glibc's mmap threshold), so a phase's peak does not depend on the heap the phases before it left."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    port = str(find_free_network_port())
    command = [
        sys.executable,
        str(MEMORY_SCRIPT),
        "--out",
        str(out),
        "--numel",
        str(MEMORY_NUMEL),
        "--load",
        *map(str, load),
    ]
    children = [
        subprocess.Popen(
            command,
            env=child_env(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    records = []
    for child in children:
        stdout, stderr = child.communicate(timeout=RUN_TIMEOUT_S)
        assert child.returncode == 0, stderr[-3000:]
        records += [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("HOST_MEMORY")]
    return records


@pytest.mark.slow
# host code only (gloo, CPU tensors): checked in the native suite, whose interpreters start faster
@pytest.mark.native_only
def test_checkpoint_host_peak_per_rank_is_its_share_of_the_state(tmp_path: Path) -> None:
    """Each rank's host peak (`VmHWM`, i.e. `ru_maxrss`, of one phase, less its resident set before the optimizer
    was sharded) while saving and loading ZeRO-1 checkpoints, at 2 and 4 ranks, with 64 MB of Adam moments: at most
    what the rank holds (its fp32 chunks and moments, 12 bytes per parameter / N), what a load reads (its moments,
    8 / N), 2 buckets and the fixed overhead of the same phase on a 30 k-parameter model; so it halves from 2 to 4
    ranks. Rank 0 of a full save also holds the whole gathered state, N buckets at a time. Every load, also of the
    other world size's checkpoints, gives each rank exactly the moments that the saving ranks held."""
    records = _memory_run(2, tmp_path)
    records += _memory_run(4, tmp_path, tmp_path / "full-2.ckpt", tmp_path / "sharded-2")
    assert all(record["mismatches"] == 0 for record in records)
    peaks: dict[str, dict[tuple[str, int, int, int], int]] = {"baseline": {}, "measured": {}}
    for record in records:
        # "load:sharded-2" -> ("load-sharded", saved at 2); a save "saves" at its own world size
        kind, _, saved = record["phase"].replace(":", "-").rpartition("-")
        kind, saved = (kind, int(saved.split(".")[0])) if kind.startswith("load") else (record["phase"], 0)
        key = (kind, saved or record["world_size"], record["world_size"], record["rank"])
        peaks[record["model"]][key] = record["peak_kb"] * 1024
    measured, baseline = peaks["measured"], peaks["baseline"]
    assert len(measured) == 2 * 4 + 4 * 6
    sizes = next(record["sizes"] for record in records if record["model"] == "measured")
    for (kind, saved, world_size, rank), peak in measured.items():
        chunks = sum(math.ceil(size / world_size) for size in sizes)
        bound = 12 * chunks + 2 * MEMORY_BUCKET + baseline[kind, world_size, world_size, rank]
        if kind.startswith("load"):  # the memory-mapped pages of its moments, read once
            bound += 8 * chunks + READ_AROUND * 2 * len(sizes)
        if kind == "save-full" and rank == 0:
            bound += 8 * sum(sizes) + world_size * MEMORY_BUCKET
        assert peak <= bound, f"{kind} ({saved}) on {world_size}, rank {rank}: {peak / MIB:.1f} MiB > {bound / MIB:.1f}"
    # the sharded share dominates: a figure at 4 ranks is about half the one at 2 (the overheads are fixed)
    for (kind, saved, world_size, rank), peak in measured.items():
        if saved == world_size == 4 and not (kind == "save-full" and rank == 0):
            allowed = measured[kind, 2, 2, rank % 2] / 2 + 2 * MEMORY_BUCKET + max(baseline.values())
            assert peak <= allowed, f"{kind} on 4, rank {rank}: {peak / MIB:.1f} MiB > {allowed / MIB:.1f}"


# -- which optimizers are sharded --------------------------------------------------------------------------------------


class _PerTensorNorm(torch.optim.Optimizer):
    """A LAMB-like update: each step scaled by the whole tensor's norm, which a chunk does not have."""

    def __init__(self, params, lr: float = 0.1) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad / (p.grad.norm() + 1e-6), alpha=-group["lr"])


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad"])
def test_element_wise_torch_optimizers_are_sharded(name: str) -> None:
    optimizer = getattr(torch.optim, name)(torch.nn.Linear(5, 3).parameters(), lr=0.1)
    assert sharding_of(_shard(optimizer).optimizer) is not None


def test_lion_is_sharded_by_its_class_name() -> None:
    """lion-pytorch's `Lion` (not installed here: a class of that name stands in for it)."""
    lion = type("Lion", (torch.optim.SGD,), {})
    assert sharding_of(_shard(lion(torch.nn.Linear(5, 3).parameters(), lr=0.1)).optimizer) is not None


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.LBFGS(params),
        lambda params: torch.optim.SparseAdam(params),
        lambda params: _PerTensorNorm(params),
        # a subclass may override `step`: not trusted because its base is
        lambda params: type("MyAdam", (torch.optim.Adam,), {})(params),
    ],
    ids=["LBFGS", "SparseAdam", "per-tensor-norm", "Adam-subclass"],
)
def test_other_optimizers_are_refused_with_the_opt_in_named(make) -> None:  # type: ignore[no-untyped-def]
    optimizer = make(torch.nn.Linear(5, 3).parameters())
    with pytest.raises(ValueError, match=r"ZeRO-1 does not shard .*allow_zero1_optimizer\(") as error:
        _shard(optimizer)
    assert type(optimizer).__name__ in str(error.value) and "zero1=False" in str(error.value)
    assert sharding_of(optimizer) is None


def test_an_optimizer_registered_as_element_wise_is_sharded(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_trn.core.parallel import zero1

    monkeypatch.setattr(zero1, "_ALLOWED", set())
    element_wise = type("SignSGD", (_PerTensorNorm,), {})
    with pytest.raises(ValueError, match="does not shard"):
        _shard(element_wise(torch.nn.Linear(5, 3).parameters()))
    zero1.allow_zero1_optimizer(element_wise)
    assert sharding_of(_shard(element_wise(torch.nn.Linear(5, 3).parameters())).optimizer) is not None
    with pytest.raises(ValueError, match="does not shard"):  # the registration is for that class only
        _shard(_PerTensorNorm(torch.nn.Linear(5, 3).parameters()))


# -- gradients reduced in fp32 -----------------------------------------------------------------------------------------

#: simulated data-parallel ranks (the trn2-8b preset's count)
SIMULATED_RANKS = 64


class _SimulatedReduceScatter(HostCollectives):
    """Rank 0 of `SIMULATED_RANKS`: `reduce_scatter` adds 63 other ranks' rows (this rank's, scaled by seeded factors
    near 1 and rounded to bf16, as bf16 gradients are) in the dtype it receives, one rank after another as a ring
    does, and records that dtype and the exact (float64) average."""

    def __init__(self) -> None:
        super().__init__(world_size=SIMULATED_RANKS)
        self.dtypes: list[torch.dtype] = []
        self.exact: list[torch.Tensor] = []

    def reduce_scatter(self, rows: torch.Tensor) -> torch.Tensor:
        self.dtypes.append(rows.dtype)
        factors = 1 + torch.rand(SIMULATED_RANKS, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        contributions = [(rows.double() * factor).bfloat16().to(rows.dtype) for factor in factors]
        contributions[0] = rows
        total = contributions[0][0].clone()
        for contribution in contributions[1:]:
            total += contribution[0]
        self.exact.append(torch.stack([c[0].double() for c in contributions]).mean(0))
        return total / SIMULATED_RANKS


def _relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return float((value.double() - exact).norm() / exact.norm())


def test_bf16_gradients_are_reduce_scattered_in_fp32() -> None:
    """bf16 parameters (bf16-true): the chunks' gradients are the 64-rank average to fp32 accuracy because the
    collective receives fp32 rows; the same reduction in bf16 would be off by about 1e-2."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    collectives = _SimulatedReduceScatter()
    sharding = Zero1Sharding(torch.optim.AdamW(model.parameters()), collectives, collectives, 0, torch.Tensor.to)
    for param in model.parameters():
        param.grad = (torch.rand_like(param, dtype=torch.float32) + 0.5).bfloat16()
    sharding.reduce_gradients()
    assert collectives.dtypes == [torch.float32]
    reduced = torch.cat([p.grad for group in sharding.optimizer.param_groups for p in group["params"]])
    assert reduced.dtype == torch.float32
    assert _relative_error(reduced, collectives.exact[0]) < 1e-5
    # what a bf16 reduce-scatter of the same contributions gives: the bound above is not met by chance
    in_bf16 = collectives.reduce_scatter(collectives.exact[0].view(1, -1).expand(SIMULATED_RANKS, -1).bfloat16())
    assert _relative_error(in_bf16, collectives.exact[1]) > 3e-3
