"""Pipeline parallelism and HSDP on the stand-in: `NeuronModelParallelStrategy(pipeline_parallel_size=...,
replicate_size=...)`, Trainer and Fabric.

`tests/scripts/pipeline_train.py` trains a 4-block token model (AdamW, active clipping, accumulation 2, a per-step
schedule, 8 sequences per optimizer step on every layout). Each layout must end where the unsplit model ends under
Lightning's own `ModelParallelStrategy` on the CPU in one process: every schedule (GPipe, 1F1B, Interleaved1F1B with 2
stages per rank, ZBVZeroBubble), pipeline x FSDP2 and pipeline x tensor parallel on 4 ranks, HSDP 2 x 2. The
pipeline x FSDP2 job (GPipe) is killed (SIGKILL) right after its checkpoint of step 3 and resumed without stages: it
ends where the uninterrupted run ends. Stage tensors travel as broadcasts in 2-rank groups (the stand-in refuses
send/recv, as TorchNeuron's source snapshot has none).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_trn.core.checkpoint.distributed_checkpoint import write_consolidated
from lightning_trn.core.parallel import pipeline
from lightning_trn.core.parallel.parallel_dims import ParallelDims
from lightning_trn.core.parallel.stage_transport import ring_pairs
from tests.launch import child_env, run_job
from tests.tolerance import assert_losses_match, assert_weights_match, losses_error, weights_error

pytestmark = [pytest.mark.native_only, pytest.mark.slow, pytest.mark.numerics]

SCRIPT = Path(__file__).parents[1] / "scripts" / "pipeline_train.py"
DOCS = Path(__file__).parents[2] / "docs" / "sharding.md"
RUN_TIMEOUT_S = 240


def _run(out: Path, *args: str, killed: bool = False) -> dict:
    """Run the script (Lightning or Fabric launches its processes); rank 0's record and the gathered weights.
    `killed`: the job must end by its own SIGKILL (`--kill`, `tests.launch.run_job`); it leaves no record."""
    env = child_env(LIGHTNING_TRN_STANDIN_DEVICES="4")
    run_job(SCRIPT, out, "--out", str(out), *args, env=env, killed=killed, timeout=RUN_TIMEOUT_S)
    if killed:
        return {}
    return {**json.loads((out / "run.json").read_text()), "weights": torch.load(out / "weights.pt")}


def _assert_same_weights(run: dict, reference: dict) -> None:
    """Within the tolerance tests/tolerance.py derives from the reference's own float32 error."""
    error = weights_error(reference["weights"], reference["float64"]["weights"])
    assert_weights_match(run["weights"], reference["weights"], error)


def _assert_same(run: dict, reference: dict, key: str) -> None:
    error = losses_error(reference[key], reference["float64"][key])
    assert_losses_match(run[key], reference[key], error, what=key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The unsplit model under Lightning's own ModelParallelStrategy on the CPU, one process; under `float64`, the
    same run in float64 (the model cast to float64), which measures the float32 run's own rounding error."""
    arguments = ("--accelerator", "cpu", "--validate", "--predict")
    run = _run(tmp_path_factory.mktemp("reference"), *arguments)
    return {**run, "float64": _run(tmp_path_factory.mktemp("reference64"), *arguments, "--float64")}


def test_1f1b_equals_the_unsplit_run(tmp_path: Path, reference: dict) -> None:
    """2 stages on 2 ranks, 1F1B, with validation and `trainer.predict`: the loss of every batch (reported from the
    last stage to rank 0), the validation losses and the predictions (forward-only schedule; the last stage's logits
    handed to rank 0) and the final weights of both stages."""
    run = _run(tmp_path, "--pp", "2", "--validate", "--predict")
    _assert_same(run, reference, "losses")
    _assert_same(run, reference, "val_losses")
    assert len(run["predictions"]) == 2
    _assert_same(run, reference, "predictions")
    assert len(run["val_losses"]) == 4  # two validation runs of 2 batches
    _assert_same_weights(run, reference)


@pytest.mark.parametrize(
    ("layout", "arguments"),
    [
        ("pp2 x tp2, Interleaved1F1B", ["--pp", "2", "--tp", "2", "--schedule", "Interleaved1F1B"]),
        ("hsdp 2 x 2", ["--replicate", "2", "--dp", "2"]),
        ("fabric pp2, ZBVZeroBubble", ["--api", "fabric", "--pp", "2", "--schedule", "ZBVZeroBubble"]),
    ],
)
def test_layout_equals_the_unsplit_run(tmp_path: Path, reference: dict, layout: str, arguments: list[str]) -> None:
    """Each schedule and each mesh ends with the unsplit run's weights: stages and tensor-parallel groups see the
    same batch, data-parallel ranks (HSDP's replicas and shards together) their share of it."""
    run = _run(tmp_path, *arguments)
    _assert_same_weights(run, reference)
    if "fsdp" not in layout and "hsdp" not in layout:  # one data-parallel rank: the batches' losses are the same
        _assert_same(run, reference, "losses")


def test_pipeline_job_killed_mid_run_resumes_on_another_layout(tmp_path: Path, reference: dict) -> None:
    """2 stages x FSDP2 on 4 ranks (GPipe) killed right after its checkpoint of step 3 (each rank its shards of its
    stage's parameters, under the unsplit model's names), resumed without stages with FSDP2 on 2 ranks: the run ends
    where the uninterrupted one does (so the stages' 3 steps were the unsplit model's too); consolidated, the
    checkpoint is one file of the unsplit model that a plain LightningModule loads."""
    layout = ("--pp", "2", "--dp", "2", "--schedule", "GPipe")
    _run(tmp_path / "killed", *layout, "--save", "--kill", killed=True)
    checkpoint = tmp_path / "killed" / "step=3.ckpt"
    resumed = _run(tmp_path / "resumed", "--dp", "2", "--resume", str(checkpoint))
    assert len(resumed["losses"]) == (4 - 3) * 2  # the batches after step 3
    _assert_same_weights(resumed, reference)
    write_consolidated(checkpoint, tmp_path / "one.ckpt")
    one = torch.load(tmp_path / "one.ckpt", weights_only=True)
    assert one["state_dict"].keys() == reference["weights"].keys()
    # Adam's moments of both stages, by position in the unsplit model's parameter order (as `optimizer.state_dict()`)
    optimizer, shapes = one["optimizer_states"][0], [value.shape for value in one["state_dict"].values()]
    assert optimizer["param_groups"][0]["params"] == list(range(len(shapes)))
    assert [optimizer["state"][index]["exp_avg"].shape for index in range(len(shapes))] == shapes


def test_split_gives_the_first_stage_the_embedding_and_the_last_the_head() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(4, 2)
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))
            self.norm = nn.LayerNorm(2)
            self.head = nn.Linear(2, 4)

    contents = pipeline.stage_contents(Net(), 3)
    assert contents == [
        ["embedding", "layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "norm", "head"],
    ]
    model = Net()
    stages, parts = pipeline.split_for_rank(model, "Interleaved1F1B", 0, 2, 2, None)
    assert stages == [0, 2]  # looped: rank 0 holds stages 0 and 2 of 4
    # the rank's model keeps its layers under their own names; the other children are gone
    assert [name for name, _ in model.named_parameters()] == [
        "embedding.weight",
        *(f"layers.{i}.{p}" for i in (0, 1, 3) for p in ("weight", "bias")),
    ]
    assert parts[1].embedding is None and [n for n, _ in parts[1].named_modules()] == ["", "layers", "layers.3"]
    with pytest.raises(ValueError, match="5 layers in `layers` cannot fill 6 stages"):
        pipeline.stage_contents(Net(), 6)


def test_a_nested_stack_splits_at_each_level_and_stateless_modules_stay_on_every_stage() -> None:
    """Hugging Face's layout (`layers="net.model.layers"`): modules before the path go to the first stage and after it
    to the last at each level, the rotary embedding (a buffer outside the state dict) to every stage; a rank's model
    and each of its stages' views keep the unsplit names."""

    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(2), persistent=False)

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(4, 2)
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
            self.norm = nn.LayerNorm(2)
            self.rotary = Rotary()

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()
            self.head = nn.Linear(2, 4)

    wrapper = nn.Module()
    wrapper.net = Outer()
    assert pipeline.stage_contents(wrapper, 2, "net.model.layers") == [
        ["net.model.embed", "net.model.layers.0", "net.model.layers.1", "net.model.rotary"],
        ["net.model.layers.2", "net.model.layers.3", "net.model.norm", "net.model.rotary", "net.head"],
    ]
    names = {name for name, _ in wrapper.named_parameters()}
    stages, parts = pipeline.split_for_rank(wrapper, "Interleaved1F1B", 1, 2, 2, "net.model.layers")
    assert stages == [1, 3]  # of 4: layers 1 and 3; the last stage holds the norm and the head
    assert {name for name, _ in wrapper.named_parameters()} == {
        name for name in names if name.startswith(("net.model.layers.1.", "net.model.layers.3.", "net.model.norm."))
    } | {"net.head.weight", "net.head.bias"}
    assert [n for n, _ in parts[0].named_modules()] == [
        "",
        "net",
        "net.model",
        "net.model.layers",
        "net.model.layers.1",
        "net.model.rotary",
    ]
    assert parts[1].net.head is wrapper.net.head and parts[0].net.head is None and parts[0].net.model.norm is None
    with pytest.raises(ValueError, match=r"`model.net.model.norm` is not a ModuleList or ModuleDict of layers"):
        pipeline.stage_contents(Outer(), 2, "net.model.norm")


def test_v_schedules_put_the_first_and_last_stages_on_rank_0() -> None:
    assert [pipeline.stages_of_rank("ZBVZeroBubble", r, 4, 2) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert pipeline.stage_rank("ZBVZeroBubble", 7, 4, 2) == 0
    assert pipeline.stage_rank("Interleaved1F1B", 7, 4, 2) == 3
    # the pairs that exchange tensors: neighbours, both ways, per pipeline group; last -> first only when looped
    assert ring_pairs([[0, 2], [1, 3]]) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert len(ring_pairs([[0, 1, 2, 3]])) == 8
    assert len(ring_pairs([[0, 1, 2, 3]], wrap=False)) == 6


def test_only_the_stage_groups_a_schedule_uses_are_created() -> None:
    """256 ranks, 4 pipeline ranks (64 pipeline groups): GPipe, 1F1B and the V schedules never send from the last
    rank to the first, so the broadcast transport creates 64 x 3 neighbouring pairs x 2 directions = 384 two-rank
    groups, not 512; Interleaved1F1B needs the wrap-around pair (512)."""
    columns = [[rank + 64 * stage for stage in range(4)] for rank in range(64)]
    assert len(ring_pairs(columns, wrap=False)) == 384
    assert len(ring_pairs(columns)) == 512


def test_weights_tied_across_stages_are_found_under_every_stage_name() -> None:
    """nanoGPT's layout (the head tied to the token embedding inside a ModuleDict): the first stage holds the weight
    as `transformer.wte.weight`, the last as `lm_head.weight`; an untied model has no ties."""

    class NanoGPT(nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict(
                {
                    "wte": nn.Embedding(8, 4),
                    "h": nn.ModuleList(nn.Linear(4, 4) for _ in range(4)),
                    "ln_f": nn.LayerNorm(4),
                }
            )
            self.lm_head = nn.Linear(4, 8, bias=False)
            if tied:
                self.lm_head.weight = self.transformer.wte.weight

    for tied, expected in ((True, [{0: "transformer.wte.weight", 1: "lm_head.weight"}]), (False, [])):
        model = NanoGPT(tied)
        assert pipeline.tied_across_stages(model, pipeline.stage_contents(model, 2, "transformer.h")) == expected


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"pipeline_schedule": "Looped"}, "is not one lightning_trn runs: choose one of GPipe, 1F1B"),
        ({"pipeline_schedule": "ZBVZeroBubble", "pipeline_stages_per_rank": 3}, "runs exactly 2 stages per rank"),
        ({"stage_transport": "rdma"}, "choose one of broadcast, send_recv"),
        ({"pipeline_microbatches": 0}, "give a positive number of microbatches"),
        ({"pipeline_schedule": "1F1B", "pipeline_microbatches": 1}, r"1F1B needs at least as many microbatches as"),
        ({"pipeline_schedule": "GPipe", "pipeline_microbatches": 1}, r"Use pipeline_microbatches >= 2"),
        (
            {"pipeline_schedule": "Interleaved1F1B", "pipeline_microbatches": 5},
            r"= 2 rounds of equal size, which 5 microbatches do not fill. Use a multiple of 2 \(e.g. 4\)",
        ),
    ],
)
def test_pipeline_settings_are_checked_at_construction(arguments: dict, message: str) -> None:
    from lightning_trn import NeuronModelParallelStrategy

    with pytest.raises(ValueError, match=message):
        NeuronModelParallelStrategy(pipeline_parallel_size=2, **arguments)


def test_parallel_dims_name_each_dimension_and_resolve_auto() -> None:
    """The mesh's one owner (TorchTitan's `ParallelDims`): "auto" resolved as Lightning's strategy resolves it
    without outer dimensions, the product checked against the run's processes, each size positive."""
    assert ParallelDims().sizes(2, 4) == {
        "pipeline_parallel": 1,
        "replicate": 1,
        "data_parallel": 2,
        "context_parallel": 1,
        "tensor_parallel": 4,
    }
    assert ParallelDims(pipeline_parallel=4, tensor_parallel=8).sizes(4, 8) == {
        "pipeline_parallel": 4,
        "replicate": 1,
        "data_parallel": 1,
        "context_parallel": 1,
        "tensor_parallel": 8,
    }
    assert ParallelDims(2, 1, 2, "auto").check("S", 1, 4)["data_parallel"] == 2  # data 2 x tensor 1 x pipeline 2
    with pytest.raises(ValueError, match=r"S\(pipeline_parallel_size=3.*needs 6 processes, the run has 4"):
        ParallelDims(3, 1, 2, 1).check("S", 1, 4)
    with pytest.raises(ValueError, match=r"replicate_size=0\): each mesh size is a positive whole number"):
        ParallelDims(replicate=0).check("S", 1, 4)


def test_hsdp_mesh_refuses_a_module_sharded_over_the_data_parallel_dimension_alone() -> None:
    """With replicas, `fully_shard(mesh=device_mesh["data_parallel"])` (a GPU script's 2-D habit) would never reduce
    gradients over the replicas: refused at setup, naming the 2-D mesh to use; the HSDP mesh passes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_trn.core.parallel.model_parallel import check_replicated_sharding
    from tests.standin.fake_group import fake_process_group

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("replicate", "data_parallel", "tensor_parallel"))
        wrong = fully_shard(nn.Linear(4, 4), mesh=mesh["data_parallel"])
        with pytest.raises(ValueError, match=r"bias, weight are sharded over .*'replicate', 'data_parallel'"):
            check_replicated_sharding(wrong, mesh)
        check_replicated_sharding(fully_shard(nn.Linear(4, 4), mesh=mesh["replicate", "data_parallel"]), mesh)


def _docs_example() -> str:
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Pipeline parallelism and HSDP") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/sharding.md lost its pipeline example"
    return match.group(1)


def test_the_docs_example_runs_as_written(tmp_path: Path) -> None:
    """docs/sharding.md's LightningModule: 2 stages x FSDP2 on 4 ranks, as a script (Lightning launches them)."""
    script = tmp_path / "example.py"
    script.write_text(_docs_example())
    result = subprocess.run(
        [sys.executable, str(script)],
        env=child_env(LIGHTNING_TRN_STANDIN_DEVICES="4"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2 steps on 4 ranks" in result.stdout
