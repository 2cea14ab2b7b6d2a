"""`lightning_trn.hooks.loop_shortcuts`: each shortcut through Lightning's per-step machinery gives the same result as
the code it bypasses, and is taken."""

import functools

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loops import evaluation_loop, prediction_loop, training_epoch_loop
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from models import RegressionModel, regression_loader
from torch import nn

from lightning_trn.hooks.loop_shortcuts import _NullContextProfiler, _UnscaledClosureResult, cached_signature_check

pytestmark = pytest.mark.xla_only


@pytest.fixture
def module_setattr_calls(monkeypatch, neuron_run_hooks):
    """Names set through `nn.Module.__setattr__` (the slow path the `_current_fx_name` shortcut avoids)."""
    names: list[str] = []
    real = nn.Module.__setattr__

    def counted(self, name, value):
        names.append(name)
        real(self, name, value)

    monkeypatch.setattr(nn.Module, "__setattr__", counted)
    return names


def test_current_fx_name_is_stored_without_module_setattr(module_setattr_calls):
    module = LightningModule()
    module_setattr_calls.clear()
    module._current_fx_name = "training_step"
    module._current_fx_name = None
    assert module_setattr_calls == []
    assert module._current_fx_name is None
    module._current_fx_name = "validation_step"
    assert module.__dict__["_current_fx_name"] == "validation_step"


def test_other_attributes_still_register_as_torch_does(module_setattr_calls):
    module, layer, scale = LightningModule(), nn.Linear(2, 2), nn.Parameter(torch.ones(1))
    module.register_buffer("offset", torch.zeros(1))
    module_setattr_calls.clear()
    module.layer = layer
    module.scale = scale
    module.offset = torch.ones(1)  # assigning to a buffer name replaces the buffer
    assert module_setattr_calls == ["layer", "scale", "offset"]
    assert set(dict(module.named_parameters())) == {"layer.weight", "layer.bias", "scale"}
    assert torch.equal(dict(module.named_buffers())["offset"], torch.ones(1))


class Steps:
    def batch_only(self, batch):
        pass

    def with_index(self, batch, batch_idx):
        pass

    def with_iter(self, dataloader_iter):
        pass

    def variadic(self, *args):
        pass


CASES = [
    ("batch_idx", False, 2),
    ("batch_idx", False, None),
    ("dataloader_iter", True, None),
    ("dataloader_idx", False, None),
]


@pytest.mark.parametrize("method", ["batch_only", "with_index", "with_iter", "variadic"])
@pytest.mark.parametrize("param, explicit, min_args", CASES)
def test_signature_cache_answers_like_lightning(method, param, explicit, min_args):
    cached = cached_signature_check(is_param_in_hook_signature)
    for hook in (getattr(Steps(), method), getattr(Steps, method)):  # bound and plain functions answer differently
        expected = is_param_in_hook_signature(hook, param, explicit=explicit, min_args=min_args)
        for _ in range(2):  # computed, then remembered
            assert cached(hook, param, explicit, min_args) == expected


def test_signature_cache_asks_once_per_function_and_never_for_other_callables():
    asked: list = []

    def check(hook, param, explicit=False, min_args=None):
        asked.append(hook)
        return is_param_in_hook_signature(hook, param, explicit, min_args)

    cached = cached_signature_check(check)
    for instance in (Steps(), Steps(), Steps()):  # a new bound method every time, as `module.training_step` is
        assert cached(instance.with_index, "batch_idx", False, 2)
    assert len(asked) == 1
    partial = functools.partial(Steps.with_index, Steps())
    cached(partial, "batch_idx", False, 2)
    cached(partial, "batch_idx", False, 2)
    assert len(asked) == 3


def test_the_loops_use_the_cached_signature_check(neuron_run_hooks):
    for module in (training_epoch_loop, evaluation_loop, prediction_loop):
        assert module.is_param_in_hook_signature.__qualname__.startswith("cached_signature_check")


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.returned: list[torch.Tensor] = []
        self.reported: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.reported.append(outputs["loss"].detach().cpu())
        self.returned.append(pl_module.last_loss.detach().cpu())


class RecordsItsLoss(RegressionModel):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.last_loss = nn.functional.mse_loss(self.layer(x), y)
        return self.last_loss


def _fit(tmp_path, accelerator: str, **trainer_kwargs) -> tuple[Trainer, LossRecorder]:
    recorder = LossRecorder()
    trainer = Trainer(
        accelerator=accelerator,
        max_steps=4,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    trainer.fit(RecordsItsLoss(), train_dataloaders=regression_loader())
    return trainer, recorder


@pytest.mark.parametrize("accumulate", [1, 2])
def test_step_output_loss_is_scaled_exactly_as_lightning_scales_it(tmp_path, accumulate):
    trainer, recorder = _fit(tmp_path, "neuron", accumulate_grad_batches=accumulate)
    assert trainer.fit_loop.epoch_loop.automatic_optimization.output_result_cls is _UnscaledClosureResult
    for returned, reported in zip(recorder.returned, recorder.reported, strict=True):
        assert torch.equal(reported, returned / accumulate)


def test_unscaled_closure_result_leaves_the_loss_untouched_only_when_nothing_accumulates():
    loss = torch.tensor(3.0, requires_grad=True)
    result = _UnscaledClosureResult.from_training_step_output({"loss": loss, "acc": 1}, 1)
    assert result.closure_loss is loss  # no division op traced into the step
    assert result.extra == {"acc": 1}
    assert _UnscaledClosureResult.from_training_step_output(loss, 4).closure_loss == 0.75
    assert _UnscaledClosureResult.from_training_step_output(None, 1).closure_loss is None
    for invalid in ({"acc": 1}, "loss"):
        with pytest.raises(MisconfigurationException):
            _UnscaledClosureResult.from_training_step_output(invalid, 1)
        with pytest.raises(MisconfigurationException):
            ClosureResult.from_training_step_output(invalid, 1)


def test_default_profiler_is_replaced_by_one_that_allocates_nothing(tmp_path):
    trainer, _ = _fit(tmp_path, "neuron")
    assert isinstance(trainer.profiler, _NullContextProfiler)
    assert trainer.profiler.profile("a") is trainer.profiler.profile("b")


def test_a_profiler_the_user_chose_is_kept_and_records(tmp_path):
    trainer, _ = _fit(tmp_path, "neuron", profiler=SimpleProfiler(dirpath=tmp_path, filename="profile"))
    assert type(trainer.profiler) is SimpleProfiler
    assert len(trainer.profiler.recorded_durations["run_training_batch"]) == 4


def test_runs_on_other_accelerators_keep_lightnings_own_loop(tmp_path):
    trainer, recorder = _fit(tmp_path, "cpu", accumulate_grad_batches=2)
    assert type(trainer.profiler) is PassThroughProfiler
    assert trainer.fit_loop.epoch_loop.automatic_optimization.output_result_cls is ClosureResult
    assert torch.equal(recorder.reported[0], recorder.returned[0] / 2)
