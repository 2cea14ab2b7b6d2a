"""Which stack serves `accelerator="neuron"`: torch_xla or the native `neuron` device, with availability faked at
the selection boundary (what torch registers, whether torch_xla is installed)."""

from __future__ import annotations

import logging

import pytest

from lightning_trn import NeuronAccelerator
from lightning_trn.runtime import BACKEND_ENV, NeuronUnavailableError, get_runtime, select_backend, selection

pytestmark = pytest.mark.xla_only


@pytest.fixture
def stacks(monkeypatch: pytest.MonkeyPatch):
    """Call with (native, xla) to fake which stacks are present."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)

    def fake(native: bool, xla: bool) -> None:
        monkeypatch.setattr(selection, "native_device_available", lambda: native)
        monkeypatch.setattr(selection, "torch_xla_installed", lambda: xla)

    return fake


def test_each_stack_alone_is_chosen(stacks) -> None:
    stacks(native=False, xla=True)
    assert select_backend()[0] == "xla"
    stacks(native=True, xla=False)
    assert select_backend() == ("native", "torch has the native `neuron` device")


def test_both_stacks_need_a_choice(stacks, monkeypatch: pytest.MonkeyPatch) -> None:
    stacks(native=True, xla=True)
    with pytest.raises(NeuronUnavailableError, match=f"Both Neuron stacks.*{BACKEND_ENV}=native"):
        select_backend()
    assert select_backend("xla") == ("xla", "NeuronAccelerator(backend=...)='xla'")
    monkeypatch.setenv(BACKEND_ENV, "native")
    assert select_backend() == ("native", f"{BACKEND_ENV}='native'")


def test_a_missing_stack_names_the_fix(stacks, monkeypatch: pytest.MonkeyPatch) -> None:
    stacks(native=False, xla=True)
    monkeypatch.setenv(BACKEND_ENV, "native")
    with pytest.raises(NeuronUnavailableError, match="torch-neuronx 2.13.*LIGHTNING_TRN_STANDIN=1"):
        select_backend()
    stacks(native=True, xla=False)
    with pytest.raises(NeuronUnavailableError, match="torch-neuronx 2.9.*lightning-trn\\[xla-cpu\\]"):
        select_backend("xla")
    with pytest.raises(ValueError, match="'tpu'.*choose 'xla'"):
        select_backend("tpu")


def test_the_choice_is_logged_once_and_the_accelerator_follows_it(monkeypatch, caplog) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    with caplog.at_level(logging.INFO):
        runtime = get_runtime()
        get_runtime()
    assert runtime.name == "xla" and runtime.device_type == "xla"
    assert [r.getMessage() for r in caplog.records if "backend" in r.getMessage()] == [
        "lightning_trn: xla backend (torch has no native `neuron` device)."
    ]
    with pytest.raises(NeuronUnavailableError, match="native `neuron` device, but torch has none"):
        NeuronAccelerator(backend="native")
    assert NeuronAccelerator(backend="xla").get_parallel_devices(1)[0].type == "xla"
