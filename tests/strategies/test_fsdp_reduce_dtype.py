"""Gradient reductions of FSDP2 under `bf16-true` (`lightning_trn.core.parallel.fsdp.reduction_policy`): without a
`mixed_precision` of the user's, `NeuronFSDPStrategy` reduce-scatters gradients in fp32, as TorchTitan does.

The collective is observed in this process on a 2-rank CPU mesh over torch's fake process group (the dtype FSDP2
hands the reduce-scatter is decided before any communication), and the numerics it buys are shown on a simulated
64-way reduction.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

from lightning_trn.core.parallel.fsdp import reduction_policy
from lightning_trn.pytorch import NeuronPrecision
from lightning_trn.pytorch.strategies import NeuronFSDPStrategy
from tests.standin.fake_group import fake_process_group

pytestmark = pytest.mark.native_only


@pytest.fixture
def mesh() -> Iterator[object]:
    with fake_process_group(2):
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))


def _spy_reduce_scatter_dtypes(monkeypatch: pytest.MonkeyPatch) -> set:
    """The set the dtypes of FSDP2's reduce-scatter inputs are added to from now on."""
    seen = set()
    original = _fsdp_collectives.DefaultReduceScatter.__call__

    def spy(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
        seen.add(input_tensor.dtype)
        return original(self, output_tensor, input_tensor, group, op, async_op)

    monkeypatch.setattr(_fsdp_collectives.DefaultReduceScatter, "__call__", spy)
    return seen


@pytest.mark.parametrize(
    ("precision", "mixed_precision", "expected"),
    [
        ("bf16-true", None, torch.float32),
        ("bf16-true", MixedPrecision(reduce_dtype=torch.bfloat16), torch.bfloat16),  # the user's choice stays
        ("32-true", None, torch.bfloat16),  # (a bf16 model under 32-true: nothing changed)
    ],
)
def test_bf16_true_reduces_gradients_in_fp32_unless_told(
    monkeypatch: pytest.MonkeyPatch, mesh: object, precision: str, mixed_precision: object, expected: torch.dtype
) -> None:
    strategy = NeuronFSDPStrategy(mixed_precision=mixed_precision)
    strategy.precision_plugin = NeuronPrecision(precision)
    strategy._device_mesh = mesh
    seen = _spy_reduce_scatter_dtypes(monkeypatch)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).to(torch.bfloat16)
    strategy._shard(model)
    model(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    assert seen == {expected}
    assert {parameter.grad.dtype for parameter in model.parameters()} == {torch.bfloat16}


def test_policy_choice() -> None:
    user = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert reduction_policy(user, "bf16-true") is user
    assert reduction_policy(None, "bf16-mixed") is None
    assert reduction_policy(None, "bf16-true").reduce_dtype == torch.float32


def test_64_way_reduction_error() -> None:
    """64 ranks' bf16 gradients summed in ring order in bf16, against summed in fp32 and rounded once to bf16: a
    relative error (norm of the error over norm of the exact sum) of about 1e-2 against 2e-3."""
    grads = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    exact = grads.double().sum(0)
    in_bf16, in_fp32 = grads[0].clone(), grads[0].float()
    for grad in grads[1:]:
        in_bf16 += grad
        in_fp32 += grad.float()
    error_bf16 = ((in_bf16.double() - exact).norm() / exact.norm()).item()
    error_fp32 = ((in_fp32.to(torch.bfloat16).double() - exact).norm() / exact.norm()).item()
    assert error_fp32 < 2.5e-3
    assert error_bf16 > 7e-3
