"""Fast tests of the recipe building blocks: patch embedding, padding, metric, BERT attention mask, config CLI,
offline data."""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch
from omegaconf import OmegaConf
from timm.layers import PatchEmbed
from timm.models.vision_transformer import VisionTransformer

from lightning_trn.recipes import cli
from lightning_trn.recipes.classifier import ClassifierModule
from lightning_trn.recipes.common import RecipeConfig
from lightning_trn.recipes.metrics import MaskedAccuracy
from lightning_trn.recipes.mlp import RECIPE as MLP
from lightning_trn.recipes.mlp import MlpConfig
from lightning_trn.recipes.mnist import MnistData
from lightning_trn.recipes.patch_embed import LinearPatchEmbed, to_conv_state_dict, to_linear_state_dict
from lightning_trn.recipes.tensor_datamodule import TensorDataModule, pad_to_multiple, shuffled_split
from lightning_trn.recipes.vit import MnistViT

pytestmark = pytest.mark.xla_only


def test_linear_patch_embed_equals_conv_on_same_weights():
    torch.manual_seed(0)
    conv = PatchEmbed(img_size=28, patch_size=7, in_chans=3, embed_dim=16)
    linear = LinearPatchEmbed(img_size=28, patch_size=7, in_chans=3, embed_dim=16)
    linear.load_state_dict(to_linear_state_dict(conv.state_dict(), key="proj.weight"))
    x = torch.randn(5, 3, 28, 28)
    # 147-term dot products (3 x 7 x 7 patches) in another summation order: a few float32 ulps of the sum of their
    # terms' sizes (147 x mean |x| 0.8 x mean |w| 0.04 ~ 5), ~1e-6, under 1e-5
    torch.testing.assert_close(linear(x), conv(x), rtol=1e-5, atol=1e-5)


def test_patch_weight_conversion_round_trips():
    state = MnistViT(embed_dim=16, depth=1, num_heads=2).net.state_dict()
    back = to_linear_state_dict(to_conv_state_dict(state, in_chans=1, patch_size=7))
    assert to_conv_state_dict(state, 1, 7)["patch_embed.proj.weight"].shape == (16, 1, 7, 7)
    assert back.keys() == state.keys()
    for key in state:
        assert torch.equal(back[key], state[key]), key


def test_recipe_vit_loads_into_standard_timm_vit_with_same_logits():
    torch.manual_seed(0)
    module = MnistViT(embed_dim=16, depth=2, num_heads=2).eval()
    with torch.no_grad():  # every parameter distinct (fresh LayerNorms are all alike)
        for parameter in module.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    reference = VisionTransformer(**module.architecture()).eval()  # conv patch embedding
    reference.load_state_dict(to_conv_state_dict(module.net.state_dict(), 1, 7))
    x = torch.randn(4, 784)
    # one float32 forward, a conv patch embedding against a linear one (another summation order), then 2 blocks on
    # LayerNorm-scaled (~1) activations: a few ulps (eps 1.2e-7) per op, ~1e-6 at the logits, under 1e-5
    torch.testing.assert_close(reference(x.reshape(4, 1, 28, 28)), module.logits({"x": x}), rtol=1e-5, atol=1e-5)


def test_pad_to_multiple_masks_padding_rows():
    padded = pad_to_multiple({"x": torch.arange(10.0).view(5, 2), "y": torch.arange(5)}, 4)
    assert padded["x"].shape == (8, 2) and padded["y"].shape == (8,)
    assert padded["weight"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert torch.equal(padded["x"][:5], torch.arange(10.0).view(5, 2))


def test_every_batch_is_full_size_and_no_row_is_dropped_or_doubled():
    rows = {"x": torch.arange(70.0).view(35, 2), "y": torch.arange(35)}
    data = TensorDataModule(rows, rows, rows, batch_size=8, seed=0)
    for loader in (data.train_dataloader(), data.test_dataloader()):
        batches = list(loader)
        assert [len(b["y"]) for b in batches] == [8] * 5
        real = torch.cat([b["y"][b["weight"] == 1] for b in batches])
        assert sorted(real.tolist()) == list(range(35))


def test_shuffled_split_mixes_sorted_classes_and_is_disjoint():
    sorted_rows = {"i": torch.arange(100), "y": torch.arange(100) // 10}
    train, val, test = shuffled_split(sorted_rows, (0.1, 0.2), seed=1)
    assert (len(train["i"]), len(val["i"]), len(test["i"])) == (70, 10, 20)
    assert sorted(torch.cat([train["i"], val["i"], test["i"]]).tolist()) == list(range(100))
    assert len(test["y"].unique()) > 3  # not one block of the sorted classes
    assert torch.equal(shuffled_split(sorted_rows, (0.1, 0.2), seed=1)[2]["i"], test["i"])


def test_masked_accuracy_ignores_zero_weight_rows():
    metric = MaskedAccuracy()
    metric.update(torch.tensor([1, 1, 0, 0]), torch.tensor([1, 0, 1, 1]), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    metric.update(torch.tensor([2]), torch.tensor([2]), torch.tensor([1.0]))
    assert metric.compute().item() == pytest.approx(2 / 3)  # float32 2/3: 3e-8 off, within approx's rel 1e-6


class _Fixed(ClassifierModule):
    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.fixed = logits

    def logits(self, batch):
        return self.fixed


def test_loss_ignores_padding_rows():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, -5.0]])
    target = torch.tensor([0, 0, 1])
    module = _Fixed(logits)
    module.log = lambda *args, **kwargs: None
    loss = module._step({"y": target, "weight": torch.tensor([1.0, 1.0, 0.0])}, "val")
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits[:2], target[:2]))


def test_config_overrides_and_unknown_keys():
    cfg = cli.load_config(MLP, ["data.batch_size=64", "model.hidden=[16]", "trainer.fast_dev_run=true"])
    assert cfg.data.batch_size == 64 and list(cfg.model.hidden) == [16] and cfg.trainer.fast_dev_run is True
    assert cfg.model.lr == 0.01 and cfg.trainer.accelerator == "neuron"
    with pytest.raises(KeyError, match="data.batchsize"):
        cli.load_config(MLP, ["data.batchsize=64"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.batch_size=abc", "data.batch_size='abc': expected an integer (default 32)"),
        ("data.batch_size=0", "data.batch_size=0: expected a value greater than 0"),
        ("data.batch_size=2.5", "data.batch_size=2.5: expected an integer"),
        ("model.lr=fast", "model.lr='fast': expected a number (default 0.01)"),
        ("model.lr=-1", "model.lr=-1: expected a value greater than 0"),
        ("data.val_fraction=1.5", "data.val_fraction=1.5: expected a value in [0, 1)"),
        ("model.hidden=[16,x]", "model.hidden=[16, 'x']: expected a list like [1, 2]"),
        ("out_dir=[1]", "out_dir=[1]: expected a string"),
        # omegaconf's typed merge, translated to one line
        ("model.hidden=[1.5]", "model.hidden=[1.5]: expected a list like [1, 2] (default [120, 84])."),
        ("model.hidden=16", "model.hidden=16: expected a list like [1, 2] (default [120, 84])."),
        ("ops.throughput=maybe", "ops.throughput='maybe': expected true or false (default False)."),
        ("seed=true", "seed=True: expected an integer (default 42)."),
        ("ckpt_path=[a]", "ckpt_path=['a']: expected a string or null (default None)."),
        ("model.lr=inf", "model.lr='inf': expected a number (default 0.01)."),
    ],
)
def test_wrong_value_types_name_key_value_and_expectation(override, expected):
    with pytest.raises(ValueError, match=re.escape(f"recipes.mlp: Config key {expected}")):
        cli.load_config(MLP, [override])
    with pytest.raises(SystemExit, match=re.escape(expected)):  # the command line: that one line, no traceback
        cli.main(MLP, [override])


def test_numbers_are_accepted_in_any_spelling():
    cfg = cli.load_config(MLP, ["model.lr=1e-3", "model.momentum=0", "data.val_fraction=0"])
    assert (cfg.model.lr, cfg.model.momentum, cfg.data.val_fraction) == (1e-3, 0, 0)


@pytest.mark.parametrize("override", ["data.batchsize=64", "ops.profiler=true", "model.widths=[8]", "preset=x"])
def test_an_unknown_key_names_it_in_one_line(override):
    key = override.split("=")[0]
    with pytest.raises(KeyError, match=re.escape(f"Unknown config key {key!r} for recipe 'mlp'; known keys: seed,")):
        cli.load_config(MLP, [override])
    with pytest.raises(SystemExit) as stop:
        cli.main(MLP, [override])
    assert str(stop.value).startswith(f"Unknown config key {key!r}") and "\n" not in str(stop.value)


def test_the_config_is_typed_by_the_recipes_schema():
    cfg = cli.load_config(MLP, ["model.lr=1", "data.source=5", "model.hidden=[8,'4']", "trainer.new_arg=[1, 2]"])
    assert OmegaConf.get_type(cfg) is MlpConfig and OmegaConf.get_type(cfg.data) is MnistData
    assert type(cfg.model.lr) is float and cfg.data.source == "5" and list(cfg.model.hidden) == [8, 4]
    assert list(cfg.trainer.new_arg) == [1, 2]  # trainer.* is open: any key, any value


@pytest.mark.parametrize("name", ["mlp", "vit", "bert", "llm"])
def test_every_yaml_default_fits_its_recipes_schema(name):
    recipe = importlib.import_module(f"lightning_trn.recipes.{name}").RECIPE
    assert OmegaConf.get_type(cli.load_config(recipe)) is recipe.schema  # types, key sets and ranges agree


def test_the_yaml_and_the_schema_must_have_the_same_keys():
    @dataclasses.dataclass
    class Wider(MlpConfig):
        extra: int

    with pytest.raises(TypeError, match=r"mlp.yaml does not match .*RecipeConfig: Key 'data' not in 'RecipeConfig'"):
        cli.load_config(dataclasses.replace(MLP, schema=RecipeConfig))
    with pytest.raises(TypeError, match=r"mlp.yaml does not match .*Wider: no default for extra"):
        cli.load_config(dataclasses.replace(MLP, schema=Wider))


def test_a_recipe_with_presets_applies_them_before_the_command_line():
    @dataclasses.dataclass
    class WithPreset(MlpConfig):
        preset: str = "none"

    recipe = dataclasses.replace(MLP, schema=WithPreset, presets={"wide": ("model.hidden=[256]", "data.batch_size=64")})
    cfg = cli.load_config(recipe, ["data.batch_size=16", "preset=wide"])
    assert (cfg.preset, list(cfg.model.hidden), cfg.data.batch_size) == ("wide", [256], 16)
    assert list(cli.load_config(recipe, ["preset=none"]).model.hidden) == [120, 84]
    with pytest.raises(ValueError, match=re.escape("Config key preset='tall': expected one of none, wide.")):
        cli.load_config(recipe, ["preset=tall"])


def test_help_lists_every_key_with_its_default_and_type(capsys):
    cli.main(MLP, ["--help"])
    out = capsys.readouterr().out
    for key in ("trainer.precision=32-true", "data.batch_size=32", "model.lr=0.01", "export ckpt=PATH out=DIR"):
        assert key in out
    assert re.search(r"\n  data\.batch_size=32 +an integer, greater than 0\n", out)
    assert re.search(r"\n  model\.hidden=\[120, 84\] +a list like \[1, 2\]\n", out)
    assert "\n  trainer.enable_progress_bar=true\n" in out  # Lightning's: no type here


def test_offline_data_sets():
    from lightning_trn.recipes.data_sources import load_mnist_5k, load_rotten_tomatoes

    mnist = load_mnist_5k()
    assert mnist["x"].shape == (5000, 784) and torch.bincount(mnist["y"]).tolist() == [500] * 10
    texts, labels = load_rotten_tomatoes()
    assert len(texts) == len(set(texts)) == len(labels) > 12000
    assert set(labels.tolist()) == {0, 1}


def _tiny_bert(attn_implementation: str):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        attn_implementation=attn_implementation,
    )
    return BertForSequenceClassification(config).eval()


def _padded_batch():
    input_ids = torch.randint(1, 50, (3, 12))
    attention_mask = torch.ones(3, 12, dtype=torch.long)
    attention_mask[0, 5:] = 0
    attention_mask[2, 9:] = 0
    return input_ids, attention_mask


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_bert_4d_attention_mask_gives_the_same_logits(attn_implementation):
    from lightning_trn.recipes.bert import encoder_attention_mask

    net = _tiny_bert(attn_implementation)
    input_ids, attention_mask = _padded_batch()
    with torch.no_grad():
        expected = net(input_ids=input_ids, attention_mask=attention_mask).logits
        mask = encoder_attention_mask(attention_mask, attn_implementation, net.dtype)
        actual = net(input_ids=input_ids, attention_mask=mask).logits
    assert mask.shape == (3, 1, 1, 12)
    torch.testing.assert_close(actual, expected)


def test_bert_4d_attention_mask_does_not_read_the_device():
    """transformers checks a 2-D padding mask with `.all()` on the host; the recipe's 4-D mask is never read."""
    import torch_xla

    from lightning_trn.recipes.bert import encoder_attention_mask
    from lightning_trn.runtime import get_runtime

    device = torch_xla.device()
    net = _tiny_bert("sdpa").to(device)
    input_ids, attention_mask = (t.to(device) for t in _padded_batch())
    torch_xla.sync()

    def reads(make_mask) -> int:
        before = get_runtime().metrics()
        net(input_ids=input_ids, attention_mask=make_mask()).logits.sum()
        delta = get_runtime().metrics() - before
        torch_xla.sync()
        return delta.device_to_host + delta.scalar_reads

    assert reads(lambda: attention_mask) > 0  # the stock 2-D path does read (what this test guards against)
    assert reads(lambda: encoder_attention_mask(attention_mask, "sdpa", net.dtype)) == 0
