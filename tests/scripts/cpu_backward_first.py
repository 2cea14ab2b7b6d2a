"""Worker for tests/hooks/test_cpu_backward_first.py: a CPU backward pass (a notebook's sanity check), then a Neuron
fit.

With `--start-device-first` the device is started right after `import lightning_trn`, before that backward.
"""

from __future__ import annotations

import sys

import torch

if "--start-device-first" in sys.argv:
    from lightning_trn.runtime import get_runtime  # importing the package registers accelerator="neuron"

    get_runtime().device()

weight = torch.ones(2, requires_grad=True)
weight.sum().backward()

from lightning.pytorch import Trainer  # noqa: E402
from models import RegressionModel  # noqa: E402

import lightning_trn  # noqa: E402, F401  registers accelerator="neuron": imported after the CPU backward

trainer = Trainer(
    accelerator="neuron",
    max_steps=2,
    logger=False,
    enable_progress_bar=False,
    enable_checkpointing=False,
    enable_model_summary=False,
)
trainer.fit(RegressionModel())
print(f"trained {trainer.global_step} steps")
