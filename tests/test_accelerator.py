"""`accelerator="neuron"` registration, strategy/precision resolution and the 'not available' errors."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from xla_free_python import run_without_torch_xla

import lightning_trn
from lightning_trn import NeuronAccelerator, NeuronPrecision, NeuronUnavailableError, SingleDeviceNeuronStrategy

pytestmark = pytest.mark.xla_only


def test_import_registers_accelerator_and_strategy():
    assert "neuron" in AcceleratorRegistry
    assert SingleDeviceNeuronStrategy.strategy_name in StrategyRegistry
    lightning_trn.register()  # idempotent


def test_auto_strategy_is_the_neuron_single_device_strategy():
    trainer = Trainer(accelerator="neuron", logger=False, enable_progress_bar=False)
    assert isinstance(trainer.accelerator, NeuronAccelerator)
    assert isinstance(trainer.strategy, SingleDeviceNeuronStrategy)
    assert isinstance(trainer.precision_plugin, NeuronPrecision)
    assert trainer.strategy.root_device.type == "xla"


def test_other_accelerators_are_untouched():
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    assert type(trainer.strategy) is SingleDeviceStrategy
    assert trainer.strategy.root_device.type == "cpu"


def test_neuron_strategy_refuses_other_accelerators():
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = Trainer(accelerator="cpu", strategy="neuron_single", max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="accelerator='neuron'"):
        trainer.fit(BoringModel())


@pytest.mark.parametrize("devices", [1, "1", [0], "auto", -1])
def test_device_inputs_on_xla_cpu(devices):
    assert NeuronAccelerator.parse_devices(devices) == 1


def test_any_count_up_to_visible_cores(fake_neuron_host):
    fake_neuron_host([2, 2, 2, 2])
    assert NeuronAccelerator.auto_device_count() == 8
    assert NeuronAccelerator.parse_devices(3) == 3  # not only 1 or all
    assert NeuronAccelerator.parse_devices("auto") == 8
    assert NeuronAccelerator.get_parallel_devices(2)[1].type == "xla"


def test_more_devices_than_visible_cores_is_an_error(fake_neuron_host, monkeypatch):
    fake_neuron_host([2, 2])
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    with pytest.raises(NeuronUnavailableError) as err:
        Trainer(accelerator="neuron", devices=4, logger=False)
    message = str(err.value)
    assert "asks for 4 devices but only 2 are visible" in message and "NEURON_RT_VISIBLE_CORES=0-1" in message


def test_no_neuroncores_and_no_pjrt_device_is_an_error(no_neuron_host):
    assert not NeuronAccelerator.is_available()
    with pytest.raises(NeuronUnavailableError, match="PJRT_DEVICE=CPU"):
        Trainer(accelerator="neuron", logger=False)


def test_without_torch_xla_import_works_and_neuron_fails_clearly(tmp_path: Path):
    result = run_without_torch_xla(
        """
        import lightning_trn
        from lightning.pytorch import Trainer
        from lightning.pytorch.accelerators import AcceleratorRegistry
        assert "neuron" in AcceleratorRegistry
        try:
            Trainer(accelerator="neuron")
        except lightning_trn.NeuronUnavailableError as err:
            print("ERROR:", err)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "needs torch_xla, which is not installed" in result.stdout
    assert "torch-neuronx" in result.stdout


def test_xla_cpu_is_announced_once(caplog):
    with caplog.at_level("WARNING", logger="lightning_trn"):
        Trainer(accelerator="neuron", logger=False)
        Trainer(accelerator="neuron", logger=False)
    announcements = [r for r in caplog.records if "no NeuronCores found; running on XLA:CPU" in r.getMessage()]
    assert len(announcements) == 1


def test_device_stats_come_from_the_runtime(monkeypatch):
    import torch_xla.core.xla_model as xm

    device = torch.device("xla", 0)
    assert NeuronAccelerator().get_device_stats(device) == {}  # XLA:CPU offers no allocator stats
    monkeypatch.setattr(xm, "get_memory_info", lambda d: {"bytes_used": 1024, "bytes_limit": 4096})
    assert NeuronAccelerator().get_device_stats(device) == {"bytes_used": 1024, "bytes_limit": 4096}
