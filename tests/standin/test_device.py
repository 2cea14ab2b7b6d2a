"""The stand-in device against CPU results: tensors, models, optimizers, autocast, placement rules, device reads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_trn import standin

pytestmark = pytest.mark.native_only

NEURON = torch.device("neuron", 0)


def test_tensors_live_on_the_device_and_copy_back_exactly() -> None:
    host = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    device = host.to("neuron")
    assert device.device == NEURON and device.is_neuron
    assert torch.equal(device.cpu(), host)
    view = device[1:3, ::2]  # a strided view shares the device storage
    view.mul_(-1)
    host[1:3, ::2].mul_(-1)
    assert torch.equal(device.cpu(), host)
    on_second = device.to("neuron:1")
    assert on_second.device == torch.device("neuron", 1)
    assert torch.equal(on_second.cpu(), host)
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.bool):
        assert torch.equal(host.to(dtype).to("neuron").cpu(), host.to(dtype))


def _twin_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    device = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    device.load_state_dict(cpu.state_dict())
    return cpu, device.to("neuron")


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_training_steps_equal_cpu(optimizer: type) -> None:
    cpu, device = _twin_models()
    assert all(p.device == NEURON for p in device.parameters())
    opt_cpu, opt_device = optimizer(cpu.parameters(), lr=0.05), optimizer(device.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        for model, opt, where in ((cpu, opt_cpu, "cpu"), (device, opt_device, "neuron")):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x.to(where)), y.to(where))
            loss.backward()
            opt.step()
        assert loss.device == NEURON
    # the stand-in runs the CPU's kernels, and the optimizers' foreach path does the single-tensor path's arithmetic:
    # the same values bit for bit, so the tolerance absorbs nothing
    for p_cpu, p_device in zip(cpu.parameters(), device.parameters(), strict=True):
        assert p_device.grad is not None and p_device.grad.device == NEURON
        torch.testing.assert_close(p_device.cpu(), p_cpu, rtol=1e-6, atol=1e-6)


def test_saved_device_tensors_load_on_cpu_without_the_stand_in(tmp_path) -> None:
    _, device = _twin_models()
    path = tmp_path / "state.pt"
    torch.save(device.state_dict(), path)
    code = (
        "import sys, torch\n"
        f"state = torch.load({str(path)!r}, map_location='cpu', weights_only=True)\n"
        "assert torch._C._get_privateuse1_backend_name() == 'privateuseone'  # no stand-in in this process\n"
        "print({k: v.flatten()[:2].tolist() for k, v in state.items()}, {str(v.device) for v in state.values()})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    expected = {k: v.flatten()[:2].tolist() for k, v in device.state_dict().items()}
    assert out.strip() == f"{expected} {{'cpu'}}"


def test_autocast_runs_matmuls_in_bf16_and_losses_in_fp32() -> None:
    _, device = _twin_models()
    x, y = torch.randn(6, 8, device="neuron"), torch.randn(6, 4, device="neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        out = device(x)
        assert out.dtype == torch.bfloat16
        assert (x @ x.T).dtype == torch.bfloat16
        assert nn.functional.mse_loss(out, y).dtype == torch.float32
        assert torch.softmax(out, dim=-1).dtype == torch.float32
        labels = torch.zeros(6, dtype=torch.long, device="neuron")
        assert nn.functional.cross_entropy(out, labels).dtype == torch.float32
    assert device(x).dtype == torch.float32


def test_ops_mixing_devices_fail_as_on_a_real_device() -> None:
    a = torch.ones(3, device="neuron")
    with pytest.raises(RuntimeError, match="same device, but found at least two devices, neuron:0 and cpu"):
        a + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device.*neuron:0 and neuron:1"):
        a + torch.ones(3, device="neuron:1")
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([a, torch.ones(3)])
    # As on CUDA: a 0-dim CPU tensor is a scalar, and index tensors may stay on the host.
    assert torch.equal((a * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))
    assert torch.equal(torch.arange(5.0, device="neuron")[torch.tensor([4, 0])].cpu(), torch.tensor([4.0, 0.0]))


def test_device_reads_are_counted_and_the_fallback_is_not() -> None:
    a = torch.randn(4, 4, device="neuron")
    standin.reset_counters()
    b = (a @ a + 1).relu().sum(dim=0)  # device ops only: the fallback's own copies are not reads
    assert standin.counters() == {
        "device_to_host": 0,
        "host_to_device": 0,
        "host_to_device_bytes": 0,
        "scalar_reads": 0,
        "host_syncs": 0,
    }
    b.cpu()
    b[0].item()
    bool(b[1] > -1)
    b.tolist()
    torch.ones(2).to("neuron")
    # each read waits for the device: a host sync
    assert standin.counters() == {
        "device_to_host": 2,
        "host_to_device": 1,
        "host_to_device_bytes": 8,
        "scalar_reads": 2,
        "host_syncs": 4,
    }
    standin.reset_counters()
    assert standin.counters()["device_to_host"] == standin.counters()["host_syncs"] == 0


def test_copies_queued_without_waiting_are_transfers_and_the_wait_is_the_host_sync() -> None:
    """As on an asynchronous device: a `non_blocking` copy to the host lands in pinned memory without a wait; the
    host syncs are the blocking reads and the synchronize calls, whichever API makes them."""
    a = torch.arange(6.0, device="neuron")
    standin.reset_counters()
    queued = [a.to("cpu", non_blocking=True), (a * 2).to("cpu", non_blocking=True)]
    assert standin.counters() == {
        "device_to_host": 2,
        "host_to_device": 0,
        "host_to_device_bytes": 0,
        "scalar_reads": 0,
        "host_syncs": 0,
    }
    assert all(copy.is_pinned() for copy in queued) and not a.cpu().is_pinned()
    torch.neuron.synchronize()
    torch.accelerator.synchronize()
    torch.Stream(device="neuron").synchronize()
    assert standin.counters()["host_syncs"] == 4  # the blocking `.cpu()` above and the three waits
    assert torch.equal(queued[1], torch.arange(6.0) * 2)
    pinned = torch.ones(3).pin_memory()
    assert pinned.is_pinned() and not torch.ones(3).is_pinned()
    assert torch.equal(pinned.to("neuron", non_blocking=True).cpu(), torch.ones(3))


def test_fallback_ops_are_counted_by_name() -> None:
    a = torch.randn(4, device="neuron")
    standin.reset_counters()
    a + a
    a + a
    torch.relu(a)
    counts = standin.fallback_counts()
    assert counts["aten::add.out"] == 2  # structured ops reach the device as their out= variant
    assert counts["aten::relu"] == 1
    standin.reset_counters()
    assert standin.fallback_counts() == {}


def test_host_ops_run_like_cpu_fallback_ops_only_inside_the_block() -> None:
    a = torch.randn(4, device="neuron")
    standin.reset_counters()
    with standin.host_ops(["aten::relu"]):
        torch.relu(a)
        a + a  # not named: served on the device as before
        with standin.strict(), pytest.raises(RuntimeError, match="strict mode"):
            torch.relu(a)  # a CPU-fallback op reads the device
    torch.relu(a)
    assert standin.host_op_counts() == {"aten::relu": 2}
    assert standin.counters()["device_to_host"] == 1  # the first relu's input (the strict one stopped at its read)
    with pytest.raises(standin.StandinError, match="`namespace::name`"), standin.host_ops(["relu"]):
        pass


def test_strict_mode_refuses_device_reads() -> None:
    a = torch.randn(4, device="neuron")
    with standin.strict():
        b = (a * 2).sum()  # device work is fine
        for read in (lambda: b.item(), lambda: a.cpu(), lambda: bool(b), lambda: print(a)):
            with pytest.raises(RuntimeError, match="strict mode: a device->host read"):
                read()
    assert isinstance(b.item(), float)  # allowed again outside the block


def test_manual_seed_seeds_the_device_generator() -> None:
    torch.neuron.manual_seed(7)
    first = torch.randn(5, device="neuron")
    drop_first = nn.functional.dropout(torch.ones(64, device="neuron"), 0.5)
    torch.neuron.manual_seed(7)
    torch.randn(100)  # draws from the CPU generator in between must not matter
    assert torch.equal(torch.randn(5, device="neuron").cpu(), first.cpu())
    assert torch.equal(nn.functional.dropout(torch.ones(64, device="neuron"), 0.5).cpu(), drop_first.cpu())
    torch.neuron.manual_seed(8)
    assert not torch.equal(torch.randn(5, device="neuron").cpu(), first.cpu())
    torch.manual_seed(7)  # torch.manual_seed reaches every device (torch calls torch.neuron.manual_seed_all)
    assert torch.equal(torch.randn(5, device="neuron").cpu(), first.cpu())
    state = torch.neuron.get_rng_state()
    again = torch.randn(3, device="neuron")
    torch.neuron.set_rng_state(state)
    assert torch.equal(torch.randn(3, device="neuron").cpu(), again.cpu())


def test_memory_statistics_follow_allocations() -> None:
    torch.neuron.reset_peak_memory_stats()
    before = torch.accelerator.memory_allocated(0)
    block = torch.empty(1 << 18, dtype=torch.float32, device="neuron")  # 1 MiB
    assert torch.neuron.memory_allocated() - before == 1 << 20
    assert torch.neuron.memory_stats()["allocated_bytes.all.current"] - before == 1 << 20
    del block
    assert torch.neuron.memory_allocated() == before
    assert torch.neuron.max_memory_allocated() >= before + (1 << 20)
    assert torch.neuron.memory_allocated(1) == 0


def test_device_module() -> None:
    assert torch.get_device_module("neuron") is torch.neuron
    assert torch.neuron.is_available() and torch.neuron.device_count() == 2
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    with torch.neuron.device(1):
        assert torch.neuron.current_device() == 1
        assert torch.empty(1, device="neuron").device == torch.device("neuron", 1)
    assert torch.neuron.current_device() == 0
    with pytest.raises(RuntimeError, match="Invalid device index neuron:5"):
        torch.empty(1, device="neuron:5")
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    torch.neuron.synchronize()
    end.record()
    assert start.elapsed_time(end) >= 0
    assert torch.neuron.current_stream().device == NEURON


def test_processes_that_ran_backward_exit_cleanly() -> None:
    """Without `_release_finished_backward_tasks` most of these abort at exit (SIGABRT, "terminate called without an
    active exception"): the device's autograd thread releases Python state while Python finalizes."""
    code = (  # a script that ends right after its backward
        "import torch, lightning_trn.standin; x = torch.ones(2, device='neuron', requires_grad=True); "
        "(x * 2).sum().backward()"
    )
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True) for _ in range(6)]
    assert [(r.returncode, r.stderr.strip()[-200:]) for r in runs] == [(0, "")] * 6


def test_device_count_comes_from_the_environment() -> None:
    code = (
        "import torch, lightning_trn.standin; "
        "print(torch.neuron.device_count(), torch.randn(2, device='neuron:2').device)"
    )
    env = {**__import__("os").environ, "LIGHTNING_TRN_STANDIN_DEVICES": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["3", "neuron:2"]
