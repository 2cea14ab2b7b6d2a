"""Tolerances for comparing a float32 training run with a float32 reference, derived from the computation.

A sharded or pipelined run computes what the one-device reference computes, in another summation order (reductions
split over ranks, stages, microbatches), and another CPU's kernels (`ATEN_CPU_CAPABILITY`: `default`, `avx2`,
`avx512`) change the order again. Each float32 run then differs from the exact result by its rounding error, and
AdamW scales the errors of small gradients up to the size of a step, so that error cannot be bounded a priori. It
can be measured: the same reference run in float64 (the model cast to float64, what Lightning's `precision="64-true"`
does) stands in for the exact result, and `|reference32 - reference64|` is the reference's own error on this machine,
with this machine's kernels.

The rule: a run matches the reference when `|run - reference32| <= ERROR_RATIO * E`, where E is the reference's
largest error over the tensors compared (weights: over the whole state dict; losses: over the run's losses). Both
sides are float32 evaluations of the same steps, so by the triangle inequality the difference is at most the run's
error plus the reference's; ERROR_RATIO = 4 lets the run's error be three times the reference's, for the layouts that
split a sum into more pieces than the reference does. A real defect (a dropped gradient, an unsynchronised replica, a
tie lost across stages) moves weights by a learning-rate step (1e-3..1e-2 here), orders of magnitude above E
(1e-7..1e-5). The ratios measured on every layout, under `default`, `avx2` and `avx512`, are in
docs/contributing.md ("Tolerances"): the largest stays below ERROR_RATIO.

The weights bound uses E over the whole state dict, not per tensor: a tensor whose float32 error happens to be small
in the reference (a LayerNorm weight a step barely moves) is computed in the same steps, from the same gradients, as
the rest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import torch

#: how many times the reference's own float32 error the run may differ from it (module docstring)
ERROR_RATIO = 4.0
#: the least bound, in float32 steps (eps) at the values' scale: a reference exact to the last bit allows this much
FLOOR_STEPS = 4
#: where tests record the measured ratios (`LIGHTNING_TRN_TOLERANCE_LOG=path`: one JSON line per comparison)
LOG = "LIGHTNING_TRN_TOLERANCE_LOG"


def weights_error(reference32: Mapping[str, torch.Tensor], reference64: Mapping[str, torch.Tensor]) -> float:
    """E for weights: the float32 reference's largest difference from its float64 twin, over the state dict."""
    assert reference32.keys() == reference64.keys()
    return max(float((reference32[n].double() - reference64[n].double()).abs().max()) for n in reference32)


def losses_error(reference32: Sequence[float], reference64: Sequence[float]) -> float:
    """E for losses (or any sequence of numbers): the float32 reference's largest difference from its float64 twin."""
    assert len(reference32) == len(reference64), (len(reference32), len(reference64))
    return float(
        (torch.tensor(reference32, dtype=torch.float64) - torch.tensor(reference64, dtype=torch.float64)).abs().max()
    )


def _bound(error: float, values: Sequence[torch.Tensor]) -> float:
    """ERROR_RATIO x E, at least FLOOR_STEPS float32 steps at the values' scale."""
    scale = max(float(v.double().abs().max()) for v in values)
    return max(ERROR_RATIO * error, FLOOR_STEPS * torch.finfo(torch.float32).eps * scale)


def _record(what: str, difference: float, error: float, bound: float) -> None:
    path = os.environ.get(LOG)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].split("::")[-1]
        capability = os.environ.get("ATEN_CPU_CAPABILITY", "best")
        line = {"what": f"{test} {what}".strip(), "capability": capability, "difference": difference}
        line |= {"reference_error": error, "bound": bound}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def assert_weights_match(
    run: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], error: float, what: str = "weights"
) -> None:
    """Every tensor of `run` within ERROR_RATIO x `error` (`weights_error` of the reference) of `reference`."""
    assert run.keys() == reference.keys()
    bound = _bound(error, list(reference.values()))
    difference = 0.0
    for name, value in reference.items():
        ours, theirs = run[name].double(), value.double()
        difference = max(difference, float((ours - theirs).abs().max()))
        torch.testing.assert_close(
            ours,
            theirs,
            atol=bound,
            rtol=0,
            msg=lambda m, name=name: f"{what} {name}: {m} (reference error {error:.2e})",
        )
    _record(what, difference, error, bound)


def assert_losses_match(run: Sequence[float], reference: Sequence[float], error: float, what: str = "losses") -> None:
    """The run's numbers within ERROR_RATIO x `error` (`losses_error` of the reference) of `reference`."""
    assert len(run) == len(reference), (len(run), len(reference))
    ours, theirs = (torch.tensor(values, dtype=torch.float64) for values in (run, reference))
    bound = _bound(error, [theirs])
    torch.testing.assert_close(
        ours, theirs, atol=bound, rtol=0, msg=lambda m: f"{what}: {m} (reference error {error:.2e})"
    )
    _record(what, float((ours - theirs).abs().max()), error, bound)


def summary(log: str) -> str:
    """Per comparison and capability, the largest |run - reference| / bound seen (over 1.0 fails) and its E."""
    worst: dict[tuple[str, str], tuple[float, float]] = {}
    with open(log) as f:
        for line in f:
            entry = json.loads(line)
            key = (entry["what"], entry["capability"])
            ratio = entry["difference"] / entry["bound"]
            if ratio >= worst.get(key, (-1.0, 0.0))[0]:
                worst[key] = (ratio, entry["reference_error"])
    rows = [
        f"  {ratio:6.3f}  E={error:.1e}  {capability:<8} {what}"
        for (what, capability), (ratio, error) in sorted(worst.items())
    ]
    return "\n".join(
        ["tolerances (tests/tolerance.py): largest difference / bound, by comparison and capability", *rows]
    )


if __name__ == "__main__":
    import sys

    print(summary(sys.argv[1]) if os.path.exists(sys.argv[1]) else "tolerances: no comparison recorded")
