"""Sharded training on the native backend: Lightning's `ModelParallelStrategy` (FSDP2 + tensor parallel) with
`accelerator="neuron"`, Trainer and Fabric, on the stand-in.

`tests/scripts/model_parallel_train.py` is a script written as for GPUs (`configure_model` with `fully_shard` and
`parallelize_module`, `loss_parallel`, AdamW, clipping, accumulation, a per-step schedule). Each sharded run must end
where a reference ends: the same mesh under Lightning's own strategy on `accelerator="cpu"` (gloo), or one process;
8 sequences per optimizer step on every mesh, so all of them compute the same steps up to float summation order.
Checkpoints are torch.distributed.checkpoint directories that resume on another mesh.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_trn import NeuronModelParallelStrategy
from lightning_trn.core.checkpoint import distributed_checkpoint
from lightning_trn.core.checkpoint.distributed_checkpoint import DistributedCheckpointReader, write_consolidated
from lightning_trn.fabric import NeuronModelParallelStrategy as FabricNeuronModelParallelStrategy
from lightning_trn.pytorch.strategies import NeuronFSDPStrategy
from tests.launch import child_env, run_job
from tests.test_misconfiguration import documented_rows
from tests.tolerance import assert_losses_match, assert_weights_match, losses_error, weights_error

pytestmark = [pytest.mark.native_only, pytest.mark.numerics]

SCRIPT = Path(__file__).parents[1] / "scripts" / "model_parallel_train.py"
RUN_TIMEOUT_S = 240


def _run(out: Path, *args: str) -> dict:
    """Run the script (it launches its own processes); rank 0's record and final full weights."""
    run_job(
        SCRIPT, out, "--out", str(out), *args, env=child_env(LIGHTNING_TRN_STANDIN_DEVICES="4"), timeout=RUN_TIMEOUT_S
    )
    return {**json.loads((out / "run.json").read_text()), "weights": torch.load(out / "weights.pt")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Lightning's ModelParallelStrategy on the CPU, one process: nothing sharded. Its float32 rounding error, measured
    against the same run in float64 (`error`, `loss_error`: tests/tolerance.py), bounds every comparison below: every
    run here computes these 8 steps of this model in float32, in another summation order."""
    run = _run(tmp_path_factory.mktemp("one"), "--accelerator", "cpu")
    exact = _run(tmp_path_factory.mktemp("one64"), "--accelerator", "cpu", "--float64")
    return {
        **run,
        "error": weights_error(run["weights"], exact["weights"]),
        "loss_error": losses_error(run["losses"], exact["losses"]),
    }


@pytest.fixture(scope="module")
def error(one_process: dict) -> float:
    return one_process["error"]


def _assert_same_weights(run: dict, reference: dict, error: float) -> None:
    assert_weights_match(run["weights"], reference["weights"], error)


def _assert_identical(weights: dict, reference: dict) -> None:
    """A copy of the reference's weights (consolidated, converted, or resumed with nothing left to train)."""
    assert weights.keys() == reference["weights"].keys()
    for name, value in reference["weights"].items():
        torch.testing.assert_close(weights[name], value, atol=0, rtol=0, msg=name)


@pytest.fixture(scope="module")
def fsdp_cpu(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Lightning's own FSDP2 run on the CPU (gloo), 2 processes."""
    return _run(tmp_path_factory.mktemp("fsdp_cpu"), "--accelerator", "cpu", "--dp", "2")


@pytest.fixture(scope="module")
def fsdp_neuron(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The same job on 2 `neuron` devices, with distributed checkpoints after optimizer step 3 and at the end."""
    out = tmp_path_factory.mktemp("fsdp_neuron")
    return _run(out, "--dp", "2", "--save"), out / "step=3.ckpt"


def test_fsdp2_equals_lightning_on_cpu(fsdp_neuron: tuple[dict, Path], fsdp_cpu: dict, one_process: dict) -> None:
    run, _ = fsdp_neuron
    assert (run["strategy"], fsdp_cpu["strategy"]) == ("NeuronModelParallelStrategy", "ModelParallelStrategy")
    assert_losses_match(run["losses"], fsdp_cpu["losses"], one_process["loss_error"])
    _assert_same_weights(run, fsdp_cpu, one_process["error"])
    _assert_same_weights(run, one_process, one_process["error"])


def test_2d_fsdp_and_tensor_parallel_from_meta_init_equals_one_process(tmp_path: Path, one_process: dict) -> None:
    """dp 2 x tp 2 on 4 processes, the model built under `trainer.init_module(empty_init=True)`: materialized with
    the unsharded module's initial weights, it ends where one process that built it on the CPU does. (Lightning's own
    CPU run cannot clip a tensor-parallel model, mixed DTensor and tensor gradients; lightning_trn's can.)"""
    _assert_same_weights(_run(tmp_path, "--dp", "2", "--tp", "2", "--meta"), one_process, one_process["error"])


def test_checkpoint_is_written_by_every_rank(fsdp_neuron: tuple[dict, Path]) -> None:
    _, checkpoint = fsdp_neuron
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
        "random-state-rank0.pt",  # each rank's own random state
        "random-state-rank1.pt",
    ]


def test_resume_on_another_mesh_equals_uninterrupted_run(
    tmp_path: Path, fsdp_neuron: tuple[dict, Path], error: float
) -> None:
    """Saved by FSDP on 2 ranks after step 3, resumed with tensor parallel on 2 ranks: the weights and the optimizer
    state are resharded, the run ends where the uninterrupted one does."""
    uninterrupted, checkpoint = fsdp_neuron
    resumed = _run(tmp_path, "--tp", "2", "--resume", str(checkpoint))
    assert len(resumed["losses"]) == (8 - 3) * 2  # the micro-batches after step 3
    _assert_same_weights(resumed, uninterrupted, error)


def test_resume_on_one_device_equals_uninterrupted_run(
    tmp_path: Path, fsdp_neuron: tuple[dict, Path], error: float
) -> None:
    """The sharded directory resumes with the single-device strategy (`NeuronCheckpointIO` consolidates it on the
    host: weights, Adam moments by parameter position, loops)."""
    uninterrupted, checkpoint = fsdp_neuron
    resumed = _run(tmp_path, "--single", "--resume", str(checkpoint))
    assert resumed["strategy"] == "SingleDeviceNeuronStrategy"
    _assert_same_weights(resumed, uninterrupted, error)


def test_consolidated_checkpoint_loads_without_the_standin(tmp_path: Path, fsdp_neuron: tuple[dict, Path]) -> None:
    """`python -m lightning_trn.consolidate` (CPU, no process group) makes one file, and a safetensors file of the
    weights, that a process without the stand-in loads with `weights_only=True`: the weights equal the gathered ones,
    the optimizer state is the one-file format's (by parameter position)."""
    uninterrupted, checkpoint = fsdp_neuron
    final = checkpoint.parent / "final.ckpt"
    env = {k: v for k, v in child_env().items() if not k.startswith("LIGHTNING_TRN_STANDIN")}
    for extra in ([], ["--safetensors", "--strip-prefix", "net."]):
        output = tmp_path / ("weights.safetensors" if extra else "consolidated.ckpt")
        command = [sys.executable, "-m", "lightning_trn.consolidate", str(final), str(output), *extra]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert result.returncode == 0, result.stderr[-3000:]
    check = (
        "import sys, torch; from safetensors.torch import load_file\n"
        "assert not hasattr(torch, 'neuron'), 'the stand-in is loaded'\n"
        "c = torch.load(sys.argv[1], weights_only=True); s = load_file(sys.argv[2])\n"
        "o = c['optimizer_states'][0]\n"
        "print(len(c['state_dict']), sorted(o['state']) == list(range(len(c['state_dict']))), c['global_step'])\n"
        "torch.save({'ckpt': c['state_dict'], 'safetensors': s}, sys.argv[3])\n"
    )
    command = [
        sys.executable,
        "-c",
        check,
        str(tmp_path / "consolidated.ckpt"),
        str(tmp_path / "weights.safetensors"),
        str(tmp_path / "loaded.pt"),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    count = len(uninterrupted["weights"])
    assert result.stdout.split() == [str(count), "True", "8"]
    loaded = torch.load(tmp_path / "loaded.pt")
    _assert_identical(loaded["ckpt"], uninterrupted)
    names = {f"net.{name}": value for name, value in loaded["safetensors"].items()}
    _assert_identical(names, uninterrupted)


def test_consolidated_checkpoint_resumes_with_a_cpu_trainer(tmp_path: Path, fsdp_neuron: tuple[dict, Path]) -> None:
    """The final directory, consolidated, is accepted by `Trainer(accelerator="cpu").fit(ckpt_path=...)` in a process
    without the stand-in (weights, optimizer state, loops; the train loader's position stashed as in every one-file
    checkpoint), which finds the run complete and holds its weights. (Mid-epoch, a CPU run's plain DataLoader starts
    its epoch over, so only this resume can be compared with the sharded run.)"""
    uninterrupted, checkpoint = fsdp_neuron
    write_consolidated(checkpoint.parent / "final.ckpt", tmp_path / "final.ckpt")
    out = tmp_path / "cpu"
    out.mkdir()
    env = {k: v for k, v in child_env().items() if not k.startswith("LIGHTNING_TRN_STANDIN")}
    command = [
        sys.executable,
        str(SCRIPT),
        "--out",
        str(out),
        "--accelerator",
        "cpu",
        "--single",
        "--resume",
        str(tmp_path / "final.ckpt"),
    ]
    result = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "run.json").read_text())["losses"] == []  # nothing left to train
    _assert_identical(torch.load(out / "weights.pt"), uninterrupted)


def test_consolidation_reads_in_bounded_batches(
    tmp_path: Path, fsdp_neuron: tuple[dict, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streaming: every read of tensor data asks for at most `BATCH_BYTES` (here the largest entry's size), so the
    host holds one batch at a time; every entry is read once, small ones together."""
    _, checkpoint = fsdp_neuron
    tensors = DistributedCheckpointReader(checkpoint).tensors()
    nbytes = {key: md.size.numel() * md.properties.dtype.itemsize for key, md in tensors.items()}
    monkeypatch.setattr(distributed_checkpoint, "BATCH_BYTES", max(nbytes.values()), raising=False)
    reads: list[list[str]] = []
    load = DistributedCheckpointReader.load

    def recording(self: DistributedCheckpointReader, entries: dict) -> dict:
        reads.append([key for key, value in entries.items() if value is not None])
        return load(self, entries)

    monkeypatch.setattr(DistributedCheckpointReader, "load", recording)
    write_consolidated(checkpoint, tmp_path / "one.ckpt")
    tensor_reads = [keys for keys in reads if keys]
    assert sorted(key for keys in tensor_reads for key in keys) == sorted(tensors)
    assert all(sum(nbytes[key] for key in keys) <= max(nbytes.values()) for keys in tensor_reads)
    assert len(tensor_reads) < len(tensors)


def test_fabric_tensor_parallel_equals_trainer(tmp_path: Path, one_process: dict) -> None:
    """Fabric's ModelParallelStrategy(parallelize_fn) with tensor parallel, the loop clipping with
    `fabric.clip_gradients`, ends where the Trainer's one-process run does; `fabric.save` writes a sharded
    directory."""
    run = _run(tmp_path, "--api", "fabric", "--tp", "2")
    assert run["strategy"] == "NeuronModelParallelStrategy"
    assert_losses_match(run["losses"], one_process["losses"], one_process["loss_error"])
    _assert_same_weights(run, one_process, one_process["error"])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (tmp_path / "fabric.ckpt").iterdir()}


def test_bf16_mixed_computes_in_bf16_with_fp32_weights(tmp_path: Path) -> None:
    """Lightning's own bf16-mixed on a non-CUDA device would be CUDA autocast, silently fp32 here."""
    run = _run(tmp_path, "--dp", "2", "--steps", "1", "--precision", "bf16-mixed")
    assert run["dtypes"] == ["torch.bfloat16"]
    assert {value.dtype for value in run["weights"].values()} == {torch.float32}


@pytest.mark.parametrize(
    ("api", "processes", "sharding"),
    [("trainer", 2, "FULL_SHARD"), ("trainer", 4, "HYBRID_SHARD"), ("fabric", 2, "SHARD_GRAD_OP")],
)
def test_lightning_fsdp_script_equals_one_process(
    tmp_path: Path, one_process: dict, api: str, processes: int, sharding: str
) -> None:
    """A Lightning FSDP script (`FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
    sharding_strategy=...)`, no sharding of its own) served by FSDP2: each block a unit and checkpointed, the model
    the root unit; HYBRID_SHARD on a (2 replicas, 2 shards) mesh. Ends where one unsharded process ends.

    The model is built on the host: at setup the device receives its shards only, as a meta-built model's (the bytes
    copied host->device and the allocator's peak are the bytes the rank holds, half of the model: every size splits
    evenly over 2 shards)."""
    run = _run(tmp_path, "--api", api, "--dp", str(processes), "--fsdp", sharding)
    assert run["strategy"] == "NeuronFSDPStrategy"
    assert (run["fsdp_units"], run["checkpointed"]) == (2 + 1, 2)  # the blocks and the root; the blocks
    _assert_same_weights(run, one_process, one_process["error"])
    transfer = run["setup_transfer"]
    assert transfer["held_bytes"] * 2 == sum(value.nbytes for value in run["weights"].values()), transfer
    assert transfer["host_to_device_bytes"] == transfer["peak_bytes"] == transfer["held_bytes"], transfer


def test_fsdp_arguments_fsdp2_cannot_serve_are_refused() -> None:
    """Every FSDP1 sharding strategy maps (Lightning's own constructor rejects other names); FSDP1-only options are
    refused at construction."""
    with pytest.raises(ValueError) as raised:
        Trainer(accelerator="neuron", devices=2, logger=False, strategy=FSDPStrategy(ignored_modules=[]))
    assert "FSDPStrategy(ignored_modules=...) is not available" in str(raised.value)
    _assert_documented("fsdp-sharding-strategy", str(raised.value))
    with pytest.raises(ValueError, match="expresses FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD"):
        NeuronFSDPStrategy(sharding_strategy="SHARD_EVERYTHING")


def test_script_for_gpus_gets_the_neuron_strategy() -> None:
    """`strategy=ModelParallelStrategy(...)` with `accelerator="neuron"` becomes ours, with the same arguments."""
    trainer = Trainer(
        accelerator="neuron",
        devices=2,
        logger=False,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, save_distributed_checkpoint=False),
    )
    strategy = trainer.strategy
    assert isinstance(strategy, NeuronModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (1, 2)
    assert strategy._save_distributed_checkpoint is False
    assert strategy.root_device.type == "neuron"
    fsdp = Trainer(accelerator="neuron", devices=2, logger=False, strategy="fsdp").strategy
    assert isinstance(fsdp, NeuronFSDPStrategy)
    assert fsdp.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_fabric_optimizer_made_before_sharding_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """It would update Parameters the sharded model no longer holds: refused with the order that works (the
    message of docs/troubleshooting.md's row)."""
    strategy = FabricNeuronModelParallelStrategy(lambda module, mesh: module)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(strategy, "setup_module", lambda module: torch.nn.Linear(2, 2))  # parameters replaced
    with pytest.raises(RuntimeError) as raised:
        strategy.setup_module_and_optimizers(model, [optimizer])
    _assert_documented("model-parallel-optimizer", str(raised.value))


@pytest.mark.parametrize(("dp", "tp"), [(1, 3), (2, "auto"), (3, 1)])
def test_mesh_sizes_that_do_not_fit_the_processes_are_refused_at_construction(dp: object, tp: object) -> None:
    with pytest.raises(ValueError, match=r"needs \d+ processes, the run has 2") as raised:
        Trainer(
            accelerator="neuron",
            devices=2,
            logger=False,
            strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
        )
    if (dp, tp) == (1, 3):  # the row of docs/troubleshooting.md
        _assert_documented("model-parallel-sizes", str(raised.value))


def _assert_documented(row: str, message: str) -> None:
    for fragment in documented_rows()[row]:
        assert fragment in message, f"{row}: {fragment!r} not in {message!r}"
