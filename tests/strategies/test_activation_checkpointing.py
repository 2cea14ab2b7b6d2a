"""Activation checkpointing in Neuron runs (`lightning_trn.hooks.activation_checkpointing`), both suites: torch's
`checkpoint` (both implementations), Hugging Face's `gradient_checkpointing_enable()`; on XLA the recompute is
fenced with optimization barriers in the graph handed to the compiler."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_trn.runtime import get_runtime
from tests.models import regression_loader

pytestmark = pytest.mark.both

BLOCKS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.drop(self.linear(x))) * scale


class Stack(nn.Module):
    """`BLOCKS` blocks with dropout, each checkpointed as users write it (a non-tensor kwarg with the non-reentrant
    implementation, a positional one with the reentrant one, `"wrapper"`: torch's `checkpoint_wrapper`) or not at
    all (`use_reentrant` None)."""

    def __init__(self, use_reentrant: bool | str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        if use_reentrant == "wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            self.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in self.blocks)
        self.head = nn.Linear(8, 1)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.use_reentrant is None or self.use_reentrant == "wrapper":
                x = block(x, scale=2.0)
            elif self.use_reentrant:
                x = checkpoint(block, x, 2.0, use_reentrant=True)
            else:
                x = checkpoint(block, x, use_reentrant=False, scale=2.0)
        return self.head(x)


def _loss_and_grads(use_reentrant: bool | str | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    runtime = get_runtime()
    device = runtime.device()
    torch.manual_seed(0)
    model = Stack(use_reentrant).to(device)
    x = torch.randn(4, 8).to(device).requires_grad_(use_reentrant is True)  # reentrant needs an input with grad
    runtime.manual_seed(5)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("use_reentrant", [False, True, "wrapper"])
def test_checkpointed_blocks_give_the_plain_models_loss_and_gradients_dropout_included(
    neuron_run_hooks: None, use_reentrant: bool | str
):
    plain_loss, plain_grads = _loss_and_grads(None)
    loss, grads = _loss_and_grads(use_reentrant)
    assert torch.equal(loss.cpu(), plain_loss.cpu())
    for grad, plain in zip(grads, plain_grads, strict=True):  # the recompute drew the forward's dropout masks again
        assert torch.equal(grad.cpu(), plain.cpu())


def _fenced_dots(hlo: str) -> tuple[int, int]:
    """(optimization barriers, matmuls that take a barrier's output) in an HLO module's text."""
    barriers = re.findall(r"^\s*(%?[\w.-]+) = .* opt-barrier\(", hlo, flags=re.MULTILINE)
    fenced = (
        set(
            re.findall(
                rf"^\s*(%?[\w.-]+) = .*get-tuple-element\(.*({'|'.join(map(re.escape, barriers))})\)",
                hlo,
                flags=re.MULTILINE,
            )
        )
        if barriers
        else set()
    )
    names = {name for name, _ in fenced}
    dots = re.findall(r"^\s*%?[\w.-]+ = .* dot\(([^)]*)\)", hlo, flags=re.MULTILINE)
    return len(barriers), sum(any(o.strip().split(" ")[-1] in names for o in ops.split(",")) for ops in dots)


@pytest.mark.xla_only
@pytest.mark.parametrize("use_reentrant", [False, True, "wrapper"])
def test_recompute_reaches_the_compiler_fenced_by_one_barrier_per_block(
    neuron_run_hooks: None, use_reentrant: bool | str
):
    """The graph torch_xla hands the compiler (pre-optimization HLO, what neuronx-cc receives) recomputes every
    block from barrier outputs, so common-subexpression elimination cannot merge it with the forward."""
    import torch_xla

    _, grads = _loss_and_grads(use_reentrant)
    barriers, fenced_matmuls = _fenced_dots(torch_xla._XLAC._get_xla_tensors_hlo(grads))
    assert (barriers, fenced_matmuls) == (BLOCKS, BLOCKS)


@pytest.mark.xla_only
def test_without_the_hooks_torchs_checkpoint_fails_on_xla_and_torch_xla_is_gone_after_the_run():
    """What the hooks fix (torch asks for a `torch.xla` module torch_xla does not register), and that they are put
    back when the run ends."""
    from lightning_trn.hooks import registry

    with pytest.raises((AttributeError, RuntimeError), match="xla"):
        _loss_and_grads(False)
    registry.acquire()
    try:
        assert hasattr(torch, "xla")
        _loss_and_grads(False)
    finally:
        registry.release()
    assert not hasattr(torch, "xla")


def _wrapped_blocks(model: nn.Module) -> int:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return sum(isinstance(module, CheckpointWrapper) for module in model.modules())


@pytest.mark.parametrize("use_reentrant", [False, True, "policy"])
def test_a_fabric_loop_checkpoints_like_the_plain_model_and_leaves_torch_as_it_was(use_reentrant: bool | str):
    """Fabric has no teardown: the hooks are in place for each forward and backward pass of a Neuron module only.
    `"policy"`: the strategy's `activation_checkpointing_policy={Block}` checkpoints the plain model's blocks."""
    from lightning.fabric import Fabric

    from lightning_trn.fabric import SingleDeviceNeuronStrategy

    original_lookup = torch.utils.checkpoint._get_device_module

    def loss_and_grads(mode: bool | str | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        policy = {Block} if mode == "policy" else None
        strategy = SingleDeviceNeuronStrategy(activation_checkpointing_policy=policy)
        fabric = Fabric(accelerator="neuron", strategy=strategy)
        torch.manual_seed(0)
        model = fabric.setup(Stack(None if mode == "policy" else mode))
        assert _wrapped_blocks(model) == (BLOCKS if mode == "policy" else 0)
        x = fabric.to_device(torch.randn(4, 8)).requires_grad_(mode is True)
        get_runtime().manual_seed(5)
        loss = model(x).pow(2).mean()
        fabric.backward(loss)
        return loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()]

    plain_loss, plain_grads = loss_and_grads(None)
    loss, grads = loss_and_grads(use_reentrant)
    assert torch.equal(loss, plain_loss)
    for grad, plain in zip(grads, plain_grads, strict=True):
        assert torch.equal(grad, plain)
    assert torch.utils.checkpoint._get_device_module is original_lookup
    assert not hasattr(torch, "xla")


class Regression(pl.LightningModule):
    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), Stack(use_reentrant))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(use_reentrant: bool | str | None, tmp_path) -> dict[str, torch.Tensor]:
    """`"policy"`: the plain model, its blocks checkpointed by `activation_checkpointing_policy={Block}`."""
    from lightning_trn import SingleDeviceNeuronStrategy

    pl.seed_everything(1)
    policy = {Block} if use_reentrant == "policy" else None
    model = Regression(None if use_reentrant == "policy" else use_reentrant)
    strategy = SingleDeviceNeuronStrategy(activation_checkpointing_policy=policy)
    trainer = pl.Trainer(
        accelerator="neuron",
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, regression_loader(n=64))
    assert _wrapped_blocks(model) == (BLOCKS if policy else 0)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_a_trainer_run_with_checkpointed_blocks_ends_with_the_plain_runs_weights(tmp_path):
    """Same weights after 4 steps with dropout (a wrong recompute mask moves them by far more than the tolerance,
    which allows for the compiler fusing the two step graphs differently); the policy keeps the state-dict keys."""
    plain = _fit(None, tmp_path)
    for use_reentrant in (False, True, "policy"):
        checkpointed = _fit(use_reentrant, tmp_path)
        assert checkpointed.keys() == plain.keys()
        # plain SGD, lr 0.05, 4 steps: a few ulps of a gradient (<= ~60: ~1e-5) move a weight by lr x that a step,
        # ~2e-6 after 4, under 1e-4
        for name in plain:
            torch.testing.assert_close(
                checkpointed[name],
                plain[name],
                rtol=1e-4,
                atol=1e-4,
                msg=lambda m, use_reentrant=use_reentrant, name=name: f"use_reentrant={use_reentrant} {name}: {m}",
            )


class TinyBert(pl.LightningModule):
    """A 2-layer BERT classifier from a config (no download), with its dropout on."""

    def __init__(self, gradient_checkpointing: bool) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
            num_labels=2,
        )
        self.net = BertForSequenceClassification(config)
        if gradient_checkpointing:
            self.net.gradient_checkpointing_enable()
        self.net.train()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        input_ids, labels = batch
        return self.net(input_ids=input_ids, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_hugging_face_gradient_checkpointing_trains_like_the_plain_model(tmp_path):
    pytest.importorskip("transformers")
    from torch.utils.data import DataLoader, TensorDataset

    def fit(gradient_checkpointing: bool) -> dict[str, torch.Tensor]:
        pl.seed_everything(2)
        model = TinyBert(gradient_checkpointing)
        ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(0))
        loader = DataLoader(TensorDataset(ids, ids[:, 0] % 2), batch_size=8)
        trainer = pl.Trainer(
            accelerator="neuron",
            devices=1,
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(model, loader)
        assert model.net.is_gradient_checkpointing == gradient_checkpointing
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    plain, checkpointed = fit(False), fit(True)
    # plain SGD, lr 0.1, 3 steps: a few ulps of a gradient (<= ~1: ~5e-7) move a weight by lr x that a step, ~2e-7
    # after 3, under 1e-4
    for name in plain:
        torch.testing.assert_close(
            checkpointed[name], plain[name], rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_hugging_face_gradient_checkpointing_gives_the_plain_models_gradients(neuron_run_hooks: None):
    """Gradients of one step, much tighter than the training test above can check: a recompute that draws other
    dropout masks than the forward (torch skipping the device's RNG state) is off by about 1e-3 here."""
    pytest.importorskip("transformers")
    runtime = get_runtime()
    device = runtime.device()

    def grads(gradient_checkpointing: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = TinyBert(gradient_checkpointing).to(device)
        ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
        runtime.manual_seed(3)
        model.net(input_ids=ids.to(device), labels=(ids[:, 0] % 2).to(device)).loss.backward()
        runtime.sync()  # one graph for every gradient (on XLA), then one transfer
        return runtime.to_host([p.grad for p in model.parameters() if p.grad is not None])

    # one backward each, the recompute running the forward's ops again: a few float32 ulps (eps 1.2e-7) apart where
    # the compiler fuses the graphs otherwise, under 1e-5 relative; 1e-6 absolute for gradients near 0 (terms ~1)
    for checkpointed, plain in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-6)


class Deep(nn.Module):
    """8 MLP blocks whose hidden activations are 4x wider than their inputs: what checkpointing saves."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(8)
        )
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


@pytest.mark.native_only
def test_checkpointing_cuts_the_activation_peak_of_the_stand_ins_allocator_at_least_2x(neuron_run_hooks: None):
    """The stand-in's allocator peak (`torch.neuron.max_memory_allocated`, as on TorchNeuron) over a forward and
    backward, less the gradients every run holds at its end: the activations' peak."""
    device_module = torch.get_device_module("neuron")
    device = get_runtime().device()

    def activation_peak(checkpointed: bool) -> int:
        torch.manual_seed(0)
        model = Deep(checkpointed).to(device)
        x = torch.randn(512, 256).to(device)
        before = device_module.memory_allocated()
        device_module.reset_peak_memory_stats()
        model(x).square().mean().backward()
        gradients = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
        return device_module.max_memory_allocated() - before - gradients

    plain, checkpointed = activation_peak(False), activation_peak(True)
    assert plain >= 2 * checkpointed, (plain, checkpointed)
