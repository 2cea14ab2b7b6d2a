"""Stop every rank after the same step when any one rank is signalled, without a device sync on every step.

Since Lightning 2.5.2 the training loop broadcasts rank 0's SIGTERM flag as a tensor on `strategy.root_device` before
every batch and reads it back with `.item()`, and the SIGTERM handler broadcasts another one from inside the signal
handler. On XLA the first is a device round trip per step (and an early graph cut on Neuron); the second is an
unmatched collective issued by only the ranks that got the signal (gloo cannot even take XLA tensors). And a signal
that reaches only another rank (a spot interruption or a preemption of one node) is lost to the broadcast, while that
rank stops on its own at the end of its step and meets the others in unmatched collectives.

Here, for this Trainer, while it fits on more than one process: the handlers record the signal (and forward SIGTERM
to launched children, as Lightning's does); before every training batch every rank contributes its flags to one
all-reduce (max) of a CPU tensor over the host (gloo) group, and all ranks act on the result at that same batch:

- SIGTERM: `trainer.received_sigterm` is set and `SIGTERMException` raised on every rank, so Lightning's
  `on_exception` path (`ModelCheckpoint(save_on_exception=True)`, `OnExceptionCheckpoint`) writes one checkpoint of
  that step from all ranks together.
- the SLURM requeue signal (`SLURMEnvironment(auto_requeue=True)`, SIGUSR1 by default): Lightning's requeue handler
  (HPC checkpoint, `scontrol requeue` from rank 0) runs once per run, on every rank at that batch, rather than inside
  the signal handler in the middle of a step on whichever ranks got it.

Outside `fit` (no per-batch agreement there) the handlers act at once, as Lightning's do, minus the device broadcast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch._guards import detect_fake_mode

log = logging.getLogger(__name__)


@dataclass
class _PendingSignals:
    """What this rank received and the ranks have not yet agreed on, and whether the requeue already ran."""

    sigterm: int = 0
    requeue_signum: int = 0
    requeued: bool = False


def install_host_sigterm_sync(trainer: pl.Trainer, host_group: Any | None) -> bool:
    """Replace the per-step SIGTERM broadcast and the SIGTERM and requeue handlers on `trainer`'s instances.

    Must run before `trainer` registers its signal handlers (the strategy's `setup` does). Returns False, changing
    nothing, with one process (Lightning then neither broadcasts nor has ranks to agree with) or if this Lightning
    version lacks the hooks (then Lightning's own behaviour stays in place).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    connector = trainer._signal_connector
    hooks = ("_sigterm_notifier_fn", "_slurm_sigusr_handler_fn", "teardown")
    if (
        trainer.world_size < 2
        or not hasattr(epoch_loop, "_broadcast_sigterm_tensor")
        or not all(hasattr(type(connector), name) for name in hooks)
    ):
        return False
    # the class's methods: a previous run's install left its replacements on this instance
    connector_class = type(connector)
    pending = _PendingSignals()

    def requeue(signum: int) -> None:
        # at a batch boundary there is no signal frame; Lightning's requeue handler does not read it
        connector_class._slurm_sigusr_handler_fn(connector, signum, None)  # type: ignore[arg-type]  # see above

    def fitting() -> bool:
        return trainer.state.fn == TrainerFn.FITTING

    def agree_on_signals() -> None:
        if detect_fake_mode() is not None:  # the estimator's simulated rank: no peers ran, no signal to agree on
            return
        flags = torch.tensor([pending.sigterm, pending.requeue_signum], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=host_group)
        sigterm, requeue_signum = flags.tolist()
        if requeue_signum and not pending.requeued:
            # several ranks may get the signal, some after this agreement: requeue once
            pending.requeued = True
            requeue(requeue_signum)
        if sigterm:
            connector.received_sigterm = True
            raise SIGTERMException()

    def notify_sigterm(signum: int, _: FrameType | None) -> None:
        log.info("lightning_trn: rank %d received SIGTERM (%d)", trainer.global_rank, signum)
        launcher = trainer.strategy.launcher
        if not (connector.received_sigterm or pending.sigterm) and launcher is not None:
            launcher.kill(signum)
        # while fitting, setting the flag now would make this rank stop alone at the end of its step
        if fitting():
            pending.sigterm = 1
        else:
            connector.received_sigterm = True

    def notify_requeue(signum: int, _: FrameType | None) -> None:
        if fitting():
            pending.requeue_signum = int(signum)
        else:
            requeue(signum)

    def teardown() -> None:
        # a SIGTERM after the last training batch's agreement ended no step, but was received
        connector.received_sigterm = connector.received_sigterm or bool(pending.sigterm)
        connector_class.teardown(connector)

    # replaced on this run's loop and connector objects only; their classes keep Lightning's methods
    epoch_loop._broadcast_sigterm_tensor = agree_on_signals  # type: ignore[method-assign]  # see above
    connector._sigterm_notifier_fn = notify_sigterm  # type: ignore[method-assign]  # see above
    connector._slurm_sigusr_handler_fn = notify_requeue  # type: ignore[method-assign]  # see above
    connector.teardown = teardown  # type: ignore[method-assign]  # see above
    return True
