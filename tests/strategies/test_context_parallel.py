"""Context parallelism and packed sequences (`lightning_trn.core.parallel.context_parallel`, the LLM recipe's
`data.packing`): the head-tail split, the split of a batch, the documents of packed blocks, packing equal to the
documents run one by one, and the recipe's context-parallel run equal to one device. The layouts' equality with one
device is the conformance sweep's (its `cp*` cells)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_trn.core.parallel.context_parallel import (
    IGNORE_INDEX,
    ContextParallel,
    document_ids,
    document_mask,
    head_tail_index,
    shift_labels,
    token_mean,
)
from lightning_trn.core.parallel.parallel_dims import ParallelDims

pytestmark = pytest.mark.native_only


class _Mesh:
    """A 1-D mesh as `ContextParallel` reads it (its size, this rank's place, its group), without a process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self) -> None:
        return None


@pytest.mark.parametrize("size", [2, 4])
def test_head_tail_split_covers_the_sequence_once_with_equal_causal_work(size: int) -> None:
    """Every position on exactly one rank; each rank's queries attend to as many causal keys (TorchTitan's
    load balancing): rank r holds chunks r and 2n-1-r."""
    length = 8 * size
    parts = [head_tail_index(length, size, rank) for rank in range(size)]
    assert sorted(torch.cat(parts).tolist()) == list(range(length))
    work = {int((part + 1).sum()) for part in parts}  # keys at or before each query
    assert len(work) == 1
    assert parts[0].tolist()[: length // (2 * size)] == list(range(length // (2 * size)))


def test_split_takes_targets_and_positions_on_the_whole_sequence() -> None:
    """A rank's `shift_labels` are the whole sequence's next tokens at its positions (a rank cannot shift its own
    part: its last token's target lives on another rank); `position_ids` are added; per-sample entries pass."""
    tokens = torch.arange(16).view(2, 8)
    batch = {"input_ids": tokens, "labels": tokens, "index": torch.tensor([3, 4])}
    local, layout = ContextParallel(_Mesh(2, 1)).split(batch)
    positions = head_tail_index(8, 2, 1)
    assert torch.equal(local["input_ids"], tokens[:, positions])
    assert torch.equal(local["shift_labels"], shift_labels(tokens)[:, positions])
    assert torch.equal(local["position_ids"][0], positions)
    assert torch.equal(local["index"], batch["index"])
    assert torch.equal(layout.gathered, torch.cat([head_tail_index(8, 2, 0), positions]))


def test_split_refuses_what_it_cannot_split() -> None:
    cp = ContextParallel(_Mesh(2, 0))
    with pytest.raises(ValueError, match=r"splits the sequences of a dict batch .* this batch is a tuple"):
        cp.split((torch.zeros(2, 8), torch.zeros(2, 8)))
    with pytest.raises(ValueError, match=r"cuts each sequence into 4 equal chunks .* have 6 tokens"):
        cp.split({"input_ids": torch.zeros(2, 6, dtype=torch.long)})


def test_document_mask_keeps_documents_apart_and_causal() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    documents = document_ids(positions)
    assert documents.tolist() == [[1, 1, 1, 2, 2, 3]]
    seq = torch.arange(6)
    mask = document_mask(documents, seq, seq)[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for start, end in ((0, 3), (3, 5), (5, 6)):
        expected[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)


def test_parallel_dims_place_context_between_data_and_tensor() -> None:
    sizes = ParallelDims(data_parallel=2, tensor_parallel=2, context_parallel=4).check("S", 1, 16)
    assert list(sizes) == ["pipeline_parallel", "replicate", "data_parallel", "context_parallel", "tensor_parallel"]
    assert sizes["context_parallel"] == 4
    with pytest.raises(ValueError, match=r"context parallelism does not run with pipeline stages"):
        ParallelDims(pipeline_parallel=2, data_parallel=1, tensor_parallel=1, context_parallel=2).check("S", 1, 4)


def test_pretraining_blocks_restart_positions_at_each_document() -> None:
    from lightning_trn.recipes.llm.data import document_positions, pack, packed_labels

    documents = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]  # + EOS each: 4, 3, 5 tokens
    blocks = pack(documents, eos_id=1, seq_len=6)
    positions = document_positions(documents, seq_len=6)
    assert blocks.tolist() == [[5, 6, 7, 1, 8, 9], [1, 10, 11, 12, 13, 1]]
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1], [0, 0, 1, 2, 3, 4]]  # a block starting mid-document: from 0
    labels = packed_labels(blocks, positions)
    assert labels[0, 4] == IGNORE_INDEX and labels[1, 1] == IGNORE_INDEX and labels[0, 3] == 1


def test_fine_tuning_rows_packed_in_order_with_their_labels() -> None:
    from lightning_trn.recipes.llm.sft import packed_blocks

    rows = [([2, 3, 4], [-100, 3, 4]), ([5, 6], [-100, 6]), ([7, 8, 9, 10], [-100, -100, 9, 10])]
    packed = packed_blocks(rows, seq_len=6, pad_id=0)
    assert packed["input_ids"].tolist() == [[2, 3, 4, 5, 6, 0], [7, 8, 9, 10, 0, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert packed["labels"].tolist() == [[-100, 3, 4, -100, 6, -100], [-100, -100, 9, 10, -100, -100]]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_documents_have_the_losses_they_have_alone(attn_implementation: str) -> None:
    """Packing is exact: each token's loss in a packed block (the recipe's mask and position ids) equals its loss
    with its document run alone, in float64, to its rounding: a few units of the epsilon of the softmax's dtype times
    its length (Hugging Face's eager attention takes its softmax in float32, SDPA in the inputs' float64)."""
    from lightning_trn.recipes.llm.data import packed_labels
    from lightning_trn.recipes.llm.model import CausalLM

    torch.manual_seed(0)
    module = CausalLM(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seq_len=16,
        attn_implementation=attn_implementation,
    ).double()
    lengths = (5, 7, 4)
    documents = [torch.randint(0, 64, (1, length)) for length in lengths]
    ids = torch.cat(documents, dim=1)
    positions = torch.cat([torch.arange(length) for length in lengths])[None]
    labels = packed_labels(ids, positions)
    packed = token_losses(module, ids, positions, labels)
    alone = torch.cat([token_losses(module, doc, None, doc) for doc in documents], dim=1)
    predicted = shift_labels(labels) != IGNORE_INDEX
    expected = torch.cat([shift_labels(doc) != IGNORE_INDEX for doc in documents], dim=1)
    assert torch.equal(predicted, expected)
    softmax = torch.float32 if attn_implementation == "eager" else torch.float64
    bound = 16 * torch.finfo(softmax).eps * 16 * alone[expected].abs().max()
    assert (packed[predicted] - alone[expected]).abs().max() <= bound


def token_losses(module: Any, ids: torch.Tensor, positions: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = module(ids, positions)
    targets = shift_labels(labels)
    losses = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return losses.view(targets.shape)


@pytest.mark.slow
@pytest.mark.numerics
def test_recipe_context_parallel_packed_equals_one_device(tmp_path: Path) -> None:
    """The issue's check: `trainer.strategy=model_parallel model.context_parallel_size=2 data.packing=true` on 2
    stand-in ranks trains what one device trains (the same sampler: `model_parallel` on 1 device), weights and
    validation perplexity within the tolerance tests/tolerance.py derives from the one-device run's own float32
    error (its float64 twin), with activation checkpointing (layers recomputed in the backward see the split)."""
    from tests.recipe_runs import FLOAT64, TINY_LLM, assert_ends_alike, run

    env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": "2"}
    metrics = ("val_loss", "val_ppl", "test_loss")
    job = (*TINY_LLM, "trainer.strategy=model_parallel", "data.packing=true", "model.activation_checkpointing=true")
    one = run("llm", tmp_path / "one", *job, "trainer.devices=1", env=env, metrics=metrics)
    exact = run("llm", tmp_path / "one64", *job, *FLOAT64, env=env, metrics=metrics)
    split = run(
        "llm", tmp_path / "cp", *job, "trainer.devices=2", "model.context_parallel_size=2", env=env, metrics=metrics
    )
    assert split["ckpt"]["global_step"] == one["ckpt"]["global_step"] == 6
    assert_ends_alike(split, one, exact, trained_below=None)


@pytest.mark.slow
@pytest.mark.numerics
def test_fabric_loop_with_context_parallel_equals_one_device(tmp_path: Path) -> None:
    """Fabric: a loop entering `fabric.strategy.context_parallel.step(batch)` around its forward and backward trains a
    Hugging Face Qwen2 (a third of its labels ignored, unevenly over the ranks) as one device does, within the
    tolerance of the one-device run's own float32 error (its float64 twin); SGD, so every element's update is its
    gradient's."""
    from tests.launch import child_env, run_job
    from tests.tolerance import assert_losses_match, assert_weights_match, losses_error, weights_error

    script = Path(__file__).resolve().parents[1] / "scripts" / "context_parallel_fabric.py"
    env = child_env(LIGHTNING_TRN_STANDIN="1", LIGHTNING_TRN_STANDIN_DEVICES="2")
    runs = {}
    for name, args in (("cp", ()), ("one", ("--reference",)), ("one64", ("--reference", "--float64"))):
        run_job(script, tmp_path / name, "--out", str(tmp_path / f"{name}.pt"), *args, env=env, timeout=300)
        runs[name] = torch.load(tmp_path / f"{name}.pt")
    one, exact, split = runs["one"], runs["one64"], runs["cp"]
    assert_weights_match(split["weights"], one["weights"], weights_error(one["weights"], exact["weights"]))
    assert_losses_match(split["losses"], one["losses"], losses_error(one["losses"], exact["losses"]))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_a_forward_without_sdpa_is_refused_before_its_first_update(attn_implementation: str) -> None:
    """A forward whose attention is not SDPA (Hugging Face's eager attention) would train on split sequences that no
    attention joins: refused when the step's forward ends, before its backward, with what to do; SDPA is served.
    Rank 0 of 2 over a fake process group (the values of its collectives are the conformance sweep's)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_trn.recipes.llm.model import CausalLM
    from tests.standin.fake_group import fake_process_group

    module = CausalLM(vocab_size=64, hidden_size=32, num_layers=1, attn_implementation=attn_implementation)
    tokens = torch.randint(0, 64, (2, 8))
    with fake_process_group(2), contextlib.ExitStack() as stack:
        split = ContextParallel.of(init_device_mesh("cpu", (2,), mesh_dim_names=("context_parallel",)))
        if attn_implementation == "eager":
            stack.enter_context(pytest.raises(ValueError, match=r"called no `torch.nn.functional.scaled_dot_pro"))
        with split.step({"input_ids": tokens, "labels": tokens}) as local:
            token_mean(*module.loss_sum(local))


def test_context_mesh_refuses_parameters_not_sharded_over_data_and_context() -> None:
    """Each context rank computes the gradients of its part of the sequences: a module sharded over
    `device_mesh["data_parallel"]` alone (the 2-D habit), or left whole, would never sum them over the context
    ranks. Refused at setup with the mesh to use; FSDP2 over `fsdp_mesh` passes."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from lightning_trn.core.parallel.model_parallel import check_replicated_sharding
    from tests.standin.fake_group import fake_process_group

    with fake_process_group(4):
        sizes = ParallelDims(data_parallel=2, tensor_parallel=1, context_parallel=2).check("S", 1, 4)
        mesh = ParallelDims.build_mesh(sizes, "cpu")
        assert mesh["data_context_parallel"].size() == 4
        for wrong in (fully_shard(nn.Linear(4, 4), mesh=mesh["data_parallel"]), nn.Linear(4, 4)):
            with pytest.raises(ValueError, match=r"bias, weight are not sharded over data x context"):
                check_replicated_sharding(wrong, mesh)
        check_replicated_sharding(fully_shard(nn.Linear(4, 4), mesh=ParallelDims.fsdp_mesh(mesh)), mesh)


@pytest.mark.slow
def test_packed_context_parallel_job_killed_mid_epoch_resumes_to_the_uninterrupted_end(tmp_path: Path) -> None:
    """`model.context_parallel_size=2 data.packing=true` on 2 stand-in ranks, SIGKILLed after its first mid-epoch
    checkpoint and restarted from it, ends bit for bit where the uninterrupted job ends (weights, AdamW state,
    schedule, logged metrics)."""
    from tests.recipe_runs import RESUMABLE, TINY_LLM, assert_ends_identically, kill_after_first_checkpoint, run

    env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": "2"}
    job = (
        *TINY_LLM,
        *RESUMABLE,
        "trainer.strategy=model_parallel",
        "trainer.devices=2",
        "model.context_parallel_size=2",
        "data.packing=true",
    )
    expected = run("llm", tmp_path / "a", *job, env=env)
    checkpoint = kill_after_first_checkpoint("llm", tmp_path / "b", *job, env=env)
    resumed = run("llm", tmp_path / "b", *job, f"ckpt_path={checkpoint}", env=env)
    assert_ends_identically(resumed, expected)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("data.seq_len=66",), "model.context_parallel_size=2 cuts each sequence into 4 equal chunks"),
        (("model.compile=true",), "model.context_parallel_size=2 with model.compile=true"),
        (("trainer.strategy=fsdp",), "model.context_parallel_size=2 needs trainer.strategy=model_parallel"),
    ],
)
def test_the_recipe_refuses_what_context_parallelism_does_not_run_before_launching(
    overrides: tuple[str, ...], expected: str
) -> None:
    """Refused when the recipe builds its strategy, before any rank starts (a trial met the length only at the
    sanity check's first batch, on every rank). With pipeline stages the strategy refuses at `Trainer(...)`
    (`ParallelDims.check`, above)."""
    from lightning_trn.recipes import cli, llm

    job = ["trainer.strategy=model_parallel", "trainer.devices=2", "model.context_parallel_size=2"]
    with pytest.raises(ValueError, match=expected):
        llm.trainer_args(cli.load_config(llm.RECIPE, [*job, *overrides]))
