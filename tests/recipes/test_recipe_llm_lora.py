"""LoRA fine-tuning in the LLM recipe (`model.pretrained=DIR model.lora.r=...`, `recipes/llm/lora.py`) on one
device of the running backend: only the adapters get gradients, move and sit in the optimizer, the base weights stay
bitwise the folder's; checkpoints hold the adapters and resume; the merged export gives the trained model's logits
in plain transformers; LoRA with tensor parallelism, or without a pretrained folder, is refused. Data parallel and
ZeRO-1 on two XLA devices end like one device (here); FSDP2 and DDP on two stand-in devices in
tests/recipes/test_recipe_llm_lora_sharded.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from safetensors.torch import load_file

from lightning_trn.recipes import cli, common, llm
from lightning_trn.recipes.llm import lora
from tests.launch import child_env
from tests.recipe_runs import left_behind, run
from tests.recipes.test_recipe_llm_pretrained import STEP, Folder, save_folder

pytestmark = pytest.mark.both

#: rank 4 on the attention's query and value projections; no dropout, so every run draws alike
LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.target=[q_proj,v_proj]", "model.lora.dropout=0.0")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("pretrained"))


def _overrides(folder: Folder, out_dir: Path, *more: str) -> list[str]:
    return [
        f"model.pretrained={folder.path}",
        f"data.source={folder.rows}",
        f"out_dir={out_dir}",
        *STEP,
        *LORA,
        "model.lr=1.0e-2",
        *more,
    ]


def _base_name(name: str) -> str:
    """The folder's name of a LoRA model's base tensor."""
    return name.replace("base_layer.", "")


class _Probe(Callback):
    """The names of the parameters holding a gradient, and of those whose gradient is not all zero, before each
    optimizer step (read on the host); at the end of training (before the Trainer moves the module back to the CPU,
    which makes new parameters), whether the optimizer holds exactly the adapters, and its state's shapes."""

    def __init__(self) -> None:
        self.steps: list[tuple[set[str], set[str]]] = []
        self.optimizer_holds_the_adapters = False
        self.state_shapes: list[tuple[torch.Size, torch.Size]] = []

    def on_before_optimizer_step(
        self, trainer: Trainer, module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = {name: p.grad.detach().cpu() for name, p in module.net.named_parameters() if p.grad is not None}
        self.steps.append((set(grads), {name for name, grad in grads.items() if grad.abs().sum() > 0}))

    def on_train_end(self, trainer: Trainer, module: LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        held = [p for group in optimizer.param_groups for p in group["params"]]
        self.optimizer_holds_the_adapters = sorted(map(id, held)) == sorted(map(id, lora.adapter_parameters(module)))
        self.state_shapes = [(state["exp_avg"].shape, p.shape) for p, state in optimizer.state.items()]


def test_only_the_adapters_train_and_sit_in_the_optimizer(folder: Folder, tmp_path: Path) -> None:
    cfg = cli.load_config(
        llm.RECIPE, _overrides(folder, tmp_path / "run", "trainer.max_steps=2", "trainer.limit_val_batches=0")
    )
    module = llm.RECIPE.build_model(cfg)
    probe = _Probe()
    trainer = common.build_trainer(cfg, llm.RECIPE)
    trainer.callbacks.append(probe)
    trainer.fit(module, datamodule=llm.RECIPE.build_data(cfg))

    adapters = {name for name, _ in module.net.named_parameters() if ".lora_A." in name or ".lora_B." in name}
    assert len(adapters) == 2 * 2 * 2  # (A, B) x (q_proj, v_proj) x 2 layers
    assert {name for name, p in module.net.named_parameters() if p.requires_grad} == adapters
    assert len(probe.steps) == 2
    for held, _ in probe.steps:
        assert held == adapters
    # lora_B starts at zero, so the first step moves only it (lora_A's gradient is B's transpose times ...); the second
    # has every adapter's gradient non-zero
    assert probe.steps[0][1] == {name for name in adapters if ".lora_B." in name}
    assert probe.steps[1][1] == adapters

    original = load_file(folder.path / "model.safetensors")
    for name, p in module.net.named_parameters():
        if name in adapters:
            continue
        assert torch.equal(p.detach().cpu(), original[_base_name(name)]), name
    assert all(module.net.get_parameter(name).detach().abs().sum() > 0 for name in adapters if ".lora_B." in name)

    assert probe.optimizer_holds_the_adapters
    assert len(probe.state_shapes) == len(adapters)
    assert all(state == param for state, param in probe.state_shapes)


class _Stop(Exception):
    pass


class _StopAtStep(Callback):
    """Raises `_Stop` when the step `step` is about to start: the job dies as if killed, after the checkpoints of the
    steps before it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise _Stop


def _fit(cfg: Any, *callbacks: Callback) -> Path:
    """The recipe's training (`common.fit` without its test) with `callbacks` added; returns `last.ckpt`."""
    pl.seed_everything(cfg.seed, workers=True)
    data, module = llm.RECIPE.build_data(cfg), llm.RECIPE.build_model(cfg)
    trainer = common.build_trainer(cfg, llm.RECIPE)
    trainer.callbacks.extend(callbacks)
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    return Path(cfg.out_dir) / "checkpoints" / "last.ckpt"


def test_checkpoint_resume_and_merged_export(folder: Folder, tmp_path: Path) -> None:
    """4 steps in one job, and a job stopped after its step-2 checkpoint (mid-epoch) and resumed from it, end with the
    same adapters; the checkpoint holds them and loads back without the folder's help; the export (adapters merged)
    gives the trained model's logits in plain transformers, which generates from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def config(out: str, *more: str) -> Any:
        return cli.load_config(
            llm.RECIPE,
            _overrides(
                folder,
                tmp_path / out,
                "trainer.limit_train_batches=4",
                "trainer.limit_val_batches=0",
                "ckpt_every_n_steps=2",
                *more,
            ),
        )

    whole = _fit(config("whole"))
    with pytest.raises(_Stop):
        _fit(config("parts"), _StopAtStep(2))
    stopped = torch.load(tmp_path / "parts" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (stopped["epoch"], stopped["global_step"]) == (0, 2)
    resumed = _fit(config("parts", f"ckpt_path={tmp_path / 'parts' / 'checkpoints' / 'last.ckpt'}"))
    expected = torch.load(whole, weights_only=True)["state_dict"]
    state = torch.load(resumed, weights_only=True)["state_dict"]
    saved_adapters = [name for name in state if ".lora_A." in name or ".lora_B." in name]
    assert len(saved_adapters) == 8
    assert all(not torch.equal(stopped["state_dict"][name], expected[name]) for name in saved_adapters)
    # a resume replays the same steps with the same kernels: exact on the stand-in; on XLA the resumed job compiles
    # its graphs again, which may fuse differently (not derived: no float64 twin of an XLA job yet)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)

    out = tmp_path / "export"
    cli.main(llm.RECIPE, ["export", f"ckpt={whole}", f"out={out}"])
    assert not any("lora" in key or "base_layer" in key for key in load_file(out / "model.safetensors"))
    trained = common.load_module(llm.RECIPE, str(whole)).eval()  # unmerged: adapters beside the weights
    for name in saved_adapters:
        assert torch.equal(trained.get_parameter(name).detach(), expected[name].cpu()), name
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(folder.path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Review 3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = trained(prompt["input_ids"])
        # one float32 forward, W + s x B x A merged against W x + s x B x (A x): a few ulps (eps 1.2e-7) of the
        # RMS-normed activations (~1) per layer, ~1e-6 at the logits (~0.1 at init std 0.02), under 1e-5
        torch.testing.assert_close(exported(**prompt).logits, logits, rtol=1e-5, atol=1e-5)
        assert (original(**prompt).logits - logits).abs().max() > 1e-3  # the adapters changed the model
    generated = exported.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 4)


def test_lora_with_tensor_parallelism_or_without_a_folder_is_refused(folder: Folder, tmp_path: Path) -> None:
    cfg = cli.load_config(
        llm.RECIPE,
        _overrides(
            folder, tmp_path, "trainer.strategy=model_parallel", "trainer.devices=2", "model.tensor_parallel_size=2"
        ),
    )
    with pytest.raises(ValueError, match="LoRA is not supported with tensor parallelism"):
        llm.RECIPE.build_model(cfg)
    cfg = cli.load_config(llm.RECIPE, [*LORA, f"out_dir={tmp_path}"])
    with pytest.raises(ValueError, match="needs model.pretrained=DIR"):
        llm.RECIPE.build_model(cfg)


@pytest.mark.xla_only
@pytest.mark.slow
def test_lora_under_zero1_on_two_devices_ends_like_one_device(folder: Folder, tmp_path: Path) -> None:
    """Every rank takes the recipe's own seeded shuffle (no distributed sampler), as one device does: the same global
    batches, so the gradients averaged over the ranks are one device's; ZeRO-1 keeps (and checkpoints) the adapters'
    state only. ZeRO-1 is the DDP strategy with the optimizer state sharded; plain DDP with LoRA runs on the stand-in
    (tests/recipes/test_recipe_llm_lora_sharded.py), which keeps this slow XLA:CPU test to one 2-process run; the
    one-device job runs in this process (`cli.main`, what `python -m recipes.llm` runs), whose earlier tests compiled
    its graphs."""
    common_args = [
        f"model.pretrained={folder.path}",
        f"data.source={folder.rows}",
        *STEP,
        *LORA,
        "model.lr=1.0e-2",
        "trainer.max_steps=3",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
    ]
    metrics = ("train_loss", "val_loss")
    cli.main(llm.RECIPE, [*common_args, f"out_dir={tmp_path / 'one'}"])
    one = left_behind(tmp_path / "one", metrics)
    adapters = [name for name in one["ckpt"]["state_dict"] if ".lora_A." in name or ".lora_B." in name]
    assert len(set(one["metrics"]["train_loss"])) == 3
    strategy = "neuron_zero1"
    two = run(
        "llm",
        tmp_path / strategy,
        *common_args,
        f"trainer.strategy={strategy}",
        "trainer.devices=2",
        "trainer.use_distributed_sampler=false",
        env=child_env(),
        metrics=metrics,
    )
    # not yet derived from the computation: a float64 twin of the one-device run draws LoRA's adapters in float64,
    # other values than the float32 run's (tests/recipes/test_recipe_llm_lora_sharded.py says the same)
    assert two["metrics"]["train_loss"] == pytest.approx(one["metrics"]["train_loss"], rel=1e-5, abs=1e-6)
    assert two["metrics"]["val_loss"] == pytest.approx(one["metrics"]["val_loss"], rel=1e-5, abs=1e-6)
    for name, value in one["ckpt"]["state_dict"].items():
        torch.testing.assert_close(two["ckpt"]["state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    states = two["ckpt"]["optimizer_states"][0]["state"]
    assert len(states) == len(adapters), strategy
