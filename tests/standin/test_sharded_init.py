"""How a sharded model gets its initial values on 2 stand-in `neuron` devices (`scripts/sharded_init.py`, Fabric's
`ModelParallelStrategy(parallelize_fn)` with a sharded, a replicated and a plain layer).

Each rank's device receives only its shards and what is not sharded: built on the meta device (materialized from
the host's draws, or read from a seed checkpoint without drawing) or on the host (sharded before anything moves).
The bytes copied host->device, the allocator's peak and what the rank holds are equal, about half of the model, and
the weights are the eager build's bit for bit. Replicated and plain tensors are the first rank's on every rank even
when the ranks' generators diverged before the model was built.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_trn.core.model_parallel import materialize, write_seed_checkpoint
from tests.launch import child_env

pytestmark = pytest.mark.native_only

SCRIPT = Path(__file__).parent / "scripts" / "sharded_init.py"
RUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("sharded_init")
    env = child_env(LIGHTNING_TRN_STANDIN="1", LIGHTNING_TRN_STANDIN_DEVICES="2")
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], env=env, cwd=out,
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"run-{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("phase", ["meta", "host", "seed"])
def test_each_rank_receives_only_its_shards_and_the_eager_weights(runs: list[dict], phase: str) -> None:
    """`meta`: materialized from full-size host draws, each rank copying its slice; `host`: a host-built model sharded
    on its meta twin, then its values' slices copied; `seed`: a seed checkpoint read through DCP (no draw at all:
    `reset_parameters` raises, and the model was built with another seed)."""
    for rank, run in enumerate(runs):
        record = run[phase]
        assert record["equals_reference"], (rank, phase)
        assert record["host_to_device_bytes"] == record["resident_bytes"], (rank, record)
        assert record["peak_bytes"] == record["resident_bytes"], (rank, record)
        # the sharded layer halves; the replicated and the plain ones are whole on both ranks
        assert record["resident_bytes"] < 0.52 * run["full_bytes"], (rank, record, run["full_bytes"])


def test_replicated_and_plain_tensors_are_the_first_ranks_after_generators_diverged(runs: list[dict]) -> None:
    """Rank 1 drew one more random number before building the model: the replicated (HSDP / NO_SHARD layout) and
    the plain layer's tensors are rank 0's on both ranks after `setup_module`."""
    for run in runs:
        assert run["diverged"]["agree"] == {"replica.weight": True, "replica.bias": True, "plain.weight": True,
                                            "plain.bias": True}


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


def test_seed_checkpoint_holds_non_persistent_buffers_and_refuses_missing_entries(tmp_path: Path) -> None:
    """In one process (what the Trainer's strategy calls on its LightningModule): a meta-built module materialized
    from the seed checkpoint equals the factory's build without drawing; an entry the directory lacks is an error."""
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
        bigger = torch.nn.Sequential(_WithBuffers())
    with pytest.raises(ValueError, match=r"has no 0\.layer\.bias, 0\.layer\.weight, 0\.table \(3 of"):
        materialize(bigger, torch.device("cpu"), seed_checkpoint=tmp_path / "seed")
