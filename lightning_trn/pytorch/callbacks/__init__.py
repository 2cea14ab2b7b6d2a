"""Callbacks that make compilation observable and reusable: compile cache, compiler flags, compile monitor;
progress bars that do not sync with the device every step; the health check before training."""

from lightning_trn.pytorch.callbacks.compile_cache import NeuronCompileCache
from lightning_trn.pytorch.callbacks.compile_monitor import CompileMonitor
from lightning_trn.pytorch.callbacks.compiler_flags import NeuronCompilerFlags
from lightning_trn.pytorch.callbacks.health_check import NeuronHealthCheck
from lightning_trn.pytorch.callbacks.progress_bar import NeuronRichProgressBar, NeuronTQDMProgressBar

__all__ = [
    "CompileMonitor",
    "NeuronCompileCache",
    "NeuronCompilerFlags",
    "NeuronHealthCheck",
    "NeuronRichProgressBar",
    "NeuronTQDMProgressBar",
]
