"""`lightning_trn.hooks.zero_grad`: in a Neuron run the previous step's gradients are set to None before the forward,
and everything else about Lightning's automatic optimization is its own (same weights, same hook order apart from
the zero-grad moving ahead of `training_step`, accumulation windows, `optimizer_zero_grad` overrides, manual
optimization untouched)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loops.optimization.automatic import Closure
from torch.utils.data import DataLoader, TensorDataset

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.hooks import registry

pytestmark = pytest.mark.native_only

ZERO_GRAD_EVENTS = ("on_before_zero_grad", "optimizer_zero_grad")


class Recorder(LightningModule):
    """A linear regression that records its hook calls in order and, at every forward, whether any gradient is
    held. `zeroing`: what its `optimizer_zero_grad` does ("none": set to None, "zero": fill zeros, "skip": nothing,
    so gradients add up over the run)."""

    def __init__(self, zeroing: str = "none", manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.zeroing = zeroing
        self.automatic_optimization = not manual
        self.events: list[str] = []
        self.grads_at_forward: list[bool] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        self.events.append("training_step")
        self.grads_at_forward.append(any(p.grad is not None for p in self.parameters()))
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        self.manual_backward(loss)
        if batch_idx % 2 == 1:  # the user's own accumulation over two batches
            optimizer.step()
            optimizer.zero_grad()
        return None

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.events.append("on_before_zero_grad")

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        self.events.append("optimizer_zero_grad")
        if self.zeroing != "skip":
            optimizer.zero_grad(set_to_none=self.zeroing == "none")

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.events.append("backward")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.events.append("optimizer_step")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(24, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _fit(module: Recorder, accelerator: str = "cpu", **trainer_args: object) -> Recorder:
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    trainer.fit(module, _loader())
    return module


def test_neuron_run_holds_no_gradients_during_the_forward_and_lightnings_run_does() -> None:
    """On the `neuron` device every forward after the first optimizer step sees no gradient, and the run ends with
    Lightning's `Closure` back; the same model on the CPU in the same process (Lightning's own order) holds the
    previous step's gradients in every forward but the first."""
    original = Closure.__dict__["closure"]
    neuron = _fit(Recorder(), accelerator="neuron")
    assert neuron.grads_at_forward == [False] * 6
    assert Closure.__dict__["closure"] is original
    cpu = _fit(Recorder())
    assert cpu.grads_at_forward == [False] + [True] * 5


@pytest.mark.parametrize(
    ("zeroing", "accumulate"),
    [("none", 1), ("zero", 2), ("skip", 1)],
    ids=["set-to-none", "zeros-accumulating-2", "override-never-zeroes"],
)
def test_hooked_closure_equals_lightnings_apart_from_the_zero_grad_moving_ahead(zeroing: str, accumulate: int) -> None:
    """With the hook (as in a Neuron run) and without it, on the CPU: equal weights after the epoch; the same events
    with the zero-grad ones taken out; and each zero-grad (only on the first batch of an accumulation window, through
    the module's own `optimizer_zero_grad`) right before that batch's `training_step` instead of after it."""
    lightning = _fit(Recorder(zeroing), accumulate_grad_batches=accumulate)
    with registry.installed(registry.HOOKS):
        hooked = _fit(Recorder(zeroing), accumulate_grad_batches=accumulate)
    assert torch.equal(hooked.layer.weight, lightning.layer.weight)
    assert torch.equal(hooked.layer.bias, lightning.layer.bias)

    def without_zero_grad(events: list[str]) -> list[str]:
        return [event for event in events if event not in ZERO_GRAD_EVENTS]

    assert without_zero_grad(hooked.events) == without_zero_grad(lightning.events)
    zero_grad, step = [*ZERO_GRAD_EVENTS], ["training_step"]
    window_start, inside = zero_grad + step + ["backward"], step + ["backward"]
    if accumulate == 1:
        assert hooked.events == (window_start + ["optimizer_step"]) * 6
        assert lightning.events[:5] == ["training_step", *zero_grad, "backward", "optimizer_step"]
    else:
        assert hooked.events == (window_start + inside + ["optimizer_step"]) * 3
    if zeroing == "none":  # set to None before each forward, by the module's own override
        assert hooked.grads_at_forward == [False] * 6


def test_manual_optimization_is_untouched() -> None:
    """A manually optimized module (its own accumulation over two batches, its own `zero_grad`) trains and holds its
    gradients exactly as without the hook."""
    lightning = _fit(Recorder(manual=True))
    with registry.installed(registry.HOOKS):
        hooked = _fit(Recorder(manual=True))
    assert torch.equal(hooked.layer.weight, lightning.layer.weight)
    assert hooked.grads_at_forward == lightning.grads_at_forward == [False, True, False, True, False, True]
    assert hooked.events == lightning.events
