"""Each row of docs/troubleshooting.md: make the mistake, check the documented message."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from models import RegressionModel

import lightning_trn
from lightning_trn import NeuronPrecision
from lightning_trn.core.parallel.zero1 import Zero1Sharding
from lightning_trn.pytorch.callbacks import CompileMonitor, NeuronCompileCache, NeuronCompilerFlags
from lightning_trn.pytorch.strategies.ddp import NeuronDDPStrategy
from lightning_trn.runtime import BACKEND_ENV, discovery, selection
from lightning_trn.runtime.collectives import check_world_size

pytestmark = pytest.mark.xla_only

TABLE = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"
#: rows whose mistake needs the native backend: checked by tests/strategies/test_model_parallel.py
NATIVE_ROWS = ("model-parallel-sizes", "model-parallel-optimizer", "fsdp-sharding-strategy")


def documented_rows() -> dict[str, list[str]]:
    """id -> the message fragments of its row (the last column, split at `…`)."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"[a-z][a-z0-9-]*", cells[0]) and cells[0] != "id":
            rows[cells[0]] = [part.strip().strip("`") for part in cells[3].split("…")]
    return rows


def message_of(action: Callable[[], object]) -> str:
    """The text of the error `action` raises, or of the warnings it emits."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            action()
        except Exception as err:  # noqa: BLE001  the documented errors are of many types; the message is checked
            return str(err)
    return "\n".join(str(w.message) for w in caught)


@pytest.fixture
def trigger(tmp_path, monkeypatch, fake_neuron_host) -> Callable[[str], str]:
    def too_many_devices():
        fake_neuron_host([2, 2])
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
        Trainer(accelerator="neuron", devices=4, logger=False)

    def no_neuroncores():
        fake_neuron_host([])
        Trainer(accelerator="neuron", logger=False)

    def torch_xla_missing():
        monkeypatch.setattr(discovery, "torch_xla_installed", lambda: False)
        Trainer(accelerator="neuron", logger=False)

    def other_pjrt_device():
        monkeypatch.setenv("PJRT_DEVICE", "TPU")
        Trainer(accelerator="neuron", logger=False)

    def conflicting_cc_flags():
        monkeypatch.setenv("NEURON_CC_FLAGS", "--optlevel=2")
        trainer = Trainer(accelerator="neuron", max_steps=1, logger=False, callbacks=[NeuronCompilerFlags(optlevel=1)])
        trainer.fit(RegressionModel())

    def unreachable_cache():
        for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
            monkeypatch.setenv(name, value)
        cache = NeuronCompileCache(
            "s3://bucket/prefix",
            local_dir=str(tmp_path / "cache"),
            endpoint_url="http://127.0.0.1:9",
            connect_timeout=1,
            max_attempts=1,
        )
        cache.pull()

    def dynamic_shapes():
        from test_compile_monitor import SequenceRegressor

        # shapes no other test compiles: XLA caches graphs per process, and a cached graph is not a new compile
        shapes = [(5, 31), (5, 31), (5, 32), (5, 33), (5, 34)]
        trainer = Trainer(
            accelerator="neuron",
            max_epochs=1,
            logger=False,
            callbacks=[CompileMonitor(warmup_steps=2)],
            enable_checkpointing=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(SequenceRegressor(shapes, [(5, 31)]))

    def wrong_accelerator():
        trainer = Trainer(accelerator="cpu", strategy="neuron_single", max_steps=1, logger=False)
        trainer.fit(RegressionModel())

    def backend_both_stacks():
        monkeypatch.setattr(selection, "native_device_available", lambda: True)
        Trainer(accelerator="neuron", logger=False)

    def backend_from_env(name: str) -> Callable[[], object]:
        def make() -> None:
            monkeypatch.setenv(BACKEND_ENV, name)
            Trainer(accelerator="neuron", logger=False)

        return make

    def logical_core_config():
        fake_neuron_host([8, 8])
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
        Trainer(accelerator="neuron", logger=False)

    def accelerator_name_taken():
        from lightning.pytorch.accelerators import AcceleratorRegistry, CPUAccelerator

        entry = dict.get(AcceleratorRegistry, "neuron")
        AcceleratorRegistry.register("neuron", CPUAccelerator, override=True)
        try:
            Trainer(accelerator="neuron", logger=False)
        finally:
            AcceleratorRegistry["neuron"] = entry

    def autograd_started_first():
        # the real case needs a fresh process (tests/hooks/test_cpu_backward_first.py); here autograd's assert is
        # replayed
        def engine_without_device_workers(*args, **kwargs):
            raise RuntimeError("0 <= device.index() && device.index() < device_ready_queues_.size() INTERNAL ASSERT")

        monkeypatch.setattr(torch.Tensor, "backward", engine_without_device_workers)
        runtime = lightning_trn.runtime.get_runtime()
        runtime.check_autograd(runtime.device())

    actions: dict[str, Callable[[], object]] = {
        "unknown-precision": lambda: Trainer(accelerator="neuron", precision="16-mixed", logger=False),
        "too-many-devices": too_many_devices,
        "no-neuroncores": no_neuroncores,
        "torch-xla-missing": torch_xla_missing,
        "other-pjrt-device": other_pjrt_device,
        "bad-optlevel": lambda: NeuronCompilerFlags(optlevel=4),
        "bad-model-type": lambda: NeuronCompilerFlags(model_type="cnn"),
        "conflicting-cc-flags": conflicting_cc_flags,
        "unreachable-cache": unreachable_cache,
        "dynamic-shapes": dynamic_shapes,
        "xla-backend-on-cpu": lambda: NeuronDDPStrategy(process_group_backend="xla")._setup_distributed(),
        "world-size-mismatch": lambda: check_world_size(2, 1, cross_process=True),
        "wrong-accelerator": wrong_accelerator,
        "master-weights-precision": lambda: NeuronPrecision("bf16-mixed", master_weights=True),
        "backend-both-stacks": backend_both_stacks,
        "backend-native-missing": backend_from_env("native"),
        "backend-unknown": backend_from_env("tpu"),
        "compile-dynamic": lambda: lightning_trn.compile(torch.nn.Linear(2, 2), dynamic=True),
        "logical-core-config": logical_core_config,
        "unsupported-strategy": lambda: Trainer(accelerator="neuron", strategy="ddp_spawn", devices=2, logger=False),
        "accelerator-name-taken": accelerator_name_taken,
        "autograd-started-first": autograd_started_first,
        "sharded-xla": lambda: Trainer(accelerator="neuron", strategy=ModelParallelStrategy(), logger=False),
        "zero1-optimizer": lambda: Zero1Sharding(  # refused before the collectives are used
            torch.optim.LBFGS(torch.nn.Linear(2, 2).parameters()),
            None,
            None,
            0,
            torch.Tensor.to,  # type: ignore
        ),
    }
    return lambda row: message_of(actions[row])


@pytest.mark.parametrize(("row", "fragments"), sorted(documented_rows().items()))
def test_documented_message(row, fragments, trigger):
    if row in NATIVE_ROWS:
        pytest.skip("a native-backend mistake: tests/strategies/test_model_parallel.py checks it")
    message = trigger(row)
    for fragment in fragments:
        assert fragment in message, f"{row}: {fragment!r} not in {message!r}"


def test_table_has_every_row():
    assert len(documented_rows()) == 27
