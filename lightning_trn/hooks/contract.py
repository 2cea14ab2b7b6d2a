"""`HookContract`: what a strategy tells the hooks into Lightning's internals (`lightning_trn.hooks`), in one typed
object instead of attributes the hooks would probe for.

The strategy owns it (`hook_contract`); the hooks read it through `contract_of(strategy)`, which gives every
strategy that is not a Neuron one `LIGHTNING`: all shortcuts off, Lightning's own behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the attribute a strategy holds its contract under
CONTRACT_ATTRIBUTE = "hook_contract"


@dataclass(frozen=True)
class HookContract:
    """The switches the hooks read from the running strategy (docs/architecture.md lists them).

    Attributes:
        defer_progress_bar_metrics: `prog_bar=True` values stay tensors instead of being read on the host after every
            batch (`hooks/logging.py`, hook 1); the strategy sets it at setup when no progress bar needs them each
            step, and converts them once at teardown.
        fast_log: a repeated `self.log` call that Lightning validated before updates Lightning's stored result
            directly (`hooks/logging.py`, hook 3).
        reduces_host_tensors: the strategy's `reduce` takes host tensors (data-parallel: over the host group), so the
            loops' loader-length check sums on the host (`hooks/loop_shortcuts.py`, shortcut 5).
        epoch_values_on_host: in one-process runs, epoch-level logged values are computed from host copies of their
            states, fetched in one transfer, not as small device graphs (`hooks/logging.py`, hook 4).
    """

    defer_progress_bar_metrics: bool = False
    fast_log: bool = True
    reduces_host_tensors: bool = True
    epoch_values_on_host: bool = True


#: the contract of a strategy that is not a Neuron one: every shortcut off, Lightning's own code runs
LIGHTNING = HookContract(
    defer_progress_bar_metrics=False, fast_log=False, reduces_host_tensors=False, epoch_values_on_host=False
)


def contract_of(strategy: Any) -> HookContract:
    """The contract `strategy` holds, or `LIGHTNING` for a strategy that holds none (Lightning's own, a GPU run)."""
    contract = getattr(strategy, CONTRACT_ATTRIBUTE, None)
    return contract if isinstance(contract, HookContract) else LIGHTNING
