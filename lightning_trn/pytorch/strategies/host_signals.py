"""Keep Lightning's "stop all ranks together on SIGTERM" behaviour without a device sync on every step.

Since Lightning 2.5.2 the training loop broadcasts a SIGTERM flag as a tensor on `strategy.root_device` before every
batch and reads it back with `.item()`, and the SIGTERM handler broadcasts another one from inside the signal handler.
On XLA the first is a device round trip per step (and an early graph cut on Neuron); the second is an unmatched
collective issued by only the ranks that got the signal (gloo cannot even take XLA tensors). Here both are replaced
for this Trainer: the flag is broadcast from rank 0 as a CPU tensor over the host (gloo) group each step, so every
rank still stops at the same step, and the handler only records the signal and forwards it to launched children.
"""

from __future__ import annotations

import contextlib
import logging
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


def install_host_sigterm_sync(trainer: pl.Trainer, host_group: Any | None) -> bool:
    """Replace the per-step SIGTERM broadcast and the SIGTERM handler's broadcast on `trainer`'s instances.

    Must run before `trainer` registers its signal handlers (the strategy's `setup` does). Returns False, changing
    nothing, if this Lightning version lacks the hooks (then Lightning's own behaviour stays in place).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    connector = trainer._signal_connector
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor") or not hasattr(connector, "_sigterm_notifier_fn"):
        return False

    def broadcast_sigterm_flag() -> None:
        flag = torch.tensor([int(connector.received_sigterm)], dtype=torch.int32)
        dist.broadcast(flag, src=0, group=host_group)
        if int(flag.item()):
            with contextlib.suppress(Exception):
                dist.barrier(group=host_group)
            raise SIGTERMException()

    def notify_sigterm(signum: int, _: FrameType | None) -> None:
        log.info("lightning_trn: rank %d received SIGTERM (%d)", trainer.global_rank, signum)
        launcher = trainer.strategy.launcher
        if not connector.received_sigterm and launcher is not None:
            launcher.kill(signum)
        connector.received_sigterm = True

    # replaced on this run's loop and connector objects only; their classes keep Lightning's methods
    epoch_loop._broadcast_sigterm_tensor = broadcast_sigterm_flag  # type: ignore[method-assign]  # see above
    connector._sigterm_notifier_fn = notify_sigterm  # type: ignore[method-assign]  # see above
    return True
