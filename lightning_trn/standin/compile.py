"""The stand-in's `torch.compile` backend, registered as "neuron" like TorchNeuron's, with its documented limit:
dynamic shapes are refused (`dynamic=True`; every new shape recompiles instead). The captured graph runs eagerly on
the stand-in device, so what it proves is the capture (graph breaks, recompiles, counted by Dynamo), not speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from lightning_trn.standin._build import StandinError

BACKEND_NAME = "neuron"


def neuron_backend(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
    """Refuse symbolic shapes as TorchNeuron does, then run the graph op by op."""
    sizes = [size for x in example_inputs if isinstance(x, torch.Tensor) for size in x.shape]
    if any(isinstance(value, torch.SymInt) for value in [*example_inputs, *sizes]):
        raise StandinError(
            "torch.compile(backend='neuron') does not support dynamic shapes (TorchNeuron rejects `dynamic=True`): "
            "compile with `dynamic=False`, so that each new input shape compiles its own graph, or pad inputs to "
            "fixed shapes."
        )
    return gm.forward


def register() -> None:
    """Make `torch.compile(backend="neuron")` find the stand-in's backend (once per process)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if BACKEND_NAME not in _COMPILER_FNS:
        register_backend(neuron_backend, name=BACKEND_NAME)
