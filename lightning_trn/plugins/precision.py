"""`NeuronPrecision`: the precision plugin used by the Neuron strategies."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import Precision

SUPPORTED_PRECISION = ("32-true",)


class NeuronPrecision(Precision):
    """Precision for NeuronCores and XLA:CPU."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"`Trainer(accelerator='neuron', precision={precision!r})` is not supported. "
                f"Choose one of: {', '.join(SUPPORTED_PRECISION)}."
            )
        self.precision = precision
