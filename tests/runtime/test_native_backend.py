"""`Trainer(accelerator="neuron")` on the native backend, with the stand-in as the `neuron` device."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_trn  # noqa: F401  registers accelerator="neuron"
from lightning_trn.runtime import get_runtime, select_backend
from tests.recipe_runs import export_checkpoint, run_without_standin

pytestmark = pytest.mark.native_only


class RecordingModel(BoringModel):
    """Records where the weights live and what dtype the layer computes in, at every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.device, torch.dtype, torch.dtype]] = []

    def training_step(self, batch, batch_idx):
        out = self.layer(batch)
        self.seen.append((self.layer.weight.device, self.layer.weight.dtype, out.dtype))
        return self.loss(out)


def fit(tmp_path, **trainer_args) -> tuple[RecordingModel, Trainer]:
    model = RecordingModel()
    trainer = Trainer(
        accelerator="neuron",
        devices=1,
        max_steps=4,
        limit_val_batches=2,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        logger=False,
        **trainer_args,
    )
    trainer.fit(model)
    return model, trainer


def test_the_native_backend_is_chosen_where_torch_has_a_neuron_device() -> None:
    assert select_backend() == ("native", "torch has the native `neuron` device")
    assert get_runtime().name == "native" and get_runtime().device() == torch.device("neuron", 0)


def test_runtime_metrics_are_the_stand_in_counters() -> None:
    from lightning_trn import standin

    x = torch.ones(3, device="neuron")
    standin.reset_counters()
    before = get_runtime().metrics()
    x.sum().item()
    x.cpu()
    delta = get_runtime().metrics() - before
    assert (delta.scalar_reads, delta.device_to_host, delta.host_syncs, delta.compiles) == (1, 1, 2, 0)
    assert delta.cpu_fallbacks == {}  # the stand-in serves every op on the host, but none is a CPU-fallback op
    with standin.host_ops(["aten::sum"]):  # now sum runs as TorchNeuron runs ops it has no kernel for
        x.sum()
    delta = get_runtime().metrics() - before
    assert delta.cpu_fallbacks == {"aten::sum.IntList_out": 1} == standin.host_op_counts()
    # its input and its out= buffer copied to the host, the result copied back
    assert (delta.device_to_host - 1, delta.host_to_device) == (2, 1)


def test_tensors_come_to_the_host_for_one_host_sync() -> None:
    """`to_host` (checkpoints, epoch-end values, teardown) queues every copy and waits once; the copies are exact,
    whatever their dtype and shape."""
    device = get_runtime().device()
    tensors = [
        torch.randn(3, 4, device=device),
        torch.tensor(7, device=device),
        torch.ones(2, dtype=torch.bfloat16, device=device),
        torch.tensor([True, False], device=device),
    ]
    before = get_runtime().metrics()
    copies = get_runtime().to_host(tensors)
    delta = get_runtime().metrics() - before
    assert (delta.device_to_host, delta.host_syncs) == (4, 1)
    assert all(c.device.type == "cpu" and c.dtype == t.dtype for c, t in zip(copies, tensors, strict=True))
    blocking = [t.cpu() for t in tensors]
    assert all(torch.equal(c, b) for c, b in zip(copies, blocking, strict=True))
    assert get_runtime().to_host([]) == [] and (get_runtime().metrics() - before).host_syncs == 1 + len(tensors)


def test_boring_model_trains_on_the_neuron_device(tmp_path) -> None:
    model = RecordingModel()
    before = model.layer.weight.detach().clone()
    model, trainer = fit(tmp_path)
    assert trainer.strategy.root_device == torch.device("neuron", 0)
    assert [device for device, _, _ in model.seen] == [torch.device("neuron", 0)] * 4
    assert {(weight, out) for _, weight, out in model.seen} == {(torch.float32, torch.float32)}
    assert not torch.equal(model.layer.weight.detach().cpu(), before)  # it trained


def test_bf16_mixed_runs_the_layer_in_bf16_with_fp32_weights(tmp_path) -> None:
    model, _ = fit(tmp_path, precision="bf16-mixed")
    assert {(weight, out) for _, weight, out in model.seen} == {(torch.float32, torch.bfloat16)}


def test_bf16_true_trains_bf16_weights_with_software_stochastic_rounding(tmp_path) -> None:
    model = RecordingModel()
    before = model.layer.weight.detach().to(torch.bfloat16)
    model, trainer = fit(tmp_path, precision="bf16-true")
    assert trainer.precision_plugin.software_optimizer_step is not None  # the stand-in is no NeuronCore
    assert {(weight, out) for _, weight, out in model.seen} == {(torch.bfloat16, torch.bfloat16)}
    assert not torch.equal(model.layer.weight.detach().cpu(), before)


def test_metrics_report_torchneuron_fallback_ops_by_name(monkeypatch) -> None:
    """On a trn2 the CPU-fallback ops come from `torch_neuronx.get_fallback_ops()` (a list of names, cumulative):
    faked here at that boundary, with the stand-in out of the way."""
    import types

    from lightning_trn.runtime import native

    seen: list[str] = []
    fake = types.ModuleType("torch_neuronx")
    fake.get_fallback_ops = lambda: list(seen)
    monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
    monkeypatch.setattr(native, "_standin", lambda: None)
    runtime = native.NativeRuntime()
    before = runtime.metrics()
    seen.extend(["aten::nonzero", "aten::median.dim_values"])
    middle = runtime.metrics()
    seen.append("aten::unique_dim")
    assert (middle - before).cpu_fallbacks == {"aten::nonzero": 1, "aten::median.dim_values": 1}
    assert (runtime.metrics() - middle).cpu_fallbacks == {"aten::unique_dim": 1}  # only the op new in this window
    assert middle.device_to_host == 0  # TorchNeuron counts no transfers


def test_bf16_true_on_trainium_rounds_in_software_natively(monkeypatch) -> None:
    """TorchNeuron documents no stochastic-rounding switch (NEURON_RT_STOCHASTIC_ROUNDING_EN is the XLA stack's), so
    on NeuronCores (faked at the runtime boundary) the native backend rounds in software and sets no variable."""
    from lightning_trn.pytorch.precision import NeuronPrecision
    from lightning_trn.runtime import Platform
    from lightning_trn.runtime.discovery import NEURON

    monkeypatch.delenv("NEURON_RT_STOCHASTIC_ROUNDING_EN", raising=False)
    monkeypatch.setattr(get_runtime(), "detect_platform", lambda: Platform(NEURON, 2, "faked by the test"))
    plugin = NeuronPrecision("bf16-true")
    try:
        assert plugin.software_optimizer_step is not None
        assert "NEURON_RT_STOCHASTIC_ROUNDING_EN" not in os.environ
    finally:
        plugin.teardown()


@pytest.mark.slow
def test_mlp_recipe_reaches_0_9_and_its_checkpoint_loads_without_the_stand_in(tmp_path) -> None:
    env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "lightning_trn.recipes.mlp", "trainer.enable_progress_bar=false"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "lightning_trn: native backend" in run.stderr
    accuracy = float(re.search(r"test_acc=([0-9.]+)", run.stdout).group(1))
    assert accuracy >= 0.9
    checkpoint = tmp_path / "runs" / "mlp" / "checkpoints" / "last.ckpt"
    code = (
        "import sys, torch\n"
        "assert torch._C._get_privateuse1_backend_name() == 'privateuseone'  # no stand-in here\n"
        "state = torch.load(sys.argv[1], weights_only=True)['state_dict']\n"
        "print(sorted({str(t.device) for t in state.values()}))\n"
    )
    loaded = run_without_standin(code, str(checkpoint), cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip() == "['cpu']"


@pytest.mark.slow
def test_vit_recipe_runs_natively_and_its_export_loads_without_the_stand_in(tmp_path) -> None:
    """The ViT recipe (no timm: its model is plain PyTorch with timm's weights layout) trains on the stand-in, and
    the exported conv-form weights give the checkpoint's logits in a process without it."""
    env = {**os.environ, "LIGHTNING_TRN_STANDIN": "1", "LIGHTNING_TRN_STANDIN_DEVICES": "1"}
    overrides = [
        "model.embed_dim=32",
        "model.depth=2",
        "model.num_heads=2",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=40",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=8",
        "trainer.enable_progress_bar=false",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "lightning_trn.recipes.vit", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "lightning_trn: native backend" in run.stderr
    assert float(re.search(r"test_acc=([0-9.]+)", run.stdout).group(1)) > 0.2  # chance is 0.1
    checkpoint = tmp_path / "runs" / "vit" / "checkpoints" / "last.ckpt"
    export_checkpoint("vit", checkpoint, tmp_path / "export", env)
    code = (
        "import json, sys, torch\n"
        "from pathlib import Path\n"
        "from safetensors.torch import load_file\n"
        "from lightning_trn.recipes import common\n"
        "from lightning_trn.recipes.patch_embed import to_linear_state_dict\n"
        "from lightning_trn.recipes.vit_network import VisionTransformer\n"
        "from lightning_trn.recipes.vit import RECIPE\n"
        "assert torch._C._get_privateuse1_backend_name() == 'privateuseone'  # no stand-in here\n"
        "out = Path(sys.argv[2])\n"
        "net = VisionTransformer(**json.loads((out / 'config.json').read_text())).eval()\n"
        "net.load_state_dict(to_linear_state_dict(load_file(out / 'model.safetensors')))\n"
        "module = common.load_module(RECIPE, sys.argv[1]).eval()\n"
        "x = torch.randn(4, 784)\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(net(x.reshape(4, 1, 28, 28)), module.logits({'x': x}))\n"
        "print('EXPORT OK')\n"
    )
    loaded = run_without_standin(code, str(checkpoint), str(tmp_path / "export"), cwd=Path(__file__).parents[2])
    assert "EXPORT OK" in loaded.stdout, loaded.stderr[-2000:]


def test_each_local_rank_takes_its_own_device_and_too_many_ranks_are_refused() -> None:
    from lightning_trn.runtime import NativeRuntime, NeuronUnavailableError
    from lightning_trn.runtime.environment import EnvironmentPatch

    runtime, env = NativeRuntime(), EnvironmentPatch()
    common = {"world_size": 3, "local_world_size": 3, "main_address": "127.0.0.1", "env": env}
    try:
        runtime.configure_process(global_rank=1, local_rank=1, **common)
        assert runtime.device() == torch.device("neuron", 1)
        with pytest.raises(NeuronUnavailableError, match="local rank 2 of 3 on this node, but torch sees only 2"):
            runtime.configure_process(global_rank=2, local_rank=2, **common)
    finally:
        torch.neuron.set_device(0)


def test_the_compile_cache_callback_says_it_does_nothing_natively(tmp_path) -> None:
    """`NeuronCompileCache` drives the XLA stack's compile cache: natively it warns once (over fit and test) that it
    does nothing, and neither creates its directory nor reaches its S3 store (here one where nothing listens)."""
    from lightning_trn.pytorch.callbacks import NeuronCompileCache

    cache = NeuronCompileCache(
        "s3://bucket/prefix",
        local_dir=str(tmp_path / "cache"),
        endpoint_url="http://127.0.0.1:9",
        connect_timeout=0.5,
        max_attempts=1,
    )
    with pytest.warns(UserWarning) as record:
        warnings.simplefilter("always")  # a repeated warning is recorded, not filtered as a duplicate
        model, trainer = fit(tmp_path, callbacks=[cache])
        trainer.test(model, verbose=False)
    messages = [str(warning.message) for warning in record if "NeuronCompileCache" in str(warning.message)]
    assert messages == [messages[0]] and "has no compile cache this callback can set" in messages[0]
    assert cache.cache_dir is None and not (tmp_path / "cache").exists()
