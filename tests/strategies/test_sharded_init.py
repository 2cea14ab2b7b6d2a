"""How a sharded model gets its initial values on 2 stand-in `neuron` devices (`scripts/sharded_init.py`, Fabric's
`ModelParallelStrategy(parallelize_fn)` with a sharded, a replicated and a plain layer).

Each rank's device receives only its shards and what is not sharded: built on the meta device (materialized from
the host's draws, or read from a seed checkpoint without drawing) or on the host (sharded before anything moves).
The bytes copied host->device, the allocator's peak and what the rank holds are equal, about half of the model, and
the weights are the eager build's bit for bit. Replicated and plain tensors are the first rank's on every rank even
when the ranks' generators diverged before the model was built. From a seed checkpoint each rank reads exactly the
bytes it holds: on the 2 processes, and on each rank of a dp 2 x tp 2 mesh played in turn in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_trn.core.parallel.model_parallel import local_block, materialize, write_seed_checkpoint
from tests.launch import child_env
from tests.standin.fake_group import fake_process_group
from tests.standin.safetensors_reads import counting_reads

pytestmark = pytest.mark.native_only

SCRIPT = Path(__file__).parents[1] / "scripts" / "sharded_init.py"
RUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("sharded_init")
    env = child_env(LIGHTNING_TRN_STANDIN="1", LIGHTNING_TRN_STANDIN_DEVICES="2")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        env=env,
        cwd=out,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"run-{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("phase", ["meta", "host", "seed"])
def test_each_rank_receives_only_its_shards_and_the_eager_weights(runs: list[dict], phase: str) -> None:
    """`meta`: materialized from full-size host draws, each rank copying its slice; `host`: a host-built model sharded
    on its meta twin, then its values' slices copied; `seed`: a seed checkpoint, each rank reading only its blocks of
    the file (no draw at all: `reset_parameters` raises, and the model was built with another seed)."""
    for rank, run in enumerate(runs):
        record = run[phase]
        assert record["equals_reference"], (rank, phase)
        assert record["host_to_device_bytes"] == record["resident_bytes"], (rank, record)
        assert record["peak_bytes"] == record["resident_bytes"], (rank, record)
        # the sharded layer halves; the replicated and the plain ones are whole on both ranks
        assert record["resident_bytes"] < 0.52 * run["full_bytes"], (rank, record, run["full_bytes"])
    if phase == "seed":  # each rank reads from the file what it holds: its half of the sharded layer
        assert all(run["seed"]["read_bytes"] == run["seed"]["resident_bytes"] for run in runs), runs


def test_replicated_and_plain_tensors_are_the_first_ranks_after_generators_diverged(runs: list[dict]) -> None:
    """Rank 1 drew one more random number before building the model: the replicated (HSDP / NO_SHARD layout) and
    the plain layer's tensors are rank 0's on both ranks after `setup_module`."""
    for run in runs:
        assert run["diverged"]["agree"] == {
            "replica.weight": True,
            "replica.bias": True,
            "plain.weight": True,
            "plain.bias": True,
        }


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


class _WithBuffers(torch.nn.Module):
    """A layer and a non-persistent buffer (not in `state_dict()`, as the rotary `inv_freq` of Llama models)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def reset_parameters(self) -> None:
        self.table.copy_(torch.arange(4.0))


def test_seed_checkpoint_holds_non_persistent_buffers_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    """In one process (what the Trainer's strategy calls on its LightningModule): a meta-built module materialized
    from the seed checkpoint equals the factory's build without drawing, also with activation checkpointing wrappers
    in its names; entries the file lacks or holds in other shapes are an error, and so is a directory without the file
    (a DCP seed directory of an earlier version)."""

    def build() -> torch.nn.Module:
        torch.manual_seed(3)
        return _WithBuffers()

    write_seed_checkpoint(build, tmp_path / "seed")
    with torch.device("meta"):
        module = _WithBuffers()
    state = torch.random.get_rng_state()
    materialize(module, torch.device("cpu"), seed_checkpoint=tmp_path / "seed")
    assert torch.equal(torch.random.get_rng_state(), state)  # nothing drawn
    loaded, reference = _tensors(module), _tensors(build())
    assert loaded.keys() == reference.keys() == {"layer.weight", "layer.bias", "table"}
    assert all(torch.equal(loaded[name], value) for name, value in reference.items())
    with torch.device("meta"):
        wrapped = _WithBuffers()  # its layer checkpoint-wrapped after the file was written: the names differ
    apply_activation_checkpointing(wrapped, check_fn=lambda submodule: isinstance(submodule, torch.nn.Linear))
    materialize(wrapped, torch.device("cpu"), seed_checkpoint=tmp_path / "seed")
    assert torch.equal(wrapped.layer._checkpoint_wrapped_module.weight, reference["layer.weight"])
    with torch.device("meta"):
        bigger = torch.nn.Sequential(_WithBuffers())
    with pytest.raises(ValueError, match=r"has no 0\.layer\.bias, 0\.layer\.weight, 0\.table \(3 of"):
        materialize(bigger, torch.device("cpu"), seed_checkpoint=tmp_path / "seed")
    with torch.device("meta"):
        wider = _WithBuffers()
        wider.layer = torch.nn.Linear(8, 5)
    with pytest.raises(ValueError, match=r"shapes stored vs the module's: layer\.weight \[4, 8\] vs \[5, 8\]"):
        materialize(wider, torch.device("cpu"), seed_checkpoint=tmp_path / "seed")
    with torch.device("meta"):
        module = _WithBuffers()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors: write it with `write_seed_checkpoint`"):
        materialize(module, torch.device("cpu"), seed_checkpoint=tmp_path)


class _Tower(torch.nn.Module):
    """Sizes that split unevenly over 2 and 4 (66 rows: 33 per tensor-parallel rank, then 17 and 16), a norm left
    whole by tensor parallelism, a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(24, 66)
        self.down = torch.nn.Linear(66, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.register_buffer("table", torch.arange(5.0), persistent=False)


def _tower_reference() -> torch.nn.Module:
    torch.manual_seed(5)
    return _Tower()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def test_seed_checkpoint_each_of_4_ranks_reads_only_its_blocks(tmp_path: Path) -> None:
    """Each rank of a (data parallel 2 x tensor parallel 2) mesh, played in turn in this process (a fake process
    group as that rank), reads from the seed checkpoint exactly the bytes it holds (counted at
    `safetensors.safe_open`): its blocks of the column-wise, row-wise and FSDP2-sharded (`_StridedShard`) tensors and
    the whole buffer, about a quarter of the model, and those blocks hold the reference build's values."""
    write_seed_checkpoint(_tower_reference, tmp_path / "seed")
    reference = {name: tensor.detach() for name, tensor in _tensors(_tower_reference()).items()}
    full_bytes = sum(tensor.nbytes for tensor in reference.values())
    read = []
    for rank in range(4):
        with fake_process_group(4, rank=rank):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
            with torch.device("meta"):
                model = _Tower()
            parallelize_module(model, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(model, mesh=mesh["data_parallel"])
            with counting_reads() as reads:
                materialize(model, torch.device("cpu"), seed_checkpoint=tmp_path / "seed")
            held = _tensors(model)
            assert reads.bytes == sum(_local(tensor).nbytes for tensor in held.values()), rank
            for name, tensor in held.items():
                block = reference[name][local_block(tensor.shape, tensor)]
                assert torch.equal(_local(tensor).detach(), block), (rank, name)
            read.append(reads.bytes)
    assert max(read) < 0.3 * full_bytes, (read, full_bytes)  # a quarter of the matrices, the norm's half
