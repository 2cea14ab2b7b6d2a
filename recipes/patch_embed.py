"""`LinearPatchEmbed`: timm's ViT patch embedding as reshape + `nn.Linear` instead of a strided convolution.

A convolution whose kernel and stride equal the patch size is a matrix product over non-overlapping patches; written
as a reshape and a Linear it lowers to one plain matmul, which the Neuron compiler handles better than a convolution.
The weights map one to one: conv `(D, C, p, p)` <-> linear `(D, C*p*p)` (same `C, p, p` order), so a checkpoint
converts to the standard conv-based timm ViT with a reshape (`to_conv_state_dict` / `to_linear_state_dict`).
"""

from __future__ import annotations

from typing import Any

import torch
from timm.layers import PatchEmbed
from torch import nn

#: state-dict key of the patch projection weight in timm's VisionTransformer
PATCH_WEIGHT = "patch_embed.proj.weight"


class LinearPatchEmbed(PatchEmbed):
    """Drop-in for `timm.layers.PatchEmbed` (pass as `VisionTransformer(embed_layer=LinearPatchEmbed)`).

    Only fixed-size images and the default flattened `(B, patches, D)` output are supported: static shapes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.flatten or self.dynamic_img_pad or not self.strict_img_size:
            raise ValueError("LinearPatchEmbed supports fixed image sizes with flattened output only.")
        conv = self.proj
        self.proj = nn.Linear(
            conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1],
            conv.out_channels,
            bias=conv.bias is not None,
            device=conv.weight.device,
            dtype=conv.weight.dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        if (height, width) != tuple(self.img_size):
            raise ValueError(f"Input size {(height, width)} does not match the model's img_size {self.img_size}.")
        (grid_h, grid_w), (patch_h, patch_w) = self.grid_size, self.patch_size
        patches = x.reshape(batch, channels, grid_h, patch_h, grid_w, patch_w)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(batch, grid_h * grid_w, channels * patch_h * patch_w)
        return self.norm(self.proj(patches))


def to_conv_state_dict(
    state_dict: dict[str, torch.Tensor], in_chans: int, patch_size: int, key: str = PATCH_WEIGHT
) -> dict[str, torch.Tensor]:
    """A `LinearPatchEmbed` ViT state dict for the standard conv-based timm ViT (only the patch weight `key`
    changes; pass `key="proj.weight"` for a bare patch-embedding module)."""
    converted = dict(state_dict)
    weight = state_dict[key]
    converted[key] = weight.reshape(weight.shape[0], in_chans, patch_size, patch_size).contiguous()
    return converted


def to_linear_state_dict(state_dict: dict[str, torch.Tensor], key: str = PATCH_WEIGHT) -> dict[str, torch.Tensor]:
    """A conv-based timm ViT state dict for the `LinearPatchEmbed` form (e.g. to fine-tune a timm ViT here)."""
    converted = dict(state_dict)
    converted[key] = state_dict[key].flatten(1).contiguous()
    return converted
