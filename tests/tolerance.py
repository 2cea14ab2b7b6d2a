"""Tolerances for comparing a float32 training run with a float32 reference, derived from the computation.

A sharded or pipelined run computes what the one-device reference computes, in another summation order (reductions
split over ranks, stages, microbatches), and another CPU's kernels (`ATEN_CPU_CAPABILITY`: `default`, `avx2`,
`avx512`) change the order again. Each float32 run then differs from the exact result by its rounding error, and
AdamW scales the errors of small gradients up to the size of a step, so that error cannot be bounded a priori. It
can be measured: the same reference run in float64 (the model cast to float64, what Lightning's `precision="64-true"`
does) stands in for the exact result (as far as the model computes in its own dtype: transformers' RMSNorm and rotary
embedding stay float32, which only loosens the bound), and `|reference32 - reference64|` is the reference's own
error on this machine, with this machine's kernels.

The rule, for weights: the run's root-mean-square difference from the reference, over every element of the state
dict, is at most ERROR_RATIO times E, the reference's root-mean-square error (`|reference32 - reference64|`) over the
same elements. Both sides are float32 evaluations of the same steps, so the difference is at most the run's error plus
the reference's; ERROR_RATIO = 4 lets the run's error be three times the reference's, for layouts that split a sum
into more pieces than the reference does. A root mean square over thousands of elements is a stable measure of
either error; the largest element is not: Adam moves an element whose gradient is near zero by up to a learning rate
either way, on a rounding error's sign, so the largest difference is one draw from a heavy tail (measured: a 2-rank
DDP run's largest difference was 10.7 times the reference's largest error under `avx2`, 2.4 times under `avx512`,
while its root-mean-square difference stayed within 2.1 times the reference's). A real defect (a dropped gradient,
an unsynchronised replica, a tie lost across stages, a norm left out of a tensor-parallel plan) moves whole tensors
by learning-rate steps (1e-3..1e-2 here): even confined to a few hundred of the state's elements it raises the root
mean square orders of magnitude above E. A twin that is not the same computation (E over TWIN_LIMIT of the values)
fails the test instead of widening its bound.

For losses (and other per-step or per-split numbers: each a mean over many tokens, so without that tail), the run's
largest difference is at most ERROR_RATIO times the reference's largest error over the same numbers. Every bound is
at least FLOOR_STEPS float32 steps (eps) at the values' scale (the state dict's root mean square; the numbers' largest
magnitude), for a reference exact to the last bit; TWIN_LIMIT is relative to the same scale. The ratios measured
under `default`, `avx2` and `avx512` are in docs/contributing.md ("Tolerances").

Where the bound is looser: a parameter whose exact gradient is zero (the bias of an attention key projection: softmax
ignores a constant added to every score) gets float32 rounding noise as its gradient, which Adam scales to
learning-rate steps, while its float64 twin barely moves. Such elements then dominate E (a docs-only trial on a
nanoGPT-shaped model with key biases: E 9e-5, 2,000 times the other elements' error), so a defect there fails by 12
to 26 times the bound rather than by orders of magnitude. It still fails; a per-tensor bound would be tighter but
trades this for the heavy tail that made the largest element useless.

Where one element dominates: Adam's first update of an element is g / (|g| + eps), whose slope is 1 / eps where the
gradient cancels to near zero (measured: a Qwen2 MLP weight's gradient of 1.4e-9 at the first step, among elements of
4e-4, gains 7.6e5 from its rounding to the weight; a tensor-parallel run's rounding of it, 2.8e-10, moved the weight
by 2.1e-4, a hundred times any other element's difference and twice the whole state's bound). Where the run's
optimizer inputs are known, `adam_allowance` derives that gain per element from the float64 reference's gradients and
its settings, and scales it by the float32 reference's measured gradient error (per tensor and step, the root mean
square of its difference from the twin's gradient): the rounding that Adam alone amplifies. `weights_ratio` then
compares what lies beyond ERROR_RATIO x that allowance, element by element, with ERROR_RATIO x the whole E: E keeps
the reference's own amplified elements, since they and what they change downstream (the same neuron's other weights
at later steps, which the allowance, a first-order slope through the optimizer only, does not model) are part of the
reference's error too. Everywhere else the allowance is far below E (a gradient of the tensor's size has a gain of
about the learning rate over its size), so a defect still shows in full; on a near-zero gradient's element it is
not detected, as it was not before (it fell in the heavy tail).

Use: `error = weights_error(reference32, reference64)` then `assert_weights_match(run, reference32, error)` (state
dicts by name); `error = losses_error(reference32, reference64)` then `assert_losses_match(run, reference32, error)`
(sequences of numbers). Set LIGHTNING_TRN_TOLERANCE_LOG to a file to record every comparison, passing or not, and
`python tests/tolerance.py FILE` to summarise it.
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
#: a float64 twin farther than this from the reference (relative to the values' scale) is another computation
TWIN_LIMIT = 1e-3
#: where tests record the measured ratios (`LIGHTNING_TRN_TOLERANCE_LOG=path`: one JSON line per comparison)
LOG = "LIGHTNING_TRN_TOLERANCE_LOG"


def _rms(tensors: Sequence[torch.Tensor]) -> float:
    flat = torch.cat([t.double().flatten() for t in tensors])
    return float(flat.square().mean().sqrt()) if flat.numel() else 0.0


def _same_computation(error: float, scale: float, what: str) -> float:
    """`error`, once it is a rounding error: a twin that differs by more than TWIN_LIMIT of the values' scale computed
    something else (another initialisation, other data), and would make every bound vacuous."""
    assert error <= TWIN_LIMIT * scale, (
        f"the float64 twin differs from the reference by {error:.2e} in {what} (scale {scale:.2e}): not a rounding "
        "error; the twin must run the reference's computation (same initial values, same data order)"
    )
    return error


def _beyond(
    run: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], allowance: Mapping[str, torch.Tensor] | None
) -> list[torch.Tensor]:
    """Per tensor, `|run - reference|` less `allowance` (`adam_allowance`), at least 0; the plain difference without
    one."""
    differences = []
    for name, value in reference.items():
        difference = run[name].double() - value.double()
        if allowance is not None and name in allowance:
            difference = (difference.abs() - allowance[name].reshape(difference.shape)).clamp_min(0)
        differences.append(difference)
    return differences


def weights_error(reference32: Mapping[str, torch.Tensor], reference64: Mapping[str, torch.Tensor]) -> float:
    """E for weights: the float32 reference's root-mean-square difference from its float64 twin, over the state dict."""
    assert reference32.keys() == reference64.keys()
    error = _rms(_beyond(reference32, reference64, None))
    return _same_computation(error, _rms(list(reference32.values())), "weights")


def adam_allowance(steps32: Sequence[Mapping], steps64: Sequence[Mapping]) -> dict[str, torch.Tensor]:
    """Per element of each parameter, how far AdamW's updates move it from the gradients' float32 rounding alone
    (module docstring): sum over steps s of |d w_final / d g_s| (AdamW's updates differentiated in float64 along the
    twin's gradients, element by element) x the float32 reference's gradient error at step s (the tensor's root mean
    square of `g32 - g64`). `steps32` / `steps64`: per optimizer step, `{"gradients": {name: tensor}, "settings":
    {name: (lr, beta1, beta2, eps, weight_decay)}}` of the float32 reference and its twin. Weight decay's factor
    (1 - lr x weight_decay per step, within 1e-3 of 1 in the sweep) is left out."""
    assert len(steps32) == len(steps64), (len(steps32), len(steps64))
    names = set().union(*(step["gradients"] for step in steps64)) if steps64 else set()
    allowance = {}
    for name in names:
        taken = [(s32, s64) for s32, s64 in zip(steps32, steps64, strict=True) if name in s64["gradients"]]
        gradients = [s64["gradients"][name].double().clone().requires_grad_(True) for _, s64 in taken]
        moved = torch.zeros_like(gradients[0])
        first = second = torch.zeros_like(gradients[0])
        for step, (gradient, (_, s64)) in enumerate(zip(gradients, taken, strict=True), start=1):
            lr, beta1, beta2, eps, _ = s64["settings"][name]
            first = beta1 * first + (1 - beta1) * gradient
            second = beta2 * second + (1 - beta2) * gradient.square()
            # + 1e-300: the square root's slope at an exactly zero second moment would be infinite (times 0: NaN)
            root = (second / (1 - beta2**step) + 1e-300).sqrt()
            moved = moved + lr * (first / (1 - beta1**step)) / (root + eps)
        slopes = torch.autograd.grad(moved.sum(), gradients)  # elements are independent: each one's own slope
        rounding = [_rms([s32["gradients"][name].double() - s64["gradients"][name].double()]) for s32, s64 in taken]
        allowance[name] = sum(slope.abs() * error for slope, error in zip(slopes, rounding, strict=True))
    return allowance


def losses_error(reference32: Sequence[float], reference64: Sequence[float]) -> float:
    """E for losses (or any sequence of numbers): the float32 reference's largest difference from its float64 twin."""
    assert len(reference32) == len(reference64), (len(reference32), len(reference64))
    ours, twin = torch.tensor(reference32, dtype=torch.float64), torch.tensor(reference64, dtype=torch.float64)
    return _same_computation(float((ours - twin).abs().max()), float(ours.abs().max()), "losses")


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


def weights_ratio(
    run: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    error: float,
    allowance: Mapping[str, torch.Tensor] | None = None,
) -> float:
    """`run`'s root-mean-square difference from `reference` over its bound (`assert_weights_match`'s): at most 1 is
    equal. With `allowance` (`adam_allowance`), the difference beyond ERROR_RATIO x it, element by element."""
    assert run.keys() == reference.keys()
    scaled = None if allowance is None else {name: ERROR_RATIO * value for name, value in allowance.items()}
    difference = _rms(_beyond(run, reference, scaled))
    return difference / _bound(error, [torch.tensor(_rms(list(reference.values())))])


def losses_ratio(run: Sequence[float], reference: Sequence[float], error: float) -> float:
    """`run`'s largest difference from `reference` over its bound (`assert_losses_match`'s): at most 1 is equal."""
    assert len(run) == len(reference), (len(run), len(reference))
    ours, theirs = (torch.tensor(values, dtype=torch.float64) for values in (run, reference))
    return float((ours - theirs).abs().max()) / _bound(error, [theirs])


def assert_weights_match(
    run: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], error: float, what: str = "weights"
) -> None:
    """`run`'s root-mean-square difference from `reference`, over every element, within ERROR_RATIO x `error`
    (`weights_error` of the reference); on failure, the tensors that differ most are named."""
    assert run.keys() == reference.keys()
    differences = {name: run[name].double() - value.double() for name, value in reference.items()}
    bound = _bound(error, [torch.tensor(_rms(list(reference.values())))])
    difference = _rms(list(differences.values()))
    _record(what, difference, error, bound)
    worst = sorted(differences, key=lambda name: -_rms([differences[name]]))[:3]
    named = ", ".join(f"{name} (rms {_rms([differences[name]]):.2e})" for name in worst)
    assert difference <= bound, (
        f"{what}: root-mean-square difference {difference:.2e} over the bound {bound:.2e} ({ERROR_RATIO:g} x the "
        f"reference's own float32 error {error:.2e}); most different: {named}"
    )


def assert_moments_match(
    run: Mapping, reference: Mapping, twin: Mapping, keys: Sequence[str] = ("exp_avg", "exp_avg_sq")
) -> None:
    """Adam's per-parameter state (optimizer state dicts: `state[position][key]`) within the weights rule, each key
    with its own E from the reference's `twin` (the moments' scales differ by orders of magnitude)."""
    for key in keys:
        ours, theirs, exact = ({str(i): state[key] for i, state in o["state"].items()} for o in (run, reference, twin))
        assert_weights_match(ours, theirs, weights_error(theirs, exact), what=key)


def assert_losses_match(run: Sequence[float], reference: Sequence[float], error: float, what: str = "losses") -> None:
    """The run's numbers within ERROR_RATIO x `error` (`losses_error` of the reference) of `reference`."""
    assert len(run) == len(reference), (len(run), len(reference))
    ours, theirs = (torch.tensor(values, dtype=torch.float64) for values in (run, reference))
    bound = _bound(error, [theirs])
    difference = float((ours - theirs).abs().max())
    _record(what, difference, error, bound)
    assert difference <= bound, (
        f"{what}: largest difference {difference:.2e} over the bound {bound:.2e} ({ERROR_RATIO:g} x the reference's "
        f"own float32 error {error:.2e}, at least {FLOOR_STEPS} float32 steps at the values' scale): {list(run)} "
        f"against {list(reference)}"
    )


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
