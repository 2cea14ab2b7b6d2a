"""The job economy (docs/job-economy.md) on the native backend: a recipe's whole job waits for the device (host syncs)
no more than an expert's eager loop, with no `.item()` reads and no CPU-fallback ops."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.native_only

SHORT_JOB = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=5",
    "trainer.limit_val_batches=3",
    "trainer.limit_test_batches=3",
]


def test_a_recipe_job_waits_for_the_device_once_per_read_point():
    """The MLP recipe's job as users run it (progress bar, CSV logger, checkpoints, validation, test), shortened to
    2 epochs, plugin and twin each in a fresh process: the plugin waits once per epoch-end value set, per
    checkpoint file and per teardown, never during the steps; the twin's `torch.save` waits once per tensor."""
    from benchmarks.job_economy import main, targets

    ((plugin, expert),) = main(["--workloads", "mlp", "--set", *SHORT_JOB]).values()
    assert plugin.per_phase("host_syncs") == {
        "setup": 1,
        "train": 0,
        "validation": 2,
        "epoch end": 2,
        "checkpoint": 4,
        "test": 1,
        "teardown": 2,
    }
    assert expert.per_phase("host_syncs") == {
        "setup": 0,
        "train": 0,
        "validation": 2,
        "epoch end": 2,
        "checkpoint": 24,
        "test": 1,
        "teardown": 0,
    }
    for side in (plugin, expert):
        assert all(p.metrics.scalar_reads == 0 and not p.metrics.cpu_fallbacks for p in side.phases.values())
    counts = {row[0]: row[3] for row in targets(plugin, expert, "native")}
    assert counts["host syncs <= 2x the twin's"] == "met"
    assert plugin.phases["train"].steps == expert.phases["train"].steps == 10
    # same SGD steps on the same eager kernels: same weights. Accuracy moves by 1/96 per other prediction (1e-6: its
    # float32 rounding); the loss (~2), the same batch losses grouped otherwise, by a few float32 ulps (~1e-6)
    assert plugin.test["test_acc"] == pytest.approx(expert.test["test_acc"], abs=1e-6)
    assert plugin.test["test_loss"] == pytest.approx(expert.test["test_loss"], abs=1e-5)
