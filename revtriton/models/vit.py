"""RevViT: a Vision Transformer whose blocks form one reversible stack.

Same layers and parameter count as timm's ``VisionTransformer`` of equal width and depth
(patch embedding, cls token, learned positions, pre-norm blocks with LayerNorm eps 1e-6, exact
GELU MLP, final norm, linear head); the blocks are reversible couplings
(F = LayerNorm + attention, G = LayerNorm + MLP) instead of sequential residual blocks.
"""
from __future__ import annotations

import torch
from torch import nn

from ..engine import ReversibleBlock
from ..halves import LayerNormAttention, LayerNormMLP
from .common import check_positive, drop_path_schedule, init_transformer_weights, make_stack, stack_options

# name: (embed dim, depth, heads); patch 16, MLP ratio 4, as timm's vit_*_patch16_224.
VIT_PRESETS = {
    "tiny": dict(dim=192, depth=12, heads=3),
    "small": dict(dim=384, depth=12, heads=6),
    "base": dict(dim=768, depth=12, heads=12),
    "large": dict(dim=1024, depth=24, heads=16),
}


class RevViT(nn.Module):
    """Reversible Vision Transformer.

    Args:
        img_size, patch_size, in_chans, num_classes: as in timm.
        dim, depth, heads, mlp_ratio, qkv_bias: transformer width, blocks, heads.
        pool: ``"token"`` (cls token, timm's default) or ``"mean"`` (no cls token, mean of the
            patch tokens followed by the final norm, like timm's ``global_pool="avg"``).
        drop_rate: dropout after the position embedding and before the head.
        drop_path_rate: stochastic depth, increasing linearly over the blocks.
        layer_scale: initial value of per-channel layer scale on both halves (None: off).
        reversible: False builds the stored-activation twin (same weights and function).
        exact, frac_bits, anchor_every, schedule: ReversibleStack options.
    """

    def __init__(self, *, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 1000,
                 dim: int = 768, depth: int = 12, heads: int = 12, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 pool: str = "token", drop_rate: float = 0.0, drop_path_rate: float = 0.0,
                 layer_scale: float | None = None, eps: float = 1e-6, reversible: bool = True, **stack_kwargs):
        super().__init__()
        options = stack_options(stack_kwargs)
        if stack_kwargs:
            raise TypeError(f"RevViT got unexpected arguments {sorted(stack_kwargs)}")
        for name, value in (("img_size", img_size), ("patch_size", patch_size), ("in_chans", in_chans),
                            ("num_classes", num_classes), ("dim", dim), ("depth", depth), ("heads", heads)):
            check_positive(name, value)
        if img_size % patch_size:
            raise ValueError(f"patch_size ({patch_size}) must divide img_size ({img_size})")
        if pool not in ("token", "mean"):
            raise ValueError(f"pool must be 'token' or 'mean', got {pool!r}")
        self.img_size, self.patch_size, self.pool, self.dim = img_size, patch_size, pool, dim
        self.num_patches = (img_size // patch_size) ** 2
        self.num_prefix_tokens = 1 if pool == "token" else 0

        self.patch_embed = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if pool == "token" else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches + self.num_prefix_tokens, dim))
        self.pos_drop = nn.Dropout(drop_rate)
        hidden = int(dim * mlp_ratio)
        blocks = [
            ReversibleBlock(
                LayerNormAttention(dim, heads, qkv_bias=qkv_bias, eps=eps, drop_path=rate, layer_scale=layer_scale),
                LayerNormMLP(dim, hidden, activation="gelu", eps=eps, drop_path=rate, layer_scale=layer_scale),
            )
            for rate in drop_path_schedule(drop_path_rate, depth)
        ]
        self.blocks = make_stack(blocks, reversible=reversible, **options)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(dim, num_classes)
        self._init_weights()

    def _init_weights(self):
        init_transformer_weights(self)
        nn.init.trunc_normal_(self.pos_embed, std=0.02, a=-0.04, b=0.04)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        fan_in = self.patch_embed.in_channels * self.patch_size**2
        nn.init.trunc_normal_(self.patch_embed.weight, std=(1.0 / fan_in) ** 0.5)
        nn.init.zeros_(self.patch_embed.bias)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> tokens after the blocks (and the final norm for cls pooling): [B, N, dim]."""
        if images.dim() != 4:
            raise ValueError(f"RevViT takes [batch, channels, height, width] images, got shape {tuple(images.shape)}")
        if images.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"RevViT was built for {self.img_size}x{self.img_size} images, got "
                             f"{tuple(images.shape[-2:])}")
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        x = self.blocks(x)
        return self.norm(x) if self.pool == "token" else x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(images)
        x = x[:, 0] if self.pool == "token" else self.norm(x.mean(dim=1))
        return self.head(self.head_drop(x))


def rev_vit(preset: str, **kwargs) -> RevViT:
    """A RevViT preset ("tiny", "small", "base", "large"; patch 16) with overrides."""
    if preset not in VIT_PRESETS:
        raise ValueError(f"unknown RevViT preset {preset!r}; choose from {sorted(VIT_PRESETS)}")
    return RevViT(**{**VIT_PRESETS[preset], **kwargs})


def rev_vit_tiny(**kwargs) -> RevViT:
    return rev_vit("tiny", **kwargs)


def rev_vit_small(**kwargs) -> RevViT:
    return rev_vit("small", **kwargs)


def rev_vit_base(**kwargs) -> RevViT:
    return rev_vit("base", **kwargs)


def rev_vit_large(**kwargs) -> RevViT:
    return rev_vit("large", **kwargs)
