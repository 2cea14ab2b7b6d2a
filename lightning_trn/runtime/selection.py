"""Which device stack serves `accelerator="neuron"`: torch_xla (torch-neuronx 2.9, Trn1) or the native `neuron`
device (TorchNeuron, torch-neuronx 2.10+ on Trn2/Trn3, or the CPU stand-in). Decided from what is installed and
registered, or by `LIGHTNING_TRN_BACKEND=xla|native` / `NeuronAccelerator(backend=...)`; nothing here imports
torch_xla or starts a device.
"""

from __future__ import annotations

import os

import torch

from lightning_trn.runtime.discovery import NeuronUnavailableError, torch_xla_installed

BACKEND_ENV = "LIGHTNING_TRN_BACKEND"
BACKENDS = ("xla", "native")


def native_device_available() -> bool:
    """Whether torch has a `neuron` device: TorchNeuron (autoloaded with torch) or the stand-in, once loaded."""
    return torch._C._get_privateuse1_backend_name() == "neuron"


def select_backend(requested: str | None = None) -> tuple[str, str]:
    """The backend to use and why (for the log line): `requested`, else `LIGHTNING_TRN_BACKEND`, else what is there.

    Raises:
        NeuronUnavailableError: the requested stack is missing, or both are there and nothing says which to use.
        ValueError: an unknown backend name.
    """
    source = "NeuronAccelerator(backend=...)"
    if requested is None and os.environ.get(BACKEND_ENV, "").strip():
        requested, source = os.environ[BACKEND_ENV].strip().lower(), BACKEND_ENV
    native, xla = native_device_available(), torch_xla_installed()
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(
                f"{source}={requested!r}: choose 'xla' (torch-neuronx 2.9, Trn1) or 'native' (TorchNeuron)."
            )
        if requested == "native" and not native:
            raise NeuronUnavailableError(
                f"{source}={requested!r} asks for TorchNeuron's native `neuron` device, but torch has none. On a "
                "trn2/trn3 install torch-neuronx 2.13 or newer from the Neuron SDK's repository (it registers the "
                "device when torch is imported); on a machine without Trainium set LIGHTNING_TRN_STANDIN=1 before "
                "`import lightning_trn` to use the CPU stand-in."
            )
        if requested == "xla" and not xla:
            raise NeuronUnavailableError(
                f"{source}={requested!r} asks for the torch_xla stack, which is not installed here. On a trn1 install "
                "torch-neuronx 2.9 (it brings torch-xla); on a CPU machine install `lightning-trn[xla-cpu]` and run "
                "with PJRT_DEVICE=CPU."
            )
        return requested, f"{source}={requested!r}"
    if native and xla:
        raise NeuronUnavailableError(
            "Both Neuron stacks are present: torch has the native `neuron` device (TorchNeuron or the stand-in) and "
            f"torch_xla is installed. Say which one to use: set {BACKEND_ENV}=native or {BACKEND_ENV}=xla, or pass "
            "`NeuronAccelerator(backend='native' | 'xla')`."
        )
    if native:
        return "native", "torch has the native `neuron` device"
    return "xla", "torch has no native `neuron` device"
