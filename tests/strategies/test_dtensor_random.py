"""Random ops on DTensors on the `neuron` device (`lightning_trn.core.parallel.dtensor_random`), on the stand-in.

`tests/scripts/tp_init_weights_train.py` has the shape of Lightning's `examples/pytorch/tensor_parallel`:
a Llama-like model parallelized in `configure_model` (TorchTitan's plan, FSDP2 over the data-parallel mesh), its
`init_weights()` in `on_train_start` (random ops on DTensors, which killed every `neuron` rank in torch's offset-based
tracker), `loss_parallel`; dp 2 x tp 2 on 4 processes, once on `neuron` and once as Lightning's own run on the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from itertools import combinations
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import _random as torch_random

from lightning_trn.core.parallel import dtensor_random
from tests.launch import child_env
from tests.standin.fake_group import fake_process_group

pytestmark = pytest.mark.native_only

SCRIPT = Path(__file__).parents[1] / "scripts" / "tp_init_weights_train.py"
RUN_TIMEOUT_S = 400


def _run(out: Path, accelerator: str) -> dict:
    """One launch of the script (4 processes): rank 0's record and every rank's."""
    command = [sys.executable, str(SCRIPT), "--accelerator", accelerator, "--out", str(out)]
    result = subprocess.run(
        command,
        env=child_env(LIGHTNING_TRN_STANDIN_DEVICES="4"),
        cwd=out,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    run["ranks"] = [torch.load(out / f"rank{rank}.pt") for rank in range(4)]
    return run


@pytest.fixture(scope="module")
def neuron(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tmp_path_factory.mktemp("neuron"), "neuron")


@pytest.fixture(scope="module")
def cpu(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tmp_path_factory.mktemp("cpu"), "cpu")


def test_init_weights_after_parallelization_trains_as_lightning_on_cpu(neuron: dict, cpu: dict) -> None:
    """The example's job runs on `neuron` and tracks Lightning's CPU run. The two inits are different draws (the CPU
    one repeats the same values on every shard, see below), which the loss of this model shows to about 0.04."""
    assert (neuron["strategy"], cpu["strategy"]) == ("NeuronModelParallelStrategy", "ModelParallelStrategy")
    assert len(neuron["losses"]) == len(cpu["losses"]) == 6
    torch.testing.assert_close(torch.tensor(neuron["losses"]), torch.tensor(cpu["losses"]), atol=0.05, rtol=0)


@pytest.mark.parametrize("name, std", [("wq", 0.02), ("embedding", 1.0)])
def test_shards_of_an_initialized_weight_are_independent_draws(neuron: dict, cpu: dict, name: str, std: float) -> None:
    """Every rank holds a different shard of these weights (dp x tp); each shard is a fresh draw from the init's
    distribution. torch on the CPU (no tracker there) draws every shard from the rank's own, alike-seeded generator:
    copies, which is what the rule prevents."""
    shards = [rank[name] for rank in neuron["ranks"]]
    for first, second in combinations(shards, 2):
        assert first.shape == second.shape
        assert not torch.equal(first, second)
        assert abs(torch.corrcoef(torch.stack((first.flatten(), second.flatten())))[0, 1]) < 0.1
    # a sample std over n >= 1024 draws (wq's shard: 64 x 64 / 4) has relative standard error 1/sqrt(2n) <= 2.2%:
    # 0.1 is 4.5 of them (the embedding's 8192 draws: 13)
    for shard in shards:
        assert shard.std().item() == pytest.approx(std, rel=0.1)
    assert all(torch.equal(rank[name], cpu["ranks"][0][name]) for rank in cpu["ranks"])


@pytest.mark.parametrize("op", ["normal", "dropout", "user_generator"])
def test_replicas_draw_alike_and_shards_apart(neuron: dict, op: str) -> None:
    """A (Replicate over data_parallel, Shard over tensor_parallel) DTensor: ranks with the same tensor-parallel
    coordinate hold the same shard and draw the same values; the two shards differ."""
    by_shard: dict[int, list[torch.Tensor]] = {}
    for rank in neuron["ranks"]:
        by_shard.setdefault(rank["coordinate"][1], []).append(rank[op])
    assert sorted(by_shard) == [0, 1]
    for replicas in by_shard.values():
        assert len(replicas) == 2 and torch.equal(*replicas)
    assert not torch.equal(by_shard[0][0], by_shard[1][0])


def test_generators_stay_in_step_and_torch_tracker_comes_back(neuron: dict) -> None:
    """After the random ops every rank's device generator (and the user's generator) is in the same state, so the
    next op is again consistent across ranks; at teardown torch's tracker (none) is back."""
    for key in ("device_state", "user_generator_state"):
        assert len({rank[key] for rank in neuron["ranks"]}) == 1
    assert neuron["tracker_restored"]


def test_dropout_on_a_plain_tensor_under_tensor_parallel_is_refused(neuron: dict, cpu: dict) -> None:
    """`nn.Dropout` on a local tensor would draw the same mask on every tensor-parallel rank: refused (one
    paragraph); on a DTensor it ran (the `dropout` record above). Lightning's CPU run has no such check."""
    assert all(rank["plain_dropout_refused"] for rank in neuron["ranks"])
    assert not any(rank["plain_dropout_refused"] for rank in cpu["ranks"])


@pytest.fixture
def neuron_tracker(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The rule in place of torch's tracker (as during a Neuron run), in a 4-rank fake process group."""
    with fake_process_group(4):
        monkeypatch.setattr(torch_random, "_rng_tracker", dtensor_random.neuron_rng_tracker("neuron", None))
        yield torch_random._rng_tracker


def _draw_as(
    mesh: object, coordinate: tuple[int, int], op: Callable[[DTensor], torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> torch.Tensor:
    """`op` on a (Replicate, Shard(0)) DTensor as the rank at `coordinate` of a (dp 2, tp 2) mesh runs it."""
    monkeypatch.setattr(mesh, "get_coordinate", lambda: list(coordinate))
    x = DTensor.from_local(torch.zeros(4, 3, device="neuron"), mesh, [Replicate(), Shard(0)], run_check=False)
    return op(x).to_local().cpu()


def test_rule_in_one_process(neuron_tracker: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the 4-process run shows, for each rank of a (dp 2, tp 2) `neuron` mesh played in turn: replicas draw
    alike and shards apart, the generator ends in one state whatever the shard, the same seed gives the same values
    and the next op new ones; a user's generator is consumed and the device's left as it was."""
    mesh = init_device_mesh("neuron", (2, 2), mesh_dim_names=("dp", "tp"))
    coordinates = [(0, 0), (0, 1), (1, 0), (1, 1)]
    draws, states = {}, []
    for coordinate in coordinates:
        torch.neuron.manual_seed(5)
        draws[coordinate] = _draw_as(mesh, coordinate, lambda x: x.normal_(), monkeypatch)
        states.append(torch.neuron.get_rng_state())
        assert not torch.equal(_draw_as(mesh, coordinate, lambda x: x.normal_(), monkeypatch), draws[coordinate])
    assert torch.equal(draws[0, 0], draws[1, 0]) and torch.equal(draws[0, 1], draws[1, 1])
    assert not torch.equal(draws[0, 0], draws[0, 1])
    assert all(torch.equal(state, states[0]) for state in states)

    torch.neuron.manual_seed(5)
    device_state = torch.neuron.get_rng_state()
    generator = torch.Generator("neuron").manual_seed(5)
    with_generator = _draw_as(mesh, (0, 0), lambda x: x.normal_(generator=generator), monkeypatch)
    assert torch.equal(with_generator, draws[0, 0])  # the same state, whichever generator holds it
    assert torch.equal(torch.neuron.get_rng_state(), device_state)
    assert not torch.equal(generator.get_state(), torch.Generator("neuron").manual_seed(5).get_state())


def test_other_devices_keep_torchs_behaviour(neuron_tracker: object) -> None:
    """A CPU mesh during a Neuron run: the random ops draw what they draw without the rule (torch has no tracker
    for the CPU)."""
    mesh = init_device_mesh("cpu", (4,))

    def draw() -> list[torch.Tensor]:
        torch.manual_seed(3)
        x = distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)], src_data_rank=None)
        return [x.normal_().to_local().clone(), F.dropout(x.fill_(1.0), 0.5).to_local()]

    with_rule = draw()
    torch_random._rng_tracker = None
    assert all(torch.equal(a, b) for a, b in zip(with_rule, draw(), strict=True))


class _Mesh:
    def __init__(self, tensor_parallel: int) -> None:
        self.tensor_parallel = tensor_parallel

    def __getitem__(self, name: str) -> _Mesh:
        assert name == "tensor_parallel"
        return self

    def size(self) -> int:
        return self.tensor_parallel


class _Strategy:
    def __init__(self, tensor_parallel: int) -> None:
        self.device_mesh = _Mesh(tensor_parallel)


def test_dropout_refusal_applies_to_tensor_parallel_training_only() -> None:
    model = nn.Sequential(nn.Dropout(0.1), nn.Dropout(0.0))
    dtensor_random.refuse_local_dropout(model, _Strategy(tensor_parallel=1))
    model(torch.ones(3))
    dtensor_random.refuse_local_dropout(model, _Strategy(tensor_parallel=2))
    with pytest.raises(RuntimeError, match="same mask"):
        model(torch.ones(3))
    model.eval()
    model(torch.ones(3))
    assert not model[1]._forward_pre_hooks  # p=0 draws nothing


def test_rule_only_on_tested_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native backend gets the tracker on the torch it was tested on; another torch keeps torch's own."""
    tracker = dtensor_random.tracker_for_neuron_run(None)
    assert tracker is not None and tracker.previous is None
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    assert dtensor_random.tracker_for_neuron_run(None) is None
