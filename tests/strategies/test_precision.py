"""`NeuronPrecision`: which plugin `precision=` resolves to, the dtypes each mode really produces in a fit on XLA:CPU,
why stochastic rounding matters, and the Neuron environment handling (platform faked at the runtime boundary)."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from xla_free_python import run_without_torch_xla

import lightning_trn  # noqa: F401  (registers accelerator="neuron")
from lightning_trn.core.stochastic_rounding import Bf16OptimizerStep, stochastic_round_to_bf16
from lightning_trn.pytorch.precision import NeuronPrecision
from lightning_trn.runtime import Platform, get_runtime
from lightning_trn.runtime.discovery import CPU, NEURON

pytestmark = pytest.mark.xla_only

SR_EN = "NEURON_RT_STOCHASTIC_ROUNDING_EN"
SR_SEED = "NEURON_RT_STOCHASTIC_ROUNDING_SEED"
CC_FLAGS = "NEURON_CC_FLAGS"


def _trainer(**kwargs) -> Trainer:
    defaults = {
        "accelerator": "neuron",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return Trainer(**{**defaults, **kwargs})


# --- resolution -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (32, "32-true"),
        ("32", "32-true"),
        ("32-true", "32-true"),
        ("bf16", "bf16-mixed"),
        ("bf16-mixed", "bf16-mixed"),
        ("bf16-true", "bf16-true"),
    ],
)
def test_precision_flag_resolves_to_neuron_precision(flag, expected):
    trainer = _trainer(precision=flag)
    assert isinstance(trainer.precision_plugin, NeuronPrecision)
    assert trainer.precision_plugin.precision == expected


@pytest.mark.parametrize("flag", ["16-mixed", "16-true", "64-true", 16])
def test_unsupported_precision_lists_supported_ones(flag):
    with pytest.raises(ValueError, match="Choose one of: 32-true, bf16-mixed, bf16-true"):
        _trainer(precision=flag)


def test_master_weights_only_for_bf16_true():
    with pytest.raises(ValueError, match="applies to precision=.bf16-true. only"):
        NeuronPrecision("bf16-mixed", master_weights=True)


# --- dtypes in real fits on XLA:CPU -------------------------------------------------------------------------------


class DtypeProbe(LightningModule):
    """Records the dtypes that matter: input, an activation inside the forward context, loss, parameter, gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)
        self.seen: dict[str, torch.dtype] = {}
        self.compiles: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.hidden(x)
        loss = F.mse_loss(self.out(torch.relu(h)), y.to(h.dtype))
        self.seen.update(input=x.dtype, activation=h.dtype, loss=loss.dtype)
        return loss

    def on_after_backward(self) -> None:
        self.seen.update(param=self.hidden.weight.dtype, grad=self.hidden.weight.grad.dtype)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.compiles.append(get_runtime().metrics().compiles)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def optimizer_state_dtypes(self) -> set[torch.dtype]:
        optimizer = self.trainer.optimizers[0]
        return {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"}


def _fit(precision: NeuronPrecision | str, max_steps: int = 3) -> tuple[DtypeProbe, Trainer]:
    torch.manual_seed(0)
    model = DtypeProbe()
    chosen = {"precision": precision} if isinstance(precision, str) else {"plugins": [precision]}
    trainer = _trainer(max_steps=max_steps, **chosen)
    trainer.fit(model)
    return model, trainer


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    ("precision", "expected", "state"),
    [
        ("32-true", {"input": F32, "activation": F32, "loss": F32, "param": F32, "grad": F32}, F32),
        # autocast: matmuls in bf16, mse_loss autocasts to fp32; fp32 parameters, gradients and optimizer state
        ("bf16-mixed", {"input": F32, "activation": BF16, "loss": F32, "param": F32, "grad": F32}, F32),
        # everything bf16; the software-rounded update puts the optimizer state back in bf16 as on a NeuronCore
        ("bf16-true", {"input": BF16, "activation": BF16, "loss": BF16, "param": BF16, "grad": BF16}, BF16),
    ],
)
def test_fit_dtypes(precision, expected, state):
    model, trainer = _fit(precision)
    assert model.seen == expected
    assert model.optimizer_state_dtypes() == {state}
    assert trainer.global_step == 3


def test_bf16_true_software_rounding_trains_without_recompiling_each_step():
    torch.manual_seed(0)
    before = [p.detach().to(BF16).clone() for p in DtypeProbe().parameters()]
    model, trainer = _fit("bf16-true", max_steps=7)
    assert trainer.precision_plugin.software_optimizer_step is not None  # XLA:CPU: no hardware rounding
    after = [p.detach().cpu() for p in model.parameters()]
    assert all(p.dtype == BF16 for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # the random bits come from the device RNG: later steps reuse the compiled graph
    assert model.compiles[3] == model.compiles[-1], model.compiles


def test_bf16_true_master_weights_dtypes_checkpoint_and_resume(tmp_path):
    plugin = NeuronPrecision("bf16-true", master_weights=True)
    model, trainer = _fit(plugin)
    assert model.seen == {"input": BF16, "activation": BF16, "loss": BF16, "param": BF16, "grad": BF16}
    assert model.optimizer_state_dtypes() == {F32}
    masters = plugin.state_dict()["master_weights"]
    assert set(masters) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert masters[name].dtype == F32 and masters[name].device.type == "cpu"
        assert torch.equal(masters[name].to(BF16), param.detach().cpu())  # bf16 params are copies of the masters

    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert {t.dtype for t in checkpoint["state_dict"].values()} == {BF16}
    assert {t.device.type for t in checkpoint["state_dict"].values()} == {"cpu"}
    assert torch.equal(checkpoint["NeuronPrecision"]["master_weights"]["hidden.weight"], masters["hidden.weight"])

    # resume at the last step (no further update): the masters come back from the checkpoint
    resumed = NeuronPrecision("bf16-true", master_weights=True)
    probe = DtypeProbe()
    _trainer(plugins=[resumed], max_steps=3).fit(probe, ckpt_path=path)
    assert torch.equal(resumed.state_dict()["master_weights"]["hidden.weight"], masters["hidden.weight"])


# --- stochastic rounding ------------------------------------------------------------------------------------------


def test_stochastic_round_is_unbiased_and_keeps_representable_values():
    values = torch.tensor([1.0 + 2**-9, -3.0 - 2**-8, 2.0**-20 * 1.3, 1000.7])
    samples = stochastic_round_to_bf16(values.repeat(20000, 1)).float()
    for i, v in enumerate(values):
        seen = set(samples[:, i].tolist())
        assert len(seen) == 2  # exactly the two neighbouring bf16 values
        assert min(seen) < v < max(seen)
        # the mean of 20000 draws of neighbours s apart has std s x sqrt(p (1 - p) / 20000) <= s / 283, and s <= 2**-7 v
        # here: at most 2.8e-5 of v, so 2e-4 is 7 standard deviations
        assert samples[:, i].mean().item() == pytest.approx(v.item(), rel=2e-4)
    exact = torch.randn(1000).to(BF16)
    assert torch.equal(stochastic_round_to_bf16(exact.float()), exact)
    special = torch.tensor([0.0, float("inf"), float("-inf")])
    assert torch.equal(stochastic_round_to_bf16(special).float(), special)
    assert stochastic_round_to_bf16(torch.tensor([float("nan")])).isnan().all()


def _regression_losses(device: torch.device, mode: str, steps: int = 300) -> tuple[float, float]:
    """Linear regression from w=1 towards w*=1±0.1 with SGD lr 5e-3: each update (~1e-3) is below half the bf16
    spacing at 1.0 (2^-8 ≈ 3.9e-3). Returns (initial loss, final loss) measured in fp32."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    w_true = 1.0 + 0.1 * torch.randn(16, 1, generator=g)
    x, y = x.to(device), (x @ w_true).to(device)
    dtype = F32 if mode == "fp32" else BF16
    w = nn.Parameter(torch.ones(16, 1, device=device, dtype=dtype))
    optimizer = torch.optim.SGD([w], lr=5e-3)
    sr_step = Bf16OptimizerStep()

    def full_loss() -> float:
        return F.mse_loss(x @ w.detach().float(), y).item()

    initial = full_loss()
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(x.to(dtype) @ w, y.to(dtype)).backward()
        if mode == "bf16-sr":
            sr_step.step(optimizer)
        else:
            optimizer.step()
        if device.type == "xla":
            get_runtime().sync()
    return initial, full_loss()


@pytest.mark.parametrize("device_kind", ["cpu", "xla"])
def test_stochastic_rounding_tracks_fp32_where_round_to_nearest_stalls(device_kind):
    device = torch.device("cpu") if device_kind == "cpu" else get_runtime().device()
    torch.manual_seed(0)
    initial, fp32 = _regression_losses(device, "fp32")
    _, nearest = _regression_losses(device, "bf16-rn")
    _, stochastic = _regression_losses(device, "bf16-sr")
    assert fp32 < 0.01 * initial  # the fp32 reference converges
    assert nearest > 0.9 * initial  # round-to-nearest: every update is rounded away
    # stochastic rounding follows fp32 down to within 2% of the initial loss
    assert abs(stochastic - fp32) < 0.02 * initial, (initial, fp32, stochastic)


def test_software_rounding_works_without_torch_xla(tmp_path):
    """A CPU/GPU run of the same code (no torch_xla): the plugin falls back to software rounding, and a bf16 weight
    receives updates far below its bf16 spacing."""
    result = run_without_torch_xla(
        """
        import torch
        from lightning_trn import NeuronPrecision
        step = NeuronPrecision("bf16-true").software_optimizer_step
        w = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        optimizer = torch.optim.SGD([w], lr=1e-3)
        for _ in range(100):
            w.grad = torch.ones_like(w)  # 100 updates of -1e-3, each a quarter of the bf16 spacing at 1.0
            step.step(optimizer)
        print("MEAN", w.float().mean().item(), w.dtype)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    mean = float(result.stdout.split("MEAN")[1].split()[0])
    # unbiased: each weight's 100 roundings (p ~ 1/4 of the spacing 2**-8) add variance 100 x 0.19 x 2**-16, std
    # 0.017; the mean of 4096 weights has std 2.7e-4, and 2e-3 is 7 of them
    assert mean == pytest.approx(0.9, abs=2e-3)
    assert "torch.bfloat16" in result.stdout


# --- Neuron environment handling (platform faked at the runtime boundary) -----------------------------------------


@pytest.fixture
def platform(monkeypatch):
    """Fake the detected platform; start from an environment without the Neuron/bf16 variables."""
    for name in (SR_EN, SR_SEED, CC_FLAGS, "PL_GLOBAL_SEED", "XLA_USE_BF16", "XLA_DOWNCAST_BF16"):
        monkeypatch.delenv(name, raising=False)

    def fake(kind: str) -> None:
        monkeypatch.setattr(get_runtime(), "detect_platform", lambda: Platform(kind, 2, "faked by the test"))

    return fake


def test_bf16_true_on_neuron_enables_hardware_rounding_and_restores(platform):
    platform(NEURON)
    plugin = NeuronPrecision("bf16-true", seed=7)
    assert os.environ[SR_EN] == "1"
    assert os.environ[SR_SEED] == "7"
    assert os.environ[CC_FLAGS] == "--auto-cast=none"
    assert plugin.software_optimizer_step is None  # the NeuronCore rounds
    plugin.teardown()
    assert not {SR_EN, SR_SEED, CC_FLAGS} & set(os.environ)


def test_rounding_seed_follows_seed_everything(platform, monkeypatch):
    platform(NEURON)
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    plugin = NeuronPrecision("bf16-true")
    assert os.environ[SR_SEED] == "42"
    plugin.teardown()


def test_bf16_mixed_on_neuron_merges_auto_cast_into_user_flags(platform, monkeypatch):
    platform(NEURON)
    monkeypatch.setenv(CC_FLAGS, "--optlevel 1 --cache_dir=/tmp/cc")
    plugin = NeuronPrecision("bf16-mixed")
    assert os.environ[CC_FLAGS] == "--optlevel=1 --cache_dir=/tmp/cc --auto-cast=none"
    assert SR_EN not in os.environ  # fp32 parameters: no stochastic rounding needed
    plugin.teardown()
    assert os.environ[CC_FLAGS] == "--optlevel 1 --cache_dir=/tmp/cc"


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_user_auto_cast_wins_and_conflict_warns(platform, monkeypatch, precision):
    platform(NEURON)
    monkeypatch.setenv(CC_FLAGS, "--auto-cast matmult")
    with pytest.warns(UserWarning, match="auto-cast=matmult"):
        plugin = NeuronPrecision(precision)
    assert os.environ[CC_FLAGS] == "--auto-cast matmult"
    plugin.teardown()
    assert os.environ[CC_FLAGS] == "--auto-cast matmult"


def test_user_disabled_stochastic_rounding_wins_and_warns(platform, monkeypatch):
    platform(NEURON)
    monkeypatch.setenv(SR_EN, "0")
    monkeypatch.setenv(SR_SEED, "3")
    with pytest.warns(UserWarning, match=f"{SR_EN}='0' is set in the environment and kept"):
        plugin = NeuronPrecision("bf16-true", seed=9)
    assert os.environ[SR_EN] == "0" and os.environ[SR_SEED] == "3"
    assert plugin.software_optimizer_step is None  # the user asked for round-to-nearest: no software rounding either
    plugin.teardown()
    assert os.environ[SR_EN] == "0" and os.environ[SR_SEED] == "3"


def test_no_stochastic_rounding_option_leaves_runtime_variables_alone(platform):
    platform(NEURON)
    plugin = NeuronPrecision("bf16-true", stochastic_rounding=False)
    assert SR_EN not in os.environ and SR_SEED not in os.environ
    plugin.teardown()


def test_off_neuron_no_variables_are_set_and_rounding_is_in_software(platform):
    platform(CPU)
    before = dict(os.environ)
    plugin = NeuronPrecision("bf16-true")
    assert dict(os.environ) == before
    assert plugin.software_optimizer_step is not None
    assert NeuronPrecision("bf16-true", stochastic_rounding=False).software_optimizer_step is None


def test_deprecated_xla_use_bf16_warns(platform, monkeypatch):
    platform(CPU)
    monkeypatch.setenv("XLA_USE_BF16", "1")
    with pytest.warns(UserWarning, match="XLA_USE_BF16='1' is set: it is deprecated"):
        NeuronPrecision("bf16-mixed")


def test_environment_is_reapplied_on_connect_after_teardown(platform):
    platform(NEURON)
    plugin = NeuronPrecision("bf16-mixed")
    plugin.teardown()
    assert CC_FLAGS not in os.environ
    plugin.connect(nn.Linear(1, 1), [], [])  # a second run (e.g. trainer.test after fit) on the same plugin
    assert os.environ[CC_FLAGS] == "--auto-cast=none"
    plugin.teardown()
    assert CC_FLAGS not in os.environ


def test_bf16_mixed_attention_casts_its_inputs_as_the_cpu_autocast_does():
    """Under `bf16-mixed`, `scaled_dot_product_attention` takes query and key in fp32 (a rotary embedding's output)
    beside a bf16 value (a projection's), as CPU and CUDA autocast do: all cast to bf16. torch_xla has no autocast
    kernel for it, so it failed on the dtype mix, and with all-fp32 inputs attention ran in fp32."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=generator) for _ in range(3))
    device = get_runtime().device()
    plugin = NeuronPrecision("bf16-mixed")
    for value in (v.bfloat16(), v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = F.scaled_dot_product_attention(q, k, value, is_causal=True)
        with plugin.forward_context():
            out = F.scaled_dot_product_attention(q.to(device), k.to(device), value.to(device), is_causal=True)
        assert out.dtype == expected.dtype == torch.bfloat16
        # both in bf16 from the same bf16-rounded inputs, the output rounded to bf16: a few bf16 roundings (eps 7.8e-3)
        # of values of order 1, which 8e-3 + 1e-2 x |out| covers
        torch.testing.assert_close(out.cpu(), expected, atol=8e-3, rtol=1e-2)
