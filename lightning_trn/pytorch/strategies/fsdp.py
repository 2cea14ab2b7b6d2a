"""`NeuronFSDPStrategy`: Lightning's `FSDPStrategy` arguments on NeuronCores (native backend), served by FSDP2.

`Trainer(accelerator="neuron", strategy="fsdp")` or `strategy=FSDPStrategy(auto_wrap_policy={Block}, ...)` builds it
with the same arguments, so a Lightning FSDP script runs with only the accelerator changed. It is
`NeuronModelParallelStrategy` with the sharding written for you: the submodules `auto_wrap_policy` selects, then the
LightningModule, are `fully_shard`-ed when the model is configured (`lightning_trn.core.fsdp`).
"""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from lightning_trn.core.fsdp import FSDPCore
from lightning_trn.pytorch.strategies.model_parallel import NeuronModelParallelStrategy


class NeuronFSDPStrategy(FSDPCore, NeuronModelParallelStrategy):
    """FSDP over NeuronCores with FSDP2, one process per NeuronCore; the arguments are those of Lightning's
    `FSDPStrategy` (`FSDPCore`)."""

    @override
    def connect(self, model: pl.LightningModule) -> None:
        """The LightningModule's `configure_model` (its own, if any, then the sharding) runs where Lightning runs
        it, once the mesh exists: it is set on this model object until teardown."""
        super().connect(model)
        user = model.configure_model

        def configure_model() -> None:
            user()
            self._shard(model)

        model.configure_model = configure_model  # type: ignore[method-assign]

    @override
    def teardown(self) -> None:
        module = self._lightning_module
        if module is not None:
            module.__dict__.pop("configure_model", None)
        super().teardown()
