"""`NeuronHealthCheck`: the checks of `python -m lightning_trn.healthcheck`, run by the Trainer before training."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_trn.healthcheck import (
    DEFAULT_SIZE_MB,
    DEFAULT_TIMEOUT_S,
    HealthReport,
    check_arguments,
    run_health_check,
)
from lightning_trn.precompile import GRAPHS_ONLY_ENV, graphs_only


class NeuronHealthCheck(Callback):
    """Before the first step of `fit` (and of the sanity check), check every rank's NeuronCore and the collectives
    between all ranks; on a failure the ranks raise `HealthCheckError` naming the rank, host and core (a rank stuck in
    a device call ends its process instead), and the job stops before training. The report is logged on rank 0 and
    kept in `report`. Skipped while precompiling (`NEURON_EXTRACT_GRAPHS_ONLY=1`: device results are fake).

    Args:
        timeout: seconds a rank waits for the others at each phase before naming the ones that did not answer.
        size_mb: MiB moved by the host<->device copy and each timed all-reduce.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S, size_mb: int = DEFAULT_SIZE_MB) -> None:
        check_arguments(timeout, size_mb)
        self.timeout = timeout
        self.size_mb = size_mb
        self.report: HealthReport | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not hasattr(trainer.strategy, "runtime"):
            raise ValueError("NeuronHealthCheck checks NeuronCores: use it with `Trainer(accelerator='neuron')`.")
        if graphs_only():
            rank_zero_info(
                f"lightning_trn: {GRAPHS_ONLY_ENV}=1 (precompiling): device results are fake, no health check."
            )
            return
        self.report = run_health_check(trainer.strategy, timeout=self.timeout, size_mb=self.size_mb)
        rank_zero_info(self.report.summary())
