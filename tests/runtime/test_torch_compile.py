"""`lightning_trn.compile`: TorchNeuron's `torch.compile` backend on the native backend (the stand-in registers one
of the same name and limits), the module unchanged on XLA (and the blocks given to `compile_blocks`), and
`dynamic=True` refused on both."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from models import RegressionModel, regression_loader
from torch import nn

import lightning_trn
from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.both


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Dynamo's caches are per code object and shared by every module the process compiled: `nn.Module`'s call is
    one code object, so after an earlier test's modules took its recompile limit (8), a module compiled here ran
    eagerly ("found no compiled frames"; seen in CI when another module ran first on the worker)."""
    torch._dynamo.reset()


class CompiledRegression(RegressionModel):
    """`RegressionModel` with its layer compiled by `lightning_trn.compile` (or not, for the reference)."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 1)
        if compiled:
            self.layer = lightning_trn.compile(self.layer)


def _fit(model: RegressionModel, tmp_path, batch_size: int = 16) -> Trainer:
    trainer = Trainer(
        accelerator="neuron",
        max_steps=6,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, regression_loader(n=96, batch_size=batch_size, shuffle=False))
    return trainer


def _weights(model: RegressionModel) -> dict[str, torch.Tensor]:
    return {name.replace("_orig_mod.", ""): value.detach().cpu() for name, value in model.layer.state_dict().items()}


def test_dynamic_shapes_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="dynamic=True.*pad inputs to fixed shapes"):
        lightning_trn.compile(nn.Linear(2, 2), dynamic=True)


@pytest.mark.native_only
def test_compiled_layer_trains_like_eager_and_recompiles_per_shape(tmp_path) -> None:
    eager = CompiledRegression(compiled=False)
    _fit(eager, tmp_path)
    before = get_runtime().metrics().compiles
    compiled = CompiledRegression(compiled=True)
    assert isinstance(compiled.layer, torch._dynamo.eval_frame.OptimizedModule)
    _fit(compiled, tmp_path)
    assert get_runtime().metrics().compiles - before == 1  # one graph for a fixed-shape loop
    # the stand-in runs the captured graph op by op (`standin/compile.py`): the eager kernels in the eager order, so
    # the weights are bit-exact there and 1e-6 absorbs nothing
    for name, value in _weights(eager).items():
        torch.testing.assert_close(_weights(compiled)[name], value, atol=1e-6, rtol=0)
    _fit(compiled, tmp_path, batch_size=24)  # a new batch size: a graph of its own, never a dynamic one
    assert get_runtime().metrics().compiles - before == 2


@pytest.mark.native_only
def test_the_neuron_backend_itself_rejects_dynamic_shapes() -> None:
    layer = torch.compile(nn.Linear(2, 2).to("neuron"), backend="neuron", dynamic=True)
    with pytest.raises(Exception, match="does not support dynamic shapes"):
        layer(torch.ones(3, 2, device="neuron"))


@pytest.mark.xla_only
def test_xla_returns_the_module_unchanged() -> None:
    layer = nn.Linear(2, 2)
    assert lightning_trn.compile(layer, mode="max-autotune") is layer
    assert get_runtime().name == "xla"


@pytest.mark.xla_only
def test_xla_leaves_blocks_uncompiled() -> None:
    """`compile_blocks` on XLA, which compiles each step whole: every block stays as it was, its calls uncompiled."""
    blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    lightning_trn.compile_blocks(blocks)
    assert all(block._compiled_call_impl is None for block in blocks)
