"""The recipes' config schema: every key outside `trainer.` has the type of its YAML default, and some keys a range.
Checked on the merged config before anything runs, so a wrong override names the key, the value and what is
expected instead of failing deep in data loading (`trainer.*` keys are left to Lightning, which checks them).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

#: value checks beyond the type: (test, what it says)
_POSITIVE: tuple[Callable[[float], bool], str] = (lambda v: v > 0, "greater than 0")
_FRACTION: tuple[Callable[[float], bool], str] = (lambda v: 0 <= v < 1, "in [0, 1)")
_NON_NEGATIVE: tuple[Callable[[float], bool], str] = (lambda v: v >= 0, "0 or more")
RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "data.batch_size": _POSITIVE,
    "data.max_length": _POSITIVE,
    "data.val_fraction": _FRACTION,
    "data.test_fraction": _FRACTION,
    "model.lr": _POSITIVE,
    "model.weight_decay": _NON_NEGATIVE,
    "model.momentum": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    # the LLM recipe
    "data.seq_len": _POSITIVE,
    "data.vocab_size": (lambda v: v >= 259, "of at least 259 (256 bytes + 3 special tokens)"),
    "model.hidden_size": _POSITIVE,
    "model.intermediate_size": _POSITIVE,
    "model.num_layers": _POSITIVE,
    "model.num_heads": _POSITIVE,
    "model.num_kv_heads": _POSITIVE,
    "model.tensor_parallel_size": _POSITIVE,
    "model.warmup_steps": _NON_NEGATIVE,
    "model.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}
#: sections whose keys go to Lightning as they are: any key allowed, values left for Lightning to check
OPEN_SECTIONS = ("trainer.",)


def _type_name(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, list):
        return "a list like [1, 2]"
    return "a string"


def _matches(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if isinstance(default, list):
        return isinstance(value, list) and (not default or all(_matches(v, default[0]) for v in value))
    return isinstance(value, str)


def check(values: dict[str, Any], defaults: dict[str, Any]) -> Optional[str]:
    """The first problem in the flat `values` (dotted keys) against the flat YAML `defaults`, or None."""
    for key, value in values.items():
        default = defaults.get(key)
        if key.startswith(OPEN_SECTIONS) or default is None:  # Lightning's, or free-form (null default)
            continue
        if not _matches(value, default):
            return f"Config key {key}={value!r}: expected {_type_name(default)} (default {default!r})."
        rule = RANGES.get(key)
        if rule is not None and not rule[0](value):
            return f"Config key {key}={value!r}: expected a value {rule[1]} (default {default!r})."
    return None
