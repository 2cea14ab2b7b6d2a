"""`LinearPatchEmbed`: timm's ViT patch embedding as reshape + `nn.Linear` instead of a strided convolution.

A convolution whose kernel and stride equal the patch size is a matrix product over non-overlapping patches; written
as a reshape and a Linear it lowers to one plain matmul, which the Neuron compiler handles better than a convolution.
The weights map one to one: conv `(D, C, p, p)` <-> linear `(D, C*p*p)` (same `C, p, p` order), so a checkpoint
converts to the standard conv-based timm ViT with a reshape (`to_conv_state_dict` / `to_linear_state_dict`).
"""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

#: state-dict key of the patch projection weight in timm's VisionTransformer
PATCH_WEIGHT = "patch_embed.proj.weight"


class LinearPatchEmbed(nn.Module):
    """timm's `PatchEmbed` (same arguments and state-dict keys) for fixed-size images and a flattened
    `(B, patches, D)` output: static shapes."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768) -> None:
        super().__init__()
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}.")
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Linear(in_chans * patch_size * patch_size, embed_dim)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        if (height, width) != self.img_size:
            raise ValueError(f"Input size {(height, width)} does not match the model's img_size {self.img_size}.")
        (grid_h, grid_w), (patch_h, patch_w) = self.grid_size, self.patch_size
        patches = x.reshape(batch, channels, grid_h, patch_h, grid_w, patch_w)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(batch, grid_h * grid_w, channels * patch_h * patch_w)
        return self.proj(patches)


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
