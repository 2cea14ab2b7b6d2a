"""What `Trainer(accelerator=..., strategy=...)` resolves to with lightning_trn imported: Lightning's strategy names
on a Neuron run, another package registering "neuron" and `accelerator="auto"` on a Neuron host. Run by both
suites."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry, CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lightning_trn import (
    NeuronAccelerator,
    NeuronDDPStrategy,
    NeuronPrecision,
    SingleDeviceNeuronStrategy,
    registration,
)
from lightning_trn.runtime import native

pytestmark = pytest.mark.both

QUIET = {"logger": False, "enable_progress_bar": False, "enable_checkpointing": False, "enable_model_summary": False}


@pytest.mark.parametrize("strategy", ["ddp", "ddp_find_unused_parameters_false"])
def test_lightning_ddp_names_mean_the_neuron_ddp_strategy(strategy):
    trainer = Trainer(accelerator="neuron", strategy=strategy, devices=2, **QUIET)
    assert type(trainer.strategy) is NeuronDDPStrategy
    assert isinstance(trainer.precision_plugin, NeuronPrecision)


@pytest.mark.parametrize(
    "strategy",
    ["ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true", "deepspeed", "single_device"],
)
def test_strategies_that_cannot_run_on_neuron_are_refused_at_construction(strategy):
    with pytest.raises(ValueError, match=rf"strategy='{strategy}'\)` is not supported.*strategy='ddp'"):
        Trainer(accelerator="neuron", strategy=strategy, devices=2, **QUIET)


def test_a_strategy_object_that_cannot_run_on_neuron_is_refused():
    with pytest.raises(ValueError, match=r"strategy=DDPStrategy\)` is not supported"):
        Trainer(accelerator="neuron", strategy=DDPStrategy(), devices=2, **QUIET)


@pytest.mark.xla_only
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_cpu_offload", FSDPStrategy, ModelParallelStrategy])
def test_sharded_strategies_are_refused_on_xla_at_construction_naming_what_works(strategy):
    """FSDP2 and tensor parallelism need the native backend: one paragraph naming ZeRO-1, not a failure in `fit`."""
    flag = strategy() if isinstance(strategy, type) else strategy
    with pytest.raises(ValueError, match=r"not available on lightning_trn's xla backend.*strategy='neuron_zero1'"):
        Trainer(accelerator="neuron", strategy=flag, devices=2, **QUIET)


@pytest.mark.xla_only
@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_pipeline_parallelism_is_refused_on_xla_naming_the_native_backend(api):
    """Pipeline stages need eager stages on the native backend: the refusal says so, not the general FSDP one."""
    from lightning_trn.fabric import NeuronModelParallelStrategy as FabricStrategy
    from lightning_trn.pytorch.strategies import NeuronModelParallelStrategy

    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2\) is not available on .*xla.*native backend"):
        if api == "trainer":
            NeuronModelParallelStrategy(pipeline_parallel_size=2)
        else:
            FabricStrategy(lambda module, mesh: module, pipeline_parallel_size=2)


def test_cpu_runs_keep_lightnings_strategies():
    trainer = Trainer(accelerator="cpu", strategy="ddp_spawn", devices=2, **QUIET)
    assert type(trainer.strategy) is DDPStrategy


class NxDStyleAccelerator(CPUAccelerator):
    """Registers itself under "neuron" the way `neuronx_distributed.lightning.NeuronXLAAccelerator` does."""

    @classmethod
    def register_accelerators(cls, accelerator_registry) -> None:  # type: ignore[no-untyped-def]
        accelerator_registry.register("neuron", cls, description=cls.__name__)


@pytest.fixture
def registry():
    """The accelerator registry, its "neuron" entry restored after the test (`monkeypatch.setitem` would save the
    registry's `get()`, which constructs an accelerator instead of returning the entry)."""
    entry = dict.get(AcceleratorRegistry, "neuron")
    yield AcceleratorRegistry
    AcceleratorRegistry["neuron"] = entry


def test_registered_first_by_another_package_the_name_is_taken_back_with_a_warning(registry):
    del registry["neuron"]
    NxDStyleAccelerator.register_accelerators(registry)
    with pytest.warns(UserWarning, match="NxDStyleAccelerator.*lightning_trn registers its own"):
        registration.register()
    trainer = Trainer(accelerator="neuron", **QUIET)
    assert type(trainer.accelerator) is NeuronAccelerator
    assert type(trainer.strategy) is SingleDeviceNeuronStrategy


def test_registered_after_lightning_trn_by_another_package_is_an_error_naming_both(registry):
    registry.register("neuron", NxDStyleAccelerator, override=True)
    with pytest.raises(RuntimeError, match="NxDStyleAccelerator, not lightning_trn's NeuronAccelerator.*neuronx"):
        Trainer(accelerator="neuron", **QUIET)
    # the accelerator object itself still works
    assert type(Trainer(accelerator=NeuronAccelerator(), **QUIET).strategy) is SingleDeviceNeuronStrategy


@pytest.mark.xla_only
def test_auto_picks_neuron_on_a_neuron_host(fake_neuron_host):
    fake_neuron_host([2])
    trainer = Trainer(accelerator="auto", devices=1, **QUIET)
    assert type(trainer.accelerator) is NeuronAccelerator
    assert type(trainer.strategy) is SingleDeviceNeuronStrategy


@pytest.mark.native_only
def test_auto_picks_neuron_where_torch_has_real_neuron_devices(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(native, "_standin", lambda: None)  # the stand-in's devices, reported as NeuronCores
    trainer = Trainer(accelerator="auto", devices=1, **QUIET)
    assert type(trainer.accelerator) is NeuronAccelerator


def test_auto_stays_cpu_on_xla_cpu_and_the_standin():
    trainer = Trainer(accelerator="auto", devices=1, **QUIET)
    assert type(trainer.accelerator) is CPUAccelerator
    assert type(trainer.strategy) is SingleDeviceStrategy


@pytest.mark.xla_only
def test_auto_stays_cpu_without_neuron_devices(no_neuron_host):
    assert type(Trainer(accelerator="auto", devices=1, **QUIET).accelerator) is CPUAccelerator
