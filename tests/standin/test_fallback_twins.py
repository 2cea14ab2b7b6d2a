"""Ops whose schema hides what they do, through the stand-in's CPU fallback: convolutions (`*_overrideable`,
which have no CPU kernel) and batch norm's running statistics (updated in place by `native_batch_norm`, whose schema
does not declare it). Outputs, gradients and module buffers equal the CPU's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.native_only


def _forward_backward(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    out = module(x)
    out.square().sum().backward()
    return out.detach().cpu(), x.grad.cpu(), [p.grad.cpu() for p in module.parameters()]


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Conv1d(3, 4, 3, padding=1),
        lambda: nn.Conv2d(3, 4, 3, stride=2, bias=False),
        lambda: nn.Conv2d(4, 6, 3, groups=2, dilation=2),
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2),
        lambda: nn.Conv3d(2, 3, 2),
    ],
    ids=["conv1d", "conv2d-strided-nobias", "conv2d-groups-dilation", "conv-transpose2d-groups", "conv3d"],
)
def test_convolutions_give_the_cpus_outputs_and_gradients(make) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    cpu = make()
    device = make().to("neuron")
    device.load_state_dict(cpu.state_dict())
    channels = cpu.in_channels
    x = torch.randn(2, channels, *([9] * (cpu.weight.dim() - 2)))
    expected = _forward_backward(cpu, x)
    served = _forward_backward(device, x.to("neuron"))
    # the CPU's convolution kernels on host copies: equal, or a few float32 ulps (eps 1.2e-7) apart where a kernel
    # blocks the copies otherwise: of outputs and input gradients of order 1 (under 1e-6), and of weight gradients,
    # sums over every output position (<= ~30: under 1e-5)
    torch.testing.assert_close(served[0], expected[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(served[1], expected[1], atol=1e-6, rtol=1e-6)
    for mine, theirs in zip(served[2], expected[2], strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("track_running_stats", [True, False])
@pytest.mark.parametrize(
    "make",
    [
        lambda t: nn.BatchNorm1d(3, momentum=1.0, track_running_stats=t),
        lambda t: nn.BatchNorm2d(3, momentum=0.3, track_running_stats=t),
    ],
    ids=["bn1d", "bn2d"],
)
def test_batch_norm_updates_its_running_statistics_as_on_the_cpu(make, track_running_stats) -> None:  # type: ignore
    torch.manual_seed(0)
    cpu = make(track_running_stats)
    device = make(track_running_stats).to("neuron")
    shape = (4, 3) if isinstance(cpu, nn.BatchNorm1d) else (4, 3, 5, 5)
    for step in range(3):
        x = torch.randn(*shape) * (step + 1) + step
        expected = _forward_backward(cpu, x)
        served = _forward_backward(device, x.to("neuron"))
        # the CPU's batch norm on host copies: a few float32 ulps apart at most, and rtol 1e-5 is ~80 ulps at any scale
        for mine, theirs in zip(
            (served[0], served[1], *served[2]), (expected[0], expected[1], *expected[2]), strict=True
        ):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    # running_mean, running_var (<= ~9: 1 ulp = 9.5e-7), num_batches_tracked: a few ulps, under 1e-6 + 1e-6 x |x|
    for name, buffer in cpu.named_buffers():
        torch.testing.assert_close(dict(device.named_buffers())[name].cpu(), buffer, atol=1e-6, rtol=1e-6, msg=name)
    cpu.eval()
    device.eval()  # evaluation reads the running statistics
    x = torch.randn(*shape)  # statistics equal to a few ulps: so are the normalized outputs (order 1), under 1e-5
    torch.testing.assert_close(device(x.to("neuron")).detach().cpu(), cpu(x).detach(), atol=1e-5, rtol=1e-5)
