"""Platform detection: NeuronCore counting, visible-core syntax, and the 'not available' errors."""

import pytest

from lightning_trn.runtime import discovery
from lightning_trn.runtime.discovery import (
    CPU,
    NEURON,
    NeuronUnavailableError,
    detect_platform,
    parse_core_range,
    physical_core_count,
    visible_core_count,
)

pytestmark = pytest.mark.xla_only


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0,2,5", [0, 2, 5]), ("0-1,4", [0, 1, 4]), (" 2 - 3 ", [2, 3])],
)
def test_parse_core_range(spec, expected):
    assert parse_core_range(spec) == expected


@pytest.mark.parametrize("spec", ["a", "3-1", "0-"])
def test_parse_core_range_rejects_garbage(spec):
    with pytest.raises(ValueError, match="NEURON_RT_VISIBLE_CORES"):
        parse_core_range(spec)


def test_counts_cores_from_sysfs(fake_neuron_host):
    fake_neuron_host([2, 2, 2])
    assert physical_core_count() == 6


def test_falls_back_to_dev_nodes_times_two(fake_neuron_host, tmp_path, monkeypatch):
    fake_neuron_host([])
    (tmp_path / "dev").mkdir()
    for i in range(16):
        (tmp_path / "dev" / f"neuron{i}").touch()
    assert physical_core_count() == 32  # trn1.32xlarge: 16 devices x 2 cores


def test_visible_cores_and_num_cores_limit_the_count(fake_neuron_host, monkeypatch):
    fake_neuron_host([2] * 16)
    assert visible_core_count()[0] == 32
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "8")
    assert visible_core_count()[0] == 8
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-5")
    count, reason = visible_core_count()
    assert count == 2 and "NEURON_RT_VISIBLE_CORES=4-5" in reason


def test_trainium2_counts_logical_cores(fake_neuron_host, monkeypatch):
    fake_neuron_host([8] * 16)  # trn2.48xlarge: 16 Trainium2 devices x 8 physical NeuronCore-v3
    count, reason = visible_core_count()
    assert count == 64 and "128 physical" in reason and "NEURON_LOGICAL_NC_CONFIG=2" in reason  # LNC=2 default
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert visible_core_count()[0] == 128
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "100")
    assert visible_core_count()[0] == 64  # capped at the logical cores
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-3")  # logical core ids: one Trainium2 at LNC=2
    assert detect_platform().device_count == 4


def test_logical_core_config_leaves_trainium1_alone_and_rejects_garbage(fake_neuron_host, monkeypatch):
    fake_neuron_host([2] * 16)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")  # set for a trn2 fleet, harmless on trn1
    assert visible_core_count()[0] == 32
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG='4'"):
        visible_core_count()


def test_detects_neuron_platform(fake_neuron_host):
    fake_neuron_host([2])
    platform = detect_platform()
    assert (platform.kind, platform.device_count) == (NEURON, 2)


def test_xla_cpu_only_when_asked(no_neuron_host, monkeypatch):
    with pytest.raises(NeuronUnavailableError) as err:
        detect_platform()
    message = str(err.value)
    assert "found no NeuronCores" in message and "PJRT_DEVICE=CPU" in message and discovery.NEURON_SYSFS_ROOT in message
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert detect_platform().kind == CPU


def test_other_pjrt_platform_is_refused(no_neuron_host, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(NeuronUnavailableError, match="PJRT_DEVICE='TPU'"):
        detect_platform()


def test_missing_torch_xla_names_the_fix(monkeypatch):
    monkeypatch.setattr(discovery, "torch_xla_installed", lambda: False)
    with pytest.raises(NeuronUnavailableError) as err:
        detect_platform()
    assert "torch-neuronx" in str(err.value) and "lightning-trn[xla-cpu]" in str(err.value)
