"""`NeuronCompilerFlags`: set the Neuron compiler's options (`NEURON_CC_FLAGS`) for a run, checked and merged."""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
from collections.abc import Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_trn.runtime import get_runtime
from lightning_trn.runtime.discovery import CPU
from lightning_trn.runtime.environment import NEURON_CC_FLAGS, EnvironmentPatch, format_cc_flags, parse_cc_flags

log = logging.getLogger(__name__)

#: allowed values, from the neuronx-cc reference (`--optlevel`, `--model-type`, `--auto-cast`, `--auto-cast-type`)
OPTLEVELS = ("1", "2", "3")
MODEL_TYPES = ("generic", "transformer", "unet-inference")
AUTO_CAST = ("none", "matmult", "all")
AUTO_CAST_TYPES = ("bf16", "fp16", "tf32", "fp8_e4m3")

_Flag = tuple[str, str | None]


def cc_flags_digest(flags: str) -> str:
    """A short hash of a `NEURON_CC_FLAGS` string that ignores spelling and order (`-O1` == `--optlevel=1`)."""
    canonical = format_cc_flags(sorted(parse_cc_flags(flags), key=lambda pair: (pair[0], pair[1] or "")))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def merge_cc_flags(
    existing: str,
    added: Sequence[_Flag],
    existing_source: str = "NEURON_CC_FLAGS",
    added_source: str = "NeuronCompilerFlags",
) -> str:
    """`existing` plus the `added` options it lacks; an option already there with another value is an error.

    Raises:
        ValueError: naming the option and both values, e.g. `--optlevel`: '2' in NEURON_CC_FLAGS vs '1'.
    """
    present = dict(parse_cc_flags(existing))
    new: list[_Flag] = []
    for name, value in added:
        if name not in present:
            new.append((name, value))
            present[name] = value
        elif present[name] != value:
            raise ValueError(
                f"Compiler option `{name}` is set twice with different values: {present[name]!r} in "
                f"{existing_source} ({existing!r}) and {value!r} from {added_source}. Remove one of them."
            )
    return " ".join(part for part in (existing.strip(), format_cc_flags(new)) if part)


def _choice(option: str, value: object, allowed: Sequence[str]) -> str:
    text = str(value).strip().lower()
    if text not in allowed:
        raise ValueError(f"`{option}={value!r}` is not a Neuron compiler value; use one of {', '.join(allowed)}.")
    return text


def _optlevel(value: int | str) -> str:
    text = str(value).strip().upper().lstrip("-").removeprefix("O")
    if text not in OPTLEVELS:
        raise ValueError(f"`optlevel={value!r}` is not a Neuron optimization level; use 1, 2 or 3 (or 'O1'..'O3').")
    return text


class NeuronCompilerFlags(Callback):
    """Sets `NEURON_CC_FLAGS` before the first graph is compiled and restores it on teardown.

    `optlevel=1` compiles much faster than the default 2 at some cost in step time; `model_type="transformer"`
    enables transformer-specific optimizations. Values are validated here, not by the compiler minutes later.
    A flag the user already set in `NEURON_CC_FLAGS` is kept; the same flag with another value is an error.
    On XLA:CPU the flags do not change compilation, but they namespace `NeuronCompileCache`'s directory, so a
    run with other flags does not reuse entries there either, as on Neuron.
    """

    def __init__(
        self,
        optlevel: int | str | None = None,
        model_type: str | None = None,
        auto_cast: str | None = None,
        auto_cast_type: str | None = None,
        extra_flags: str | Sequence[str] | None = None,
    ) -> None:
        requested: list[_Flag] = []
        if optlevel is not None:
            requested.append(("--optlevel", _optlevel(optlevel)))
        if model_type is not None:
            requested.append(("--model-type", _choice("model_type", model_type, MODEL_TYPES)))
        if auto_cast is not None:
            requested.append(("--auto-cast", _choice("auto_cast", auto_cast, AUTO_CAST)))
        if auto_cast_type is not None:
            requested.append(("--auto-cast-type", _choice("auto_cast_type", auto_cast_type, AUTO_CAST_TYPES)))
        if extra_flags:
            extra = extra_flags if isinstance(extra_flags, str) else shlex.join(extra_flags)
            requested = parse_cc_flags(
                merge_cc_flags(
                    format_cc_flags(requested),
                    parse_cc_flags(extra),
                    "the NeuronCompilerFlags arguments",
                    "extra_flags",
                )
            )
        self._pairs = requested
        self._env = EnvironmentPatch()
        self._applied = False

    @property
    def flags(self) -> str:
        """This callback's own options as a `NEURON_CC_FLAGS` string."""
        return format_cc_flags(self._pairs)

    def apply(self) -> str:
        """Merge the options into `NEURON_CC_FLAGS` now (idempotent); returns the value in force.

        Call it before creating the Trainer to be sure nothing was compiled yet; the Trainer calls it in `setup`.
        """
        current = os.environ.get(NEURON_CC_FLAGS, "")
        if self._applied:
            return current
        merged = merge_cc_flags(current, self._pairs)
        runtime = get_runtime()
        compiled = runtime.metrics().compiles if runtime.is_installed() else 0
        if compiled:
            rank_zero_warn(
                f"NeuronCompilerFlags: this process already compiled {compiled} graph(s) with "
                f"NEURON_CC_FLAGS={current!r}; {merged!r} can only affect graphs compiled from now on: already "
                "compiled graphs are not rebuilt. Call `NeuronCompilerFlags(...).apply()` before any XLA work."
            )
        if merged != current:
            self._env.set(NEURON_CC_FLAGS, merged)
        if runtime.is_installed() and runtime.detect_platform().kind == CPU:
            log.info("NeuronCompilerFlags: XLA:CPU ignores NEURON_CC_FLAGS=%r (it only namespaces the cache).", merged)
        self._applied = True
        return merged

    def restore(self) -> None:
        """Put `NEURON_CC_FLAGS` back as it was before `apply`."""
        self._env.restore()
        self._applied = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.apply()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.restore()
