"""A Vision Transformer in plain PyTorch whose state dict is timm's `VisionTransformer`'s (class token, learned
position embedding, pre-norm blocks, token pooling) with the patch embedding of `LinearPatchEmbed`.

Why not timm itself: timm imports torchvision, and PyPI has no CPU torchvision for torch 2.13 (the native stack),
so the recipe would not run there. The same weights load into `timm.models.vision_transformer.VisionTransformer`
after `to_conv_state_dict` (tests/recipes/test_recipes_unit.py checks the logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_trn.recipes.patch_embed import LinearPatchEmbed

#: timm's LayerNorm epsilon for ViTs
_EPS = 1e-6


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection (timm's `Attention`, no masks)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not a multiple of num_heads {num_heads}.")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(batch, tokens, dim))


class Mlp(nn.Module):
    """fc1 -> GELU -> fc2 (timm's `Mlp`)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block (timm's `Block` without layer scale, drop path or dropout)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_EPS)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """timm's `VisionTransformer(img_size, patch_size, in_chans, num_classes, embed_dim, depth, num_heads,
    mlp_ratio)` with default options otherwise, initialized as timm does (truncated normal 0.02 for the Linear
    weights and position embedding, zero biases, 1e-6 normal class token)."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
    ) -> None:
        super().__init__()
        self.patch_embed = LinearPatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.blocks = nn.Sequential(*(Block(embed_dim, num_heads, mlp_ratio) for _ in range(depth)))
        self.norm = nn.LayerNorm(embed_dim, eps=_EPS)
        self.head = nn.Linear(embed_dim, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])
