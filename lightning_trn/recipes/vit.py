"""ViT recipe: a Vision Transformer with timm's weights layout and a linear patch embedding, trained from scratch
on MNIST.

`python -m recipes.vit --help`; `python -m recipes.vit export ckpt=... out=...` writes the conv-based timm form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file
from typing_extensions import override

from lightning_trn.recipes.classifier import Batch, ClassifierModule
from lightning_trn.recipes.cli import main
from lightning_trn.recipes.common import NON_NEGATIVE, POSITIVE, Recipe, RecipeConfig, doc
from lightning_trn.recipes.mnist import MnistData, mnist_datamodule
from lightning_trn.recipes.patch_embed import to_conv_state_dict
from lightning_trn.recipes.vit_network import VisionTransformer

#: the module's hyperparameters that are VisionTransformer arguments (the rest configure the optimizer)
ARCHITECTURE = ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio")


class MnistViT(ClassifierModule):
    """`recipes.vit_network.VisionTransformer` (timm's ViT with `LinearPatchEmbed`) trained with AdamW."""

    def __init__(
        self,
        img_size: int = 28,
        patch_size: int = 7,
        in_chans: int = 1,
        num_classes: int = 10,
        embed_dim: int = 64,
        depth: int = 4,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = VisionTransformer(**self.architecture())

    def architecture(self) -> dict[str, Any]:
        """Keyword arguments that rebuild the same network as a standard (conv patch embedding) timm ViT."""
        return {name: self.hparams[name] for name in ARCHITECTURE}

    @override
    def logits(self, batch: Batch) -> torch.Tensor:
        size, chans = self.hparams["img_size"], self.hparams["in_chans"]
        return self.net(batch["x"].reshape(-1, chans, size, size))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=self.hparams["weight_decay"])


@dataclass
class VitModel:
    """`model.*` of `configs/vit.yaml`: `MnistViT`'s arguments (`classes` is `num_classes`)."""

    img_size: int = doc("height and width of the (square) images, in pixels")
    patch_size: int = doc("height and width of a patch, in pixels; img_size is a multiple of it")
    in_chans: int = doc("image channels: 1 for MNIST, 3 for CIFAR-10")
    classes: int = doc("number of classes: the head's outputs")
    embed_dim: int = doc("token width; a multiple of num_heads")
    depth: int = doc("number of transformer blocks")
    num_heads: int = doc("attention heads per block")
    mlp_ratio: float = doc("width of each block's MLP, as a multiple of embed_dim")
    lr: float = doc("AdamW learning rate", POSITIVE)
    weight_decay: float = doc("AdamW weight decay", NON_NEGATIVE)


@dataclass
class VitConfig(RecipeConfig):
    """Schema of `configs/vit.yaml`."""

    data: MnistData = doc("the images: source, splits and batches")
    model: VitModel = doc("the Vision Transformer and its optimizer")


def build_model(cfg: DictConfig) -> MnistViT:
    model = cast(dict[str, Any], OmegaConf.to_container(cfg.model))  # a mapping section
    model["num_classes"] = model.pop("classes")
    return MnistViT(**model)


def export(module: MnistViT, out_dir: Path) -> None:
    """`model.safetensors` for `timm.models.vision_transformer.VisionTransformer(**config.json)` (conv patch
    embedding, no lightning_trn needed) and `config.json` holding those keyword arguments."""
    arch = module.architecture()
    state = to_conv_state_dict(module.net.state_dict(), arch["in_chans"], arch["patch_size"])
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(arch, indent=2))


RECIPE = Recipe("vit", MnistViT, mnist_datamodule, build_model, export, VitConfig)

if __name__ == "__main__":
    main(RECIPE)
