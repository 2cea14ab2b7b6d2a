"""lightning_trn: PyTorch Lightning on AWS Trainium (Neuron).

`import lightning_trn` registers `accelerator="neuron"` and the Neuron strategies with Lightning.
torch_xla is only imported when a Neuron/XLA feature is used, so checkpoints load on machines without it.
With `LIGHTNING_TRN_STANDIN=1` it first loads the CPU stand-in for the native `neuron` device (development only).
"""

import os as _os

if _os.environ.get("LIGHTNING_TRN_STANDIN", "").strip().lower() in ("1", "true", "yes"):
    import lightning_trn.standin  # noqa: F401

from lightning_trn.accelerator import NeuronAccelerator
from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO
from lightning_trn.core.checkpoint.pretrained import load_pretrained, meta_model_from_pretrained
from lightning_trn.core.parallel.context_parallel import sequence_sums, token_mean
from lightning_trn.core.parallel.parallel_dims import ParallelDims
from lightning_trn.core.parallel.pipeline import Pipeline, pipeline_split
from lightning_trn.pytorch.callbacks import CompileMonitor, NeuronCompileCache, NeuronCompilerFlags, NeuronHealthCheck
from lightning_trn.pytorch.precision import NeuronPrecision
from lightning_trn.pytorch.strategies import NeuronDDPStrategy, NeuronModelParallelStrategy, SingleDeviceNeuronStrategy
from lightning_trn.registration import register
from lightning_trn.runtime import NeuronUnavailableError
from lightning_trn.torch_compile import compile, compile_blocks

__version__ = "0.1.0.dev0"

register()

__all__ = [
    "CompileMonitor",
    "NeuronAccelerator",
    "NeuronCheckpointIO",
    "NeuronCompileCache",
    "NeuronCompilerFlags",
    "NeuronDDPStrategy",
    "NeuronHealthCheck",
    "NeuronModelParallelStrategy",
    "NeuronPrecision",
    "NeuronUnavailableError",
    "ParallelDims",
    "Pipeline",
    "SingleDeviceNeuronStrategy",
    "__version__",
    "compile",
    "compile_blocks",
    "load_pretrained",
    "meta_model_from_pretrained",
    "pipeline_split",
    "sequence_sums",
    "token_mean",
]
