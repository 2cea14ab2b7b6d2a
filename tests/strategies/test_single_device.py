"""`Trainer(accelerator="neuron")` on one device: placement, learning, compile behaviour, portable checkpoints."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from models import RegressionModel, regression_loader
from xla_free_python import run_without_torch_xla

from lightning_trn.core.device_loader import DevicePrefetchLoader
from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.xla_only

STEPS_PER_EPOCH = 32  # 512 samples / batch 16


class Recorder(Callback):
    """Keeps per-step losses and runtime counters. Reading each loss on the host after the step costs no extra
    graph execution only if the strategy cut the graph after the optimizer update."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.metrics: dict[int, object] = {}
        self.param_devices: set[str] = set()

    def on_train_start(self, trainer, pl_module):
        self.param_devices = {p.device.type for p in pl_module.parameters()}
        self.train_loader = trainer.fit_loop._combined_loader.flattened[0]  # what the loop iterates

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.metrics[trainer.global_step] = get_runtime().metrics()


def fit(tmp_path: Path, max_steps: int, **trainer_kwargs):
    recorder = Recorder()
    model = RegressionModel()
    trainer = Trainer(
        accelerator="neuron",
        max_steps=max_steps,
        default_root_dir=tmp_path,
        callbacks=[recorder],
        log_every_n_steps=10,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return trainer, model, recorder


def test_fit_trains_on_xla_in_one_graph_per_step_and_stops_compiling(tmp_path):
    trainer, model, recorder = fit(tmp_path, max_steps=4 * STEPS_PER_EPOCH)

    assert recorder.param_devices == {"xla"}
    assert model.batch_devices == {"xla"}
    assert isinstance(recorder.train_loader, DevicePrefetchLoader)

    losses = torch.tensor(recorder.losses)
    assert losses[-5:].mean() < 0.01 * losses[:5].mean()

    # Steady state (after the first epoch, whose end adds the checkpoint/transfer graphs once): no compiles,
    # across two more epoch boundaries with checkpointing and logging.
    start, end = STEPS_PER_EPOCH + 8, 4 * STEPS_PER_EPOCH
    assert (recorder.metrics[end] - recorder.metrics[start]).compiles == 0
    # Inside an epoch each optimizer step is exactly one graph execution: the cut is after the update.
    inside = recorder.metrics[2 * STEPS_PER_EPOCH - 2] - recorder.metrics[STEPS_PER_EPOCH + 8]
    assert inside.executions == STEPS_PER_EPOCH - 10
    assert inside.cpu_fallbacks == {}


def test_checkpoint_is_portable_and_resumes_on_cpu_without_torch_xla(tmp_path):
    trainer, model, _ = fit(tmp_path, max_steps=2 * STEPS_PER_EPOCH, enable_progress_bar=False)
    ckpt = Path(trainer.checkpoint_callback.best_model_path)
    assert ckpt.is_file()
    saved_weight = model.layer.weight.detach().cpu().clone()

    result = run_without_torch_xla(
        f"""
        import sys, torch
        sys.path.insert(0, "tests")
        assert "torch_xla" not in sys.modules
        ckpt = torch.load({str(ckpt)!r}, weights_only=True, map_location="cpu")
        tensors = []
        def walk(obj):
            if isinstance(obj, torch.Tensor): tensors.append(obj)
            elif isinstance(obj, dict): [walk(v) for v in obj.values()]
            elif isinstance(obj, (list, tuple)): [walk(v) for v in obj]
        walk(ckpt)
        assert tensors and all(t.device.type == "cpu" for t in tensors)
        print("WEIGHT", ckpt["state_dict"]["layer.weight"].flatten().tolist())

        import lightning_trn
        from lightning.pytorch import Callback, Trainer
        from models import RegressionModel
        class StartStep(Callback):
            def on_train_start(self, trainer, pl_module):
                print("START_STEP", trainer.global_step, pl_module.device.type)
        trainer = Trainer(accelerator="cpu", max_steps={2 * STEPS_PER_EPOCH + 10}, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, callbacks=[StartStep()])
        model = RegressionModel()
        trainer.fit(model, ckpt_path={str(ckpt)!r})
        print("RESUMED_STEP", trainer.global_step)
        assert "torch_xla" not in sys.modules
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    weights = [line for line in result.stdout.splitlines() if line.startswith("WEIGHT")][0]
    assert torch.allclose(torch.tensor(eval(weights.split(" ", 1)[1])), saved_weight.flatten())
    assert f"START_STEP {2 * STEPS_PER_EPOCH} cpu" in result.stdout
    assert f"RESUMED_STEP {2 * STEPS_PER_EPOCH + 10}" in result.stdout


class EvaluatedModel(RegressionModel):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])

    def val_dataloader(self):
        return regression_loader(64, shuffle=False)

    test_dataloader = predict_dataloader = val_dataloader


def test_validate_test_predict_work_with_lightnings_default_inference_mode(tmp_path):
    trainer = Trainer(
        accelerator="neuron", max_steps=4, val_check_interval=2, default_root_dir=tmp_path, enable_progress_bar=False
    )
    assert trainer.validate_loop.inference_mode  # the Trainer default, which XLA tensors cannot run under
    model = EvaluatedModel()
    trainer.fit(model)
    assert trainer.callback_metrics["val_loss"] > 0
    assert trainer.validate(model, verbose=False)[0]["val_loss"] > 0
    assert trainer.test(model, verbose=False)[0]["val_loss"] > 0
    predictions = trainer.predict(model)
    assert predictions[0].shape == (16, 1)


class DropoutModel(RegressionModel):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(0.5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(self.dropout(x)), y)


def _weights_after_seeded_fit(tmp_path, seed: int) -> torch.Tensor:
    from lightning.pytorch import seed_everything

    seed_everything(seed)
    model = DropoutModel()
    torch.manual_seed(0)  # same initial weights and data order: only the device RNG (dropout) depends on `seed`
    model.layer.reset_parameters()
    trainer = Trainer(
        accelerator="neuron",
        max_steps=5,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, train_dataloaders=regression_loader(shuffle=False))
    return model.layer.weight.detach().cpu()


def test_seed_everything_reaches_the_device_rng(tmp_path):
    first = _weights_after_seeded_fit(tmp_path, 1)
    assert torch.equal(first, _weights_after_seeded_fit(tmp_path, 1))
    assert not torch.equal(first, _weights_after_seeded_fit(tmp_path, 2))
