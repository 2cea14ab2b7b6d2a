"""`Fabric(accelerator="neuron")` on one device, on whichever backend the suite runs: the strategy and
precision it picks, a natural Fabric loop equal to the Trainer's run, precision dtypes, one graph per step and none
read back between steps, an evaluation loop cut per batch, and checkpoints either API resumes. The 2-process runs
are in tests/strategies/test_ddp_training.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch import Trainer
from models import RegressionModel, regression_loader
from torch.utils.data import DataLoader, Subset

import lightning_trn
from lightning_trn import fabric as neuron_fabric
from lightning_trn.runtime import get_runtime

pytestmark = pytest.mark.both

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
STEPS = 6
BATCH = 16
#: float32 and bf16-mixed: the same ops on the same batches in the same order. bf16-true: the Trainer computes the
#: loss in bf16 inside `training_step`, the Fabric loop in float32 from the module's output: two bf16 steps (2**-5
#: each) at the weights' magnitude (4 to 8)
TOLERANCE = {"32-true": 1e-6, "bf16-mixed": 1e-6, "bf16-true": 2 * 2**-5}


class Regression(RegressionModel):
    """With a `forward`, for the Fabric loop (`training_step` logs, which under Fabric reads the loss every step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def loader(first: int = 0, steps: int = STEPS) -> DataLoader:
    """Batches `first` .. `first + steps - 1` of one fixed, unshuffled regression dataset."""
    data = regression_loader(n=BATCH * STEPS, batch_size=BATCH, shuffle=False).dataset
    return DataLoader(Subset(data, range(first * BATCH, (first + steps) * BATCH)), batch_size=BATCH)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().float().cpu() for name, value in model.state_dict().items()}


def trainer_run(precision: str = "32-true", steps: int = STEPS, **fit: object) -> tuple[Trainer, RegressionModel]:
    torch.manual_seed(0)
    model = RegressionModel()
    trainer = Trainer(accelerator="neuron", precision=precision, max_steps=steps, **QUIET)
    trainer.fit(model, fit.pop("train_dataloaders", loader(steps=steps)), **fit)
    return trainer, model


def fabric_setup(precision: str = "32-true") -> tuple[Fabric, torch.nn.Module, torch.optim.Optimizer]:
    fabric = Fabric(accelerator="neuron", precision=precision)
    torch.manual_seed(0)
    model = Regression()
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    return fabric, model, optimizer


def settled_metrics() -> object:
    """The runtime's counters once the device is idle: XLA counts an execution when it finishes, and the last step's
    may still be running (the native backend is eager, its counters are current)."""
    if get_runtime().name == "xla":
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()  # waits without cutting a graph
    return get_runtime().metrics()


def fabric_steps(fabric: Fabric, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: DataLoader) -> dict:
    """The loop a Fabric user writes; the runtime's counters at the start of each step."""
    metrics = {}
    for step, (x, y) in enumerate(fabric.setup_dataloaders(data)):
        metrics[step] = settled_metrics()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    metrics[len(metrics)] = settled_metrics()
    return metrics


def test_fabric_picks_the_neuron_strategy_and_precision():
    fabric = Fabric(accelerator="neuron", precision="bf16-mixed")
    assert isinstance(fabric.strategy, neuron_fabric.SingleDeviceNeuronStrategy)
    assert isinstance(fabric.strategy.precision, neuron_fabric.NeuronPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"
    assert isinstance(fabric.accelerator, lightning_trn.NeuronAccelerator)
    assert fabric.device.type == get_runtime().device_type
    # Lightning's DDP name means the Neuron data-parallel strategy, as for the Trainer; the rest are refused
    assert isinstance(Fabric(accelerator="neuron", strategy="ddp").strategy, neuron_fabric.NeuronDDPStrategy)
    with pytest.raises(ValueError, match=r"Fabric\(accelerator='neuron', strategy='deepspeed'\)` is not supported"):
        Fabric(accelerator="neuron", strategy="deepspeed")
    if get_runtime().shards_models:  # FSDP is served by FSDP2 natively, refused on XLA naming what works there
        assert isinstance(Fabric(accelerator="neuron", strategy="fsdp").strategy, neuron_fabric.NeuronFSDPStrategy)
    else:
        with pytest.raises(ValueError, match=r"not available on lightning_trn's xla backend.*neuron_zero1"):
            Fabric(accelerator="neuron", strategy="fsdp")
    with pytest.raises(ValueError, match="precision='16-mixed'` is not supported"):
        Fabric(accelerator="neuron", precision="16-mixed")


def test_cpu_fabric_keeps_lightnings_own_choices():
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    assert (type(fabric.strategy), type(fabric.strategy.precision)) == (SingleDeviceStrategy, MixedPrecision)
    assert type(Fabric(accelerator="cpu", strategy="ddp", devices=2).strategy) is DDPStrategy


@pytest.mark.xla_only
def test_auto_picks_neuron_on_a_neuron_host(fake_neuron_host):
    fake_neuron_host([2])
    fabric = Fabric(accelerator="auto", devices=1)
    assert isinstance(fabric.strategy, neuron_fabric.SingleDeviceNeuronStrategy)


def test_auto_stays_cpu_on_xla_cpu_and_the_standin():
    assert type(Fabric(accelerator="auto", devices=1).accelerator) is CPUAccelerator


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.numerics
def test_a_fabric_loop_equals_the_trainer_run(precision: str):
    _, trained = trainer_run(precision)
    fabric, model, optimizer = fabric_setup(precision)
    metrics = fabric_steps(fabric, model, optimizer, loader())
    expected, got = weights(trained), weights(model)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=TOLERANCE[precision], rtol=0, msg=name)
    # from the third step on: no graph compiled, nothing read from the device, one graph run per step
    between = metrics[STEPS] - metrics[2]
    assert (between.compiles, between.scalar_reads, between.device_to_host) == (0, 0, 0)
    if get_runtime().name == "xla":
        assert between.executions == STEPS - 2  # steps 2 .. STEPS-1


@pytest.mark.parametrize(
    ("precision", "parameters", "activations"),
    [
        ("32-true", torch.float32, torch.float32),
        ("bf16-mixed", torch.float32, torch.bfloat16),
        ("bf16-true", torch.bfloat16, torch.bfloat16),
    ],
)
def test_precision_dtypes(precision: str, parameters: torch.dtype, activations: torch.dtype):
    fabric, model, _ = fabric_setup(precision)
    assert {p.dtype for p in model.parameters()} == {parameters}
    assert all(p.device.type == get_runtime().device_type for p in model.parameters())
    seen = {}
    model.layer.register_forward_hook(lambda _, args, output: seen.update(input=args[0].dtype, output=output.dtype))
    x, y = torch.randn(4, 8, device=fabric.device), torch.zeros(4, 1, device=fabric.device)  # float32 batch
    loss = torch.nn.functional.mse_loss(model(x), y)  # Fabric's wrapper: the precision's input conversion, autocast
    assert seen == {"input": parameters, "output": activations}
    fabric.backward(loss)
    assert {p.grad.dtype for p in model.parameters()} == {parameters}


def test_an_evaluation_loop_runs_one_graph_per_batch_compiled_once():
    """No optimizer step cuts an evaluation loop: the loader cuts before each batch instead, so each batch's work is
    one graph of the same shape (compiled once) rather than one graph growing over the whole loop."""
    fabric, model, _ = fabric_setup()
    metrics, total = {}, torch.zeros((), device=fabric.device)
    with torch.no_grad():
        for index, (x, y) in enumerate(fabric.setup_dataloaders(loader())):
            metrics[index] = settled_metrics()
            total = total + torch.nn.functional.mse_loss(model(x), y)  # read once, after the loop
    between = metrics[STEPS - 1] - metrics[2]
    assert between.compiles == 0 and between.scalar_reads == 0
    if get_runtime().name == "xla":
        assert between.executions == STEPS - 3  # the batches 2 .. STEPS-2, each run when the next one is taken
    assert total.item() > 0


def test_checkpoints_resume_across_the_trainer_and_fabric(tmp_path: Path):
    """3 steps in one API and 3 in the other end where 6 steps of one Trainer run end (weights and momentum carried
    over; both files hold CPU tensors only)."""
    _, continuous = trainer_run(steps=STEPS)
    half = STEPS // 2

    trainer, model = trainer_run(steps=half, train_dataloaders=loader(steps=half))
    trainer.save_checkpoint(tmp_path / "trainer.ckpt")
    fabric, fabric_model, optimizer = fabric_setup()
    rest = fabric.load(tmp_path / "trainer.ckpt", {"state_dict": fabric_model})
    optimizer.load_state_dict(rest["optimizer_states"][0])
    fabric_steps(fabric, fabric_model, optimizer, loader(first=half, steps=half))
    # the Trainer's and Fabric's steps run the same kernels in the same order on the stand-in (exact there); on XLA the
    # Trainer's graph also logs the loss and may fuse differently: about 2 float32 ulps of these weights (up to ~8)
    for name, value in weights(continuous).items():
        torch.testing.assert_close(weights(fabric_model)[name], value, atol=1e-6, rtol=0, msg=f"Trainer->Fabric {name}")

    fabric, fabric_model, optimizer = fabric_setup()
    fabric_steps(fabric, fabric_model, optimizer, loader(steps=half))
    fabric.save(tmp_path / "fabric.ckpt", neuron_fabric.trainer_checkpoint(fabric_model, [optimizer]))
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=True)
    assert all(t.device.type == "cpu" for t in saved["state_dict"].values())
    resumed = RegressionModel()
    Trainer(accelerator="neuron", max_steps=half, **QUIET).fit(
        resumed, loader(first=half, steps=half), ckpt_path=tmp_path / "fabric.ckpt"
    )
    for name, value in weights(continuous).items():  # as above
        torch.testing.assert_close(weights(resumed)[name], value, atol=1e-6, rtol=0, msg=f"Fabric->Trainer {name}")


def test_clip_gradients_clips_as_on_the_cpu():
    fabric, model, optimizer = fabric_setup()
    x, y = next(iter(loader()))
    fabric.backward(torch.nn.functional.mse_loss(model(x.to(fabric.device)), y.to(fabric.device)))
    cpu = Regression()
    cpu.load_state_dict(weights(model))
    torch.nn.functional.mse_loss(cpu(x), y).backward()
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.5, error_if_nonfinite=False)
    expected_norm = torch.nn.utils.clip_grad_norm_(cpu.parameters(), max_norm=0.5)
    # one backward on two backends: each gradient a 16-row sum in another order, a few float32 ulps (eps 1.2e-7) of
    # its terms apart; so are the norm and the clipped gradients (<= 0.5): under 1e-5 relative, 1e-6 absolute
    torch.testing.assert_close(norm.cpu(), expected_norm, rtol=1e-5, atol=0)
    for (name, clipped), reference in zip(model.named_parameters(), cpu.parameters(), strict=True):
        assert clipped.grad.device.type == get_runtime().device_type
        torch.testing.assert_close(clipped.grad.cpu(), reference.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_one_process_strategies_answer_collectives_as_their_one_rank() -> None:
    """A one-process strategy holds `OneProcess` (the null process group): reductions, gathers and broadcasts give
    the one rank's value, a barrier returns, and there are no device collectives to reach, as Lightning's
    single-device strategies behave (Trainer and Fabric)."""
    from lightning_trn import SingleDeviceNeuronStrategy
    from lightning_trn.fabric import SingleDeviceNeuronStrategy as FabricSingle

    value = torch.tensor([1.0, 2.0])
    for strategy in (SingleDeviceNeuronStrategy(), FabricSingle()):
        assert strategy.all_reduce(value) is value
        assert strategy.all_gather(value) is value
        assert strategy.broadcast({"step": 3}) == {"step": 3}
        assert strategy.reduce_boolean_decision(False) is False
        strategy.barrier()
        assert not strategy.is_distributed and strategy.process_group_backend is None
        assert strategy._gather_objects("only") == ["only"]
        with pytest.raises(RuntimeError, match="one-process strategy has no collectives"):
            _ = strategy.collectives
    assert SingleDeviceNeuronStrategy().reduce(value, reduce_op="sum") is value
