"""The LLM recipe's `parallelize` (TorchTitan's `parallelize_llama` for Hugging Face's Llama) on the trn2 presets at
their real world sizes: trn2-8b, 64 ranks as FSDP2 over 32 x tensor parallel over 2; trn2-70b, 4 nodes of 64 ranks
as FSDP2 over 64 x tensor parallel over 4. The mesh is the one the preset's strategy builds, on the meta device over
torch's fake process group (one process, no memory; two decoder layers, since every layer gets the same plan). Its
numerics are proven elsewhere: tests/recipes/test_recipe_llm_native.py trains tensor parallel exactly like one device.
`model.replicate_size` (HSDP) is checked the same way on 2 nodes of 2 ranks, with its refusals.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.strategies.model_parallel import _setup_device_mesh
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_trn.core.parallel.parallel_dims import ParallelDims
from lightning_trn.recipes import cli, llm
from tests.standin.fake_group import fake_process_group

pytestmark = pytest.mark.native_only


@pytest.mark.parametrize(
    ("preset", "world_size", "mesh_shape", "lm_head_shard", "checkpointed"),
    [
        ("trn2-8b", 64, (32, 2), (32000 // 2 // 32, 4096), False),
        ("trn2-70b", 256, (64, 4), (128256 // 4 // 64, 8192), True),
    ],
)
def test_trn2_preset_makes_every_parameter_a_dtensor_on_one_mesh(
    preset: str, world_size: int, mesh_shape: tuple[int, int], lm_head_shard: tuple[int, int], checkpointed: bool
) -> None:
    """The preset's strategy is `ModelParallelStrategy` over `devices x num_nodes` ranks with the expected
    (data parallel, tensor parallel) sizes; `configure_model` under the preset (bf16-mixed): every parameter,
    embedding, norms and output projection included, is a DTensor on that 2-D mesh (what AdamW's default `foreach`
    needs), sharded by FSDP2 over `data_parallel` and by the plan over `tensor_parallel`; FSDP2 computes in bf16 and
    reduces in fp32; each decoder layer is checkpointed where the preset checkpoints (trn2-70b; trn2-8b fits
    without, docs/recipes.md)."""
    cfg = cli.load_config(llm.RECIPE, [f"preset={preset}", "model.num_layers=2"])
    strategy = llm.trainer_args(cfg)["strategy"]
    assert isinstance(strategy, ModelParallelStrategy)
    assert cfg.trainer.devices * cfg.trainer.get("num_nodes", 1) == world_size
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == mesh_shape
    module = llm.build_model(cfg)
    with fake_process_group(world_size):
        mesh = _setup_device_mesh(*mesh_shape, world_size, torch.device("cpu"))  # as the strategy's setup does
        module._device_mesh = mesh
        module._trainer = SimpleNamespace(strategy=SimpleNamespace(), precision=cfg.trainer.precision)
        module.configure_model()
        params = dict(module.net.named_parameters())
        assert all(isinstance(p, DTensor) and p.device_mesh == mesh for p in params.values())
        # FSDP2 shards dim 0 of every parameter (`_StridedShard` where tensor parallel split dim 0 first)
        assert all(p.placements[0].dim == 0 for p in params.values())
        rows, columns = Shard(0), Shard(1)  # a Linear's weight is (out, in): column-wise splits its rows
        expected = {
            "model.embed_tokens.weight": rows,
            "lm_head.weight": rows,  # both split over the vocabulary
            "model.norm.weight": Replicate(),
            "model.layers.0.input_layernorm.weight": Replicate(),
            "model.layers.0.post_attention_layernorm.weight": Replicate(),
            "model.layers.0.self_attn.q_proj.weight": rows,
            "model.layers.0.self_attn.k_proj.weight": rows,
            "model.layers.0.self_attn.o_proj.weight": columns,
            "model.layers.0.mlp.up_proj.weight": rows,
            "model.layers.0.mlp.down_proj.weight": columns,
        }
        assert {name: params[name].placements[1] for name in expected} == expected
        # one rank's shard of the output projection: the vocabulary split over tensor parallel, then over FSDP2
        assert params["lm_head.weight"].to_local().shape == lm_head_shard
        net = module.net
        units = (net, net.model.embed_tokens, *net.model.layers, net.lm_head)
        for fsdp_module in units:
            policy = fsdp_module._get_fsdp_state()._mp_policy
            assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
        assert len({id(unit._get_fsdp_state()) for unit in units}) == len(units)
        assert net.model.norm._get_fsdp_state() is net.lm_head._get_fsdp_state()
        resharded = [unit._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for unit in units[1:]]
        assert resharded == [True] * (len(units) - 2) + [False]
        assert [layer.gradient_checkpointing for layer in module.net.model.layers] == [checkpointed] * 2


#: a tiny model on 2 nodes of 2 ranks under `trainer.strategy=model_parallel`
HSDP_JOB = (
    "trainer.devices=2",
    "trainer.num_nodes=2",
    "trainer.strategy=model_parallel",
    "trainer.precision=bf16-mixed",
    "model.num_layers=2",
)


def test_replicate_size_makes_the_recipe_hsdp() -> None:
    """`model.replicate_size=2` on 2 nodes of 2: the plugin's strategy with 2 replicas of 2-way FSDP2, and after
    `configure_model` every parameter is a DTensor on the (replicate, data_parallel) mesh, replicated over the
    first dimension and sharded (dim 0) over the second: HSDP, as `fully_shard(mesh=mesh["replicate",
    "data_parallel"])` makes it."""
    from lightning_trn import NeuronModelParallelStrategy

    cfg = cli.load_config(llm.RECIPE, [*HSDP_JOB, "model.replicate_size=2"])
    strategy = llm.trainer_args(cfg)["strategy"]
    assert isinstance(strategy, NeuronModelParallelStrategy)
    dims = strategy.parallel_dims
    assert (dims.replicate, dims.data_parallel, dims.tensor_parallel) == (2, 2, 1)
    module = llm.build_model(cfg)
    with fake_process_group(4):
        mesh = ParallelDims.build_mesh(dims.sizes(2, 2), "cpu")  # as the strategy's setup does
        module._device_mesh = mesh
        module._trainer = SimpleNamespace(strategy=SimpleNamespace(), precision=cfg.trainer.precision)
        module.configure_model()
        params = dict(module.net.named_parameters())
        hsdp = mesh["replicate", "data_parallel"]
        assert hsdp.mesh_dim_names == ("replicate", "data_parallel") and hsdp.size() == 4
        assert all(isinstance(p, DTensor) and p.device_mesh == hsdp for p in params.values())
        assert {p.placements for p in params.values()} == {(Replicate(), Shard(0))}
        # one rank holds half of each parameter (2-way FSDP2 within its replica), not a quarter
        embedding = params["model.embed_tokens.weight"]
        assert embedding.to_local().shape[0] == embedding.shape[0] // 2


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ("model.replicate_size=0",),
            "Config key model.replicate_size=0: expected a value greater than 0 (default 1).",
        ),
        (
            ("model.replicate_size=3",),
            "needs trainer.devices (an integer; here 2) x num_nodes divisible by model.tensor_parallel_size=1 x "
            "model.replicate_size=3.",
        ),
        (
            ("model.replicate_size=2", "trainer.strategy=fsdp"),
            "model.replicate_size=2 needs trainer.strategy=model_parallel (here 'fsdp').",
        ),
    ],
)
def test_replicate_size_is_refused_in_one_line(overrides: tuple[str, ...], expected: str) -> None:
    """A replica count below 1, one that does not divide the world (with the tensor-parallel size), or one without
    the model-parallel strategy: one line naming the key, as the recipe's other keys are refused."""
    with pytest.raises(ValueError) as refused:
        llm.trainer_args(cli.load_config(llm.RECIPE, [*HSDP_JOB, *overrides]))
    message = str(refused.value)
    assert expected in message and "\n" not in message, message


def test_pipeline_parallel_size_gives_the_strategy_stages() -> None:
    """`model.pipeline_parallel_size=2` on 2 nodes of 2: the plugin's strategy with 2 stages of 2-way FSDP2, the
    config's schedule and microbatches (tests/recipes/test_recipe_llm_strategies_native.py trains it)."""
    from lightning_trn import NeuronModelParallelStrategy

    stages = ("model.pipeline_parallel_size=2", "model.pipeline_schedule=GPipe", "model.pipeline_microbatches=4")
    strategy = llm.trainer_args(cli.load_config(llm.RECIPE, [*HSDP_JOB, *stages]))["strategy"]
    assert isinstance(strategy, NeuronModelParallelStrategy)
    pipelining = strategy._pipelining
    assert (pipelining.size, strategy._data_parallel_size, pipelining.schedule, pipelining.microbatches) == (
        2,
        2,
        "GPipe",
        4,
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ("model.pretrained=folder", "model.lora.r=4"),
            "model.pipeline_parallel_size=2 does not run with model.lora.r set: the recipe's pipeline stages take "
            "FSDP2, HSDP and tensor parallel within each stage",
        ),
        (("trainer.strategy=fsdp",), "model.pipeline_parallel_size=2 needs trainer.strategy=model_parallel"),
        (
            ("model.pipeline_schedule=Looped",),
            "model.pipeline_schedule='Looped': expected a value GPipe, 1F1B, Interleaved1F1B or ZBVZeroBubble",
        ),
        (
            ("trainer.devices=3", "trainer.num_nodes=1"),
            "divisible by model.tensor_parallel_size=1 x model.replicate_size=1 x model.pipeline_parallel_size=2.",
        ),
    ],
)
def test_pipeline_parallel_size_is_refused_in_one_line(overrides: tuple[str, ...], expected: str) -> None:
    """What the recipe does not run with stages (LoRA adapters, another
    strategy, an unknown schedule, a world the stages do not divide): one line naming the key and what to do."""
    with pytest.raises(ValueError) as refused:
        llm.trainer_args(cli.load_config(llm.RECIPE, [*HSDP_JOB, "model.pipeline_parallel_size=2", *overrides]))
    message = str(refused.value)
    assert expected in message and "\n" not in message, message


def test_a_parameter_left_out_of_the_plan_is_listed_once_through_nested_module_dicts() -> None:
    """Nested ModuleDicts reach a block's norm from every level (parts -> blocks -> b0): the check that such
    parameters agree across the tensor-parallel ranks lists (and reduces) each once; its refusal named each twice."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_trn.core.parallel.model_parallel import _left_out_of_tensor_parallel

    block = nn.ModuleDict({"norm": nn.LayerNorm(8), "up": nn.Linear(8, 16), "down": nn.Linear(16, 8)})
    net = nn.ModuleDict({"parts": nn.ModuleDict({"blocks": nn.ModuleDict({"b0": block})})})
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        names = [name for name, _ in _left_out_of_tensor_parallel(net)]
    assert names == ["parts.blocks.b0.norm.weight", "parts.blocks.b0.norm.bias"]
