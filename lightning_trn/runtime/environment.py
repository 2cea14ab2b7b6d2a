"""Runtime environment variables: set defaults without overriding the user, restore them on teardown,
and read/merge the Neuron compiler's `NEURON_CC_FLAGS`.

The Neuron runtime and compiler read their configuration from the environment when they start, so plugins
and callbacks configure them here, before the first graph is compiled.
"""

from __future__ import annotations

import logging
import os
import shlex

log = logging.getLogger(__name__)

NEURON_CC_FLAGS = "NEURON_CC_FLAGS"
#: the Neuron compiler cache location: a local path or `s3://bucket/prefix` (default /var/tmp/neuron-compile-cache)
NEURON_COMPILE_CACHE_URL = "NEURON_COMPILE_CACHE_URL"

#: short compiler spellings and the long option they stand for
_CC_ALIASES = {"-O1": ("--optlevel", "1"), "-O2": ("--optlevel", "2"), "-O3": ("--optlevel", "3")}
_CC_NAME_ALIASES = {
    "-O": "--optlevel",
    "--auto_cast": "--auto-cast",
    "--auto_cast_type": "--auto-cast-type",
    "--model_type": "--model-type",
    "--cache-dir": "--cache_dir",
}


class EnvironmentPatch:
    """Sets environment variables for the runtime, never overriding a value the user set, and restores them."""

    def __init__(self) -> None:
        self._saved: dict[str, str | None] = {}

    def set_default(self, name: str, value: str) -> bool:
        """Set `name` unless the user already set it; returns whether our value is now in force."""
        current = os.environ.get(name)
        if current is not None and name not in self._saved:
            if current != value:
                log.info("lightning_trn: keeping %s=%r set by the user (would have set %r).", name, current, value)
            return current == value
        self.set(name, value)
        return True

    def set(self, name: str, value: str) -> None:
        """Set `name`, remembering the first value seen so `restore` can put it back."""
        self._saved.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    def restore(self) -> None:
        """Undo every change made through this patch."""
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved.clear()


def parse_cc_flags(flags: str) -> list[tuple[str, str | None]]:
    """Split a `NEURON_CC_FLAGS` string into `(option, value)` pairs with canonical option names.

    `--optlevel=1`, `--optlevel 1`, `-O1` and `-O 1` all become `("--optlevel", "1")`; a bare switch such as
    `--retry_failed_compilation` has value None.
    """
    tokens = shlex.split(flags)
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in _CC_ALIASES:
            pairs.append(_CC_ALIASES[token])
            i += 1
            continue
        name, sep, value = token.partition("=")
        name = _CC_NAME_ALIASES.get(name, name)
        if sep:
            pairs.append((name, value))
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            pairs.append((name, tokens[i + 1]))
            i += 1
        else:
            pairs.append((name, None))
        i += 1
    return pairs


def format_cc_flags(pairs: list[tuple[str, str | None]]) -> str:
    """Inverse of `parse_cc_flags`: `--name=value` for options with a value, bare switches as they are."""
    return " ".join(shlex.quote(name if value is None else f"{name}={value}") for name, value in pairs)


def cc_flag_value(flags: str, name: str) -> str | None:
    """The value given for option `name` in a flags string (`""` for a bare switch), or None if absent."""
    for option, value in parse_cc_flags(flags):
        if option == name:
            return "" if value is None else value
    return None
