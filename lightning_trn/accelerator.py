"""`NeuronAccelerator`: Lightning's accelerator for AWS Trainium/Inferentia NeuronCores (XLA:CPU for development)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator
from typing_extensions import override

from lightning_trn.runtime import NeuronUnavailableError, get_runtime, use_backend
from lightning_trn.runtime.discovery import CPU

_DEVICES_INPUT = int | str | list[int]


class NeuronAccelerator(Accelerator):
    """One process per NeuronCore: the XLA device `xla:0` (torch-neuronx 2.9, XLA:CPU) or the native `neuron` device
    (TorchNeuron on Trn2/Trn3, or the CPU stand-in).

    Args:
        backend: "xla" or "native"; by default `LIGHTNING_TRN_BACKEND`, else the stack that is installed.

    Constructing it checks that a platform exists (NeuronCores, XLA:CPU via `PJRT_DEVICE=CPU`, or a `neuron` device)
    and raises `NeuronUnavailableError` saying what was looked for and how to fix it.
    """

    def __init__(self, backend: str | None = None) -> None:
        super().__init__()
        use_backend(backend).detect_platform()

    @override
    def setup_device(self, device: torch.device) -> None:
        """Check the device is this backend's and that backward passes can run on it."""
        runtime = get_runtime()
        if device.type != runtime.device_type:
            raise ValueError(
                f"NeuronAccelerator on the {runtime.name} backend needs a {runtime.device_type!r} device, got {device}."
            )
        runtime.check_autograd(device)

    @override
    def teardown(self) -> None:
        pass

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        """Device memory and, on Neuron hosts, NeuronCore utilization (`DeviceRuntime.device_stats`)."""
        return get_runtime().device_stats(torch.device(device) if not isinstance(device, torch.device) else device)

    @staticmethod
    @override
    def parse_devices(devices: _DEVICES_INPUT) -> int:
        """Number of NeuronCores (processes) to use; any count up to the visible cores is allowed."""
        available = NeuronAccelerator.auto_device_count()
        platform = get_runtime().detect_platform()
        if isinstance(devices, list):
            count = len(devices)
        elif isinstance(devices, str):
            stripped = devices.strip()
            if stripped in ("-1", "auto"):
                return available
            if not stripped.isdigit():
                raise ValueError(f"`devices={devices!r}` is not a number of NeuronCores.")
            count = int(stripped)
        elif devices == -1:
            return available
        else:
            count = int(devices)
        if count < 1:
            raise ValueError(f"`devices={devices!r}`: use a positive number of NeuronCores, or -1 / 'auto' for all.")
        if count > platform.device_count:
            raise NeuronUnavailableError(
                f"`Trainer(accelerator='neuron', devices={devices!r})` asks for {count} devices but only "
                f"{platform.device_count} are visible ({platform.reason}). Lower `devices`, use `devices='auto'` "
                f"for all visible devices, or {platform.widen}; for more devices than one machine has, use "
                "`num_nodes`."
            )
        return count

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        device_type = get_runtime().device_type
        return [torch.device(device_type, i) for i in range(NeuronAccelerator.parse_devices(devices))]

    @staticmethod
    @override
    def auto_device_count() -> int:
        """All visible NeuronCores on Neuron; 1 on XLA:CPU (ask for more with an explicit `devices=N`)."""
        platform = get_runtime().detect_platform()
        return 1 if platform.kind == CPU else platform.device_count

    @staticmethod
    @override
    def is_available() -> bool:
        try:
            get_runtime().detect_platform()
        except NeuronUnavailableError:
            return False
        return True

    @staticmethod
    @override
    def name() -> str:
        return "neuron"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register(
            cls.name(), cls, description="AWS Trainium/Inferentia NeuronCores: torch_xla or native (lightning_trn)"
        )
