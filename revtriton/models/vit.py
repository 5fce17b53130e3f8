"""RevViT: a Vision Transformer whose blocks form one reversible stack.

Same layers and parameter count as timm's ``VisionTransformer`` of equal width and depth
(patch embedding, cls token, learned positions, pre-norm blocks with LayerNorm eps 1e-6, exact
GELU MLP, final norm, linear head); the blocks are reversible couplings
(F = LayerNorm + attention, G = LayerNorm + MLP) instead of sequential residual blocks.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from ..convert import CHECKPOINTING_MESSAGE
from ..engine import ReversibleBlock
from ..halves import LayerNormAttention, LayerNormMLP
from ..ops.arguments import checked_int
from .common import (check_positive, drop_path_schedule, init_transformer_weights, make_stack, stack_options,
                     trunc_normal_)

# name: (embed dim, depth, heads); patch 16, MLP ratio 4, as timm's vit_*_patch16_224.
VIT_PRESETS = {
    "tiny": dict(dim=192, depth=12, heads=3),
    "small": dict(dim=384, depth=12, heads=6),
    "base": dict(dim=768, depth=12, heads=12),
    "large": dict(dim=1024, depth=24, heads=16),
}

# Pooling names RevViT takes: its own (``pool``) and timm's (``global_pool``), to its own.
POOL_NAMES = {"token": "token", "mean": "mean", "avg": "mean"}

# What to use for what RevViT does not have (weights, per-block features): a revified timm ViT.
REVIFY_TIMM_ADVICE = ('revify a timm ViT instead, e.g. revtriton.revify(timm.create_model("vit_base_patch16_224", '
                      'pretrained=True), preserve="meft1"); revified timm ViTs support features_only and '
                      'forward_intermediates')


def pool_named(global_pool: str) -> str:
    """RevViT's pool (``"token"`` / ``"mean"``) of a pooling name, RevViT's or timm's (``"avg"``)."""
    if global_pool not in POOL_NAMES:
        raise ValueError(f"RevViT pools with the cls token ('token') or the mean of the tokens ('avg' or 'mean'), "
                         f"got global_pool={global_pool!r}")
    return POOL_NAMES[global_pool]


def check_num_classes(num_classes) -> int:
    return checked_int("num_classes", num_classes, 0, note=" (0: no head)")


class RevViT(nn.Module):
    """Reversible Vision Transformer, with timm's model API: ``forward_features``, ``forward_head``,
    ``reset_classifier``, ``get_classifier``, ``num_classes``, ``num_features``, ``global_pool``
    (``revtriton.models.timm_models`` registers the presets with ``timm.create_model``).

    Args:
        img_size, patch_size, in_chans: as in timm (square images of ``img_size`` only).
        num_classes: classes of the linear head; 0 gives no head (``forward`` returns the pooled
            features), as in timm.
        dim, depth, heads, mlp_ratio, qkv_bias: transformer width, blocks, heads.
        pool: ``"token"`` (cls token, timm's default) or ``"mean"`` (no cls token, mean of the
            patch tokens followed by the final norm, like timm's ``global_pool="avg"``).
        drop_rate: dropout after the position embedding and before the head.
        drop_path_rate: stochastic depth, increasing linearly over the blocks.
        layer_scale: initial value of per-channel layer scale on both halves (None: off).
        reversible: False builds the stored-activation twin (same weights and function).
        exact, frac_bits, anchor_every, schedule, token_chunk: ReversibleStack options.
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
                            ("dim", dim), ("depth", depth), ("heads", heads)):
            check_positive(name, value)
        check_num_classes(num_classes)
        if img_size % patch_size:
            raise ValueError(f"patch_size ({patch_size}) must divide img_size ({img_size})")
        if pool not in ("token", "mean"):
            raise ValueError(f"pool must be 'token' or 'mean', got {pool!r}")
        self.img_size, self.patch_size, self.in_chans, self.pool, self.dim = img_size, patch_size, in_chans, pool, dim
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = dim  # timm's names for the width the head takes
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
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self):
        init_transformer_weights(self)
        trunc_normal_(self.pos_embed, std=0.02, a=-0.04, b=0.04)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        fan_in = self.patch_embed.in_channels * self.patch_size**2
        trunc_normal_(self.patch_embed.weight, std=(1.0 / fan_in) ** 0.5, a=-2.0, b=2.0)
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

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens from ``forward_features`` -> logits [B, num_classes]: the cls token (pool "token")
        or the mean of the tokens then the final norm (pool "mean"), head dropout, the head.
        ``pre_logits=True`` returns the pooled features before the head: [B, dim]."""
        x = x[:, 0] if self.pool == "token" else self.norm(x.mean(dim=1))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(images))

    @property
    def global_pool(self) -> str:
        """The pooling under timm's name: ``"token"`` or ``"avg"`` (``pool`` gives RevViT's)."""
        return "token" if self.pool == "token" else "avg"

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None):
        """A new head for ``num_classes`` classes (0: none, ``forward`` returns the pooled features),
        initialised as at construction, as in timm. ``global_pool`` (timm's argument) may only name
        the current pooling: changing it would add or drop the cls token, so build a new model."""
        check_num_classes(num_classes)
        if global_pool is not None and pool_named(global_pool) != self.pool:
            has = "has a cls token" if self.pool == "token" else "has no cls token"
            raise ValueError(f"RevViT built with pool={self.pool!r} {has}; it cannot change to "
                             f"global_pool={global_pool!r}: build a new model with pool={pool_named(global_pool)!r}")
        self.num_classes = num_classes
        if num_classes == 0:
            self.head = nn.Identity()
        else:
            like = self.norm.weight  # the new head on the model's device and dtype
            self.head = nn.Linear(self.dim, num_classes, device=like.device, dtype=like.dtype)
            init_transformer_weights(self.head)
        self.head.train(self.training)

    def set_grad_checkpointing(self, enable: bool = True):
        """timm's switch (its train script's ``--grad-checkpointing``): the reversible blocks keep no
        activations to checkpoint, so it warns and changes nothing."""
        if enable:
            warnings.warn(CHECKPOINTING_MESSAGE, stacklevel=2)

    def no_weight_decay(self) -> set[str]:
        """Parameters timm's optimizer factory keeps out of weight decay (besides biases and norms)."""
        return {"pos_embed", "cls_token"}

    def forward_intermediates(self, *args, **kwargs):
        """Not available: the blocks run as one reversible stack of two streams, with no per-block
        output to hand out (running them one by one would keep every block's activations)."""
        raise NotImplementedError(f"RevViT has no forward_intermediates; for per-block features {REVIFY_TIMM_ADVICE}")

    def prune_intermediate_layers(self, *args, **kwargs):
        raise NotImplementedError(f"RevViT has no prune_intermediate_layers; for per-block features "
                                  f"{REVIFY_TIMM_ADVICE}")


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
