"""The estimator's step-time model (`lightning_trn.estimate.step_time`).

What is checked: the FLOPs the simulation counts for the LLM recipe's model are the analytic count (every Linear's
`2 x tokens x in x out`, attention's `4 x batch x heads x seq^2 x head_dim`, forward x 3), exactly; under tensor
parallelism a rank counts its shard's operations (half of them at tensor parallel 2), not the global DTensor's;
the prediction follows its stated rules (roofline per matrix product, memory-bound operations at HBM speed, fused
in compiled blocks, ring factors, the overlap rule, a pipeline's bubble); the command line prints the time rows
with their constants' sources.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lightning_trn.estimate.report import Collective
from lightning_trn.estimate.step_time import HARDWARE, Hardware, OpCount, predict, ring_factor

pytestmark = pytest.mark.native_only

#: the LLM recipe shrunk: 2 layers, hidden 64 (4 heads of 16), SwiGLU 128, vocabulary 512, 2 x 128 tokens
TINY = {
    "vocab": 512,
    "hidden": 64,
    "intermediate": 128,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "batch": 2,
    "seq": 128,
}


@pytest.fixture(autouse=True)
def _keeps_the_environment() -> Iterator[None]:
    environ = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)


def _tiny_overrides(devices: int, tensor_parallel: int = 1, nodes: int = 1) -> list[str]:
    t = TINY
    return [
        f"trainer.devices={devices}",
        f"trainer.num_nodes={nodes}",
        "trainer.strategy=model_parallel",
        f"model.tensor_parallel_size={tensor_parallel}",
        f"data.vocab_size={t['vocab']}",
        f"data.seq_len={t['seq']}",
        f"data.batch_size={t['batch']}",
        f"model.hidden_size={t['hidden']}",
        f"model.intermediate_size={t['intermediate']}",
        f"model.num_layers={t['layers']}",
        f"model.num_heads={t['heads']}",
        f"model.num_kv_heads={t['kv_heads']}",
    ]


def _recipe_estimate(devices: int, tensor_parallel: int = 1, nodes: int = 1) -> Any:
    from omegaconf import OmegaConf

    from lightning_trn.estimate import RECIPE, estimate, native_device
    from lightning_trn.estimate.__main__ import recipe_batch
    from lightning_trn.recipes import cli, llm

    native_device()
    cfg = cli.load_config(llm.RECIPE, _tiny_overrides(devices, tensor_parallel, nodes))
    trainer_args = {**OmegaConf.to_container(cfg.trainer, resolve=True), **llm.trainer_args(cfg)}
    return estimate(lambda: llm.build_model(cfg), recipe_batch(llm.RECIPE, cfg), caller=RECIPE, **trainer_args)


def _analytic_model_flops() -> int:
    """3 x the forward's matrix products of the recipe's Llama: per token q, k, v, o, gate, up, down and the head,
    2 FLOPs per weight; attention Q K^T and P V over the whole sequence (TorchTitan's convention: not halved)."""
    t = TINY
    head_dim = t["hidden"] // t["heads"]
    kv = t["kv_heads"] * head_dim
    per_layer = t["hidden"] * (t["hidden"] + 2 * kv + t["hidden"]) + 3 * t["hidden"] * t["intermediate"]
    weights = t["layers"] * per_layer + t["hidden"] * t["vocab"]
    tokens = t["batch"] * t["seq"]
    attention = t["layers"] * 4 * t["batch"] * t["heads"] * t["seq"] ** 2 * head_dim
    return 3 * (2 * tokens * weights + attention)


def test_the_counted_flops_are_the_models_and_a_tensor_parallel_rank_counts_its_shard() -> None:
    """One device: the analytic count, exactly. Tensor parallel 2 (FSDP 1): every matrix product is split (heads,
    SwiGLU width, vocabulary), so a rank runs half; counting DTensor operations globally would give the whole."""
    single = _recipe_estimate(devices=1, tensor_parallel=1)
    ops = single.work[0].ops
    assert ops.model_flops == _analytic_model_flops()
    assert single.work[0].tokens_per_step == TINY["batch"] * TINY["seq"]
    split = _recipe_estimate(devices=2, tensor_parallel=2)
    assert split.work[0].ops.model_flops * 2 == ops.model_flops
    # the two ranks of a tensor-parallel group share one stream of tokens
    assert split.work[0].tokens_per_step == TINY["batch"] * TINY["seq"] / 2
    timing = split.step_time()
    assert timing is not None and timing.exposed_s > 0  # tensor parallel's collectives are on the critical path


def test_a_group_across_nodes_sends_its_share_through_each_nodes_network() -> None:
    """FSDP2 over 4 ranks on 2 nodes of 2: a ring all-gather sends 3/4 of the gathered buffer per rank; the node's
    network carries one crossing per ring, shared by the group's 2 ranks there: 3/8 of the buffer per rank."""
    result = _recipe_estimate(devices=2, nodes=2)
    (gather,) = [c for c in result.collectives if c.op == "c10d._allgather_base_"]
    assert gather.across_nodes == gather.bytes_per_rank > 0
    assert gather.wire_within == 0 and gather.wire_across == pytest.approx(3 / 8 * gather.bytes_per_rank)


def test_the_command_line_prints_the_time_rows_with_their_sources(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_trn.estimate.__main__ import main

    assert main(["llm", *_tiny_overrides(devices=2)]) == 0
    out = capsys.readouterr().out
    line = re.search(r"step time \(model, trn2\.48xlarge\): (\d+\.\d+) m?s: ([\d,]+) tokens/s per chip, MFU", out)
    assert line is not None, out
    assert "constants: 667 BF16 TFLOPS" in out and "matmul efficiency 80.1 %" in out


#: a platform with round numbers: 1 rank per chip, 2 chips per node
ROUND = Hardware("round", 100e12, 0.5, 1e12, 100e9, 20e9, 2, 1, ("round numbers",))


def _ops(matmuls: dict[tuple[int, int], int], memory: int = 0, fused: int = 0, forward: int = 0) -> OpCount:
    ops = OpCount()
    ops.matmuls.update(matmuls)
    ops.memory_bytes, ops.fused_bytes, ops.forward_flops = memory, fused, forward
    return ops


def test_a_matrix_product_takes_the_slower_of_its_flops_and_its_bytes() -> None:
    """50 TFLOPS of matmul and 1 TB/s: 5e12 FLOPs over 1e9 bytes is compute-bound (0.1 s), 1e9 FLOPs over 1e10
    bytes memory-bound (0.01 s); 2e10 bytes of other operations 0.02 s eager, their 4e9 fused bytes compiled;
    attention at its own efficiency."""
    ops = _ops({(5 * 10**12, 10**9): 1, (10**9, 10**10): 2}, memory=2 * 10**10, fused=4 * 10**9, forward=10**12)
    eager = predict(ops, [], ROUND)
    assert eager.matmul_s == pytest.approx(0.1 + 2 * 0.01)
    assert eager.memory_s == pytest.approx(0.02)
    assert eager.step_s == pytest.approx(0.14)
    assert eager.mfu == pytest.approx(3e12 / (0.14 * 100e12))
    assert predict(ops, [], ROUND, compiled=True).memory_s == pytest.approx(0.004)
    ops.attention[(10**12, 0)] = 1
    slow_attention = dataclasses.replace(ROUND, attention_efficiency=0.25)
    assert predict(ops, [], slow_attention).matmul_s == pytest.approx(0.12 + 10**12 / (100e12 * 0.25))


def test_a_compiled_chain_reads_only_what_it_did_not_make() -> None:
    """Between two matrix products a chain of memory-bound operations fuses: x * 2 then + 1 reads x and writes two
    results (the second operation's input is the first's output); after the product the chain starts again, so relu
    reads the product's output. Eager reads and writes everything."""
    from lightning_trn.estimate.simulation import _CollectiveBytes

    x, w = torch.ones(64, 64), torch.ones(64, 64)
    with _CollectiveBytes.mode(1, True) as mode:
        b = (x * 2) + 1
        torch.relu(b @ w)
    size = 64 * 64 * 4
    assert mode.ops.memory_bytes == 6 * size
    assert mode.ops.fused_bytes == 5 * size
    assert dict(mode.ops.matmuls) == {(2 * 64**3, 3 * size): 1}


def _collective(op: str, within: float, across: float = 0.0) -> Collective:
    return Collective(op.split(".")[-1], 1, int(within + across), 0, op, within, across)


def test_the_overlap_rule_the_bubble_and_the_links() -> None:
    """FSDP2's collectives (c10d) hide behind 0.1 s of compute up to it; DTensor's add up; a byte between nodes
    goes at the node's network share (20 GB/s over 2 ranks), within at the link's (100 GB/s); a bubble of 1/4
    stretches the busy time by 4/3."""
    ops = _ops({(5 * 10**12, 0): 1})
    hidden = predict(ops, [_collective("c10d._allgather_base_", 5e9)], ROUND)
    assert hidden.overlapped_s == pytest.approx(0.05) and hidden.step_s == pytest.approx(0.1)
    shown = predict(ops, [_collective("c10d._allgather_base_", 15e9)], ROUND)
    assert shown.step_s == pytest.approx(0.15)
    exposed = predict(ops, [_collective("_c10d_functional.all_gather_into_tensor", 0.0, across=1e9)], ROUND)
    assert exposed.exposed_s == pytest.approx(1e9 / 10e9)
    assert exposed.step_s == pytest.approx(0.2)
    piped = predict(ops, [], ROUND, bubble=0.25, tokens_per_step=1000)
    assert piped.step_s == pytest.approx(0.1 / 0.75)
    assert piped.tokens_per_s_per_chip == pytest.approx(1000 / piped.step_s)


@pytest.mark.parametrize(
    ("kind", "size", "factor"),
    [("all_reduce", 4, 1.5), ("_allgather_base_", 4, 0.75), ("reduce_scatter_tensor", 2, 0.5), ("broadcast", 8, 1.0)],
)
def test_ring_factors(kind: str, size: int, factor: float) -> None:
    assert ring_factor(kind, size) == pytest.approx(factor)
    assert ring_factor(kind, 1) == 0.0


def test_every_platform_has_its_sources() -> None:
    from lightning_trn.estimate.report import PLATFORMS

    assert set(PLATFORMS) <= set(HARDWARE)
    assert all(hardware.sources and hardware.peak_flops > 0 for hardware in HARDWARE.values())
    assert HARDWARE["trn2"].ranks_per_chip == 4
