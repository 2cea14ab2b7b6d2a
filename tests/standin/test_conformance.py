"""The stand-in against the CPU over PyTorch's own OpInfo and ModuleInfo databases (`standin.conformance`): a fixed
sample of the ops and modules gives the CPU's outputs, mutations, buffers and gradients or is in `KNOWN` with its
reason, and every `KNOWN` entry still differs (so the table stays honest). The full sweep:
`python -m lightning_trn.standin.conformance`."""

from __future__ import annotations

import pytest

from lightning_trn.standin import conformance

pytestmark = pytest.mark.native_only

SAMPLE = 4  # every 4th op and module by name: 176 ops and 29 modules


def test_sampled_ops_and_modules_equal_the_cpus_or_are_known() -> None:
    results = conformance.sweep(sample=SAMPLE)
    assert len(results) == 176 + 29
    assert [f"{r.kind} {r.name}: {r.status}: {r.detail}" for r in conformance.unexpected(results)] == []
    assert sum(r.status == conformance.PASS for r in results) > 0.9 * len(results)


def test_every_known_difference_still_differs() -> None:
    results = {r.name: r for r in conformance.sweep(names=conformance.KNOWN)}
    assert sorted(results) == sorted(conformance.KNOWN)  # each names an OpInfo or a ModuleInfo
    passing = [name for name, r in results.items() if r.status not in (conformance.DIFFERS, conformance.ERROR)]
    assert passing == [], "these equal the CPU's now: take them out of KNOWN"
