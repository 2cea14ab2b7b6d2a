"""What TorchNeuron refuses, refused by the stand-in too, and the plugin working within it (in one process; the
process-group rules across processes are in test_distributed.py and every multi-process test)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_trn  # noqa: F401  registers accelerator="neuron"

pytestmark = pytest.mark.native_only


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator))


def _fit(model: LightningModule, loader: DataLoader, tmp_path, **kwargs) -> Trainer:
    trainer = Trainer(
        accelerator="neuron",
        devices=1,
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(model, loader)
    return trainer


def test_forked_loader_workers_train_as_in_process_loading(tmp_path) -> None:
    """DataLoader workers fork after the device is in use (the default start method on Linux). TorchNeuron refuses
    the device in such a child, not the fork: workers that only build host batches train as loading in-process."""
    models = []
    for workers in (0, 2):
        model = Regression()
        _fit(model, DataLoader(_data(), batch_size=8, num_workers=workers), tmp_path)
        models.append(model.layer.weight.detach().cpu())
    torch.testing.assert_close(models[1], models[0], rtol=0, atol=0)


class _DeviceDataset(Dataset):
    """A dataset that puts its samples on the device: what a forked worker may not do."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((2,), float(index), device="neuron")


def test_device_use_in_a_forked_worker_is_refused_naming_spawn() -> None:
    torch.zeros(1, device="neuron")  # the runtime has started in this process
    loader = DataLoader(_DeviceDataset(), batch_size=4, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="Cannot re-initialize Neuron runtime in forked subprocess.*'spawn'"):
        next(iter(loader))
    assert not torch.neuron._is_in_bad_fork()  # the parent itself may go on


_FORKS = """
import os, torch
from lightning_trn import standin

def child_allocates() -> str:
    read, write = os.pipe()
    if os.fork() == 0:
        try:
            torch.zeros(1, device="neuron")
            os.write(write, b"ok")
        except RuntimeError as err:
            os.write(write, str(err).encode()[:200])
        os._exit(0)
    os.wait()
    return os.read(read, 200).decode()

print("before:", child_allocates())
torch.zeros(1, device="neuron")
print("after:", child_allocates())
"""


def test_only_children_forked_after_the_runtime_started_are_refused() -> None:
    """As CUDA's rule (and TorchNeuron's intent): the device starts with the first device tensor; a child forked
    before that may use it, one forked after may not."""
    env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1"}
    run = subprocess.run([sys.executable, "-c", _FORKS], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = run.stdout.splitlines()[-2:]
    assert before == "before: ok"
    assert after.startswith("after: Cannot re-initialize Neuron runtime in forked subprocess"), after


class _BinaryModel(LightningModule):
    def __init__(self, with_logits: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.with_logits = with_logits

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.layer(x)
        if self.with_logits:
            return F.binary_cross_entropy_with_logits(logits, y)
        return F.binary_cross_entropy(torch.sigmoid(logits), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_autocast_refuses_binary_cross_entropy_as_torchneuron(tmp_path) -> None:
    """TorchNeuron's autocast bans `binary_cross_entropy` with CUDA's message; bf16-mixed passes that on, and the
    logits form it names trains."""
    probs, target = torch.rand(3, device="neuron"), torch.rand(3, device="neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(probs, target)
    F.binary_cross_entropy(probs, target)  # outside autocast it runs
    targets = (torch.rand(16, 1, generator=torch.Generator().manual_seed(2)) > 0.5).float()
    data = TensorDataset(torch.randn(16, 4), targets)
    with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
        _fit(_BinaryModel(with_logits=False), DataLoader(data, batch_size=8), tmp_path, precision="bf16-mixed")
    trainer = _fit(_BinaryModel(with_logits=True), DataLoader(data, batch_size=8), tmp_path, precision="bf16-mixed")
    assert trainer.global_step == 2
