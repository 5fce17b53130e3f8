"""RevMViT: a multiscale ViT in the style of reversible MViT (Mangalam et al., CVPR 2022).

Stages of reversible blocks at fixed resolution and width, joined by non-reversible
*stage-transition* blocks that pool the tokens (query pooling, stride 2) and widen the
channels. Inside a stage, F is pooling attention (keys and values pooled by a depthwise
convolution, MViTv2's residual pooling connection) used as a generic coupling half, and G is
LayerNorm + MLP. The reversible stack stores only each stage's final streams; the transitions
keep their activations the ordinary way (the engine's stage-transition layers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import ReversibleBlock
from ..halves import CouplingHalf, LayerNormMLP
from .common import (check_positive, drop_path_schedule, init_transformer_weights, make_stack, stack_options,
                     trunc_normal_)

MVIT_PRESETS = {
    # CPU-sized: three stages (grid side s, s/2, s/4).
    "xs": dict(dims=(32, 64, 128), heads=(1, 2, 4), depths=(1, 2, 1), kv_stride=2),
    # MViTv2-T layout (1-2-5-2 blocks, 96..768 channels).
    "tiny": dict(dims=(96, 192, 384, 768), heads=(1, 2, 4, 8), depths=(1, 2, 5, 2), kv_stride=4),
}


class TokenPool(nn.Module):
    """Pool a [B, heads, H*W, hd] token grid with a depthwise conv (stride s) and LayerNorm (MViTv2)."""

    def __init__(self, head_dim: int, stride: int, eps: float = 1e-6):
        super().__init__()
        self.stride = stride
        kernel = stride + 1 if stride > 1 else 1
        self.conv = nn.Conv2d(head_dim, head_dim, kernel, stride=stride, padding=kernel // 2, groups=head_dim,
                              bias=False)
        self.norm = nn.LayerNorm(head_dim, eps=eps)

    def forward(self, t: torch.Tensor, grid: tuple[int, int]):
        batch, heads, tokens, head_dim = t.shape
        h, w = grid
        t = t.reshape(batch * heads, h, w, head_dim).permute(0, 3, 1, 2)
        t = self.conv(t)
        out_grid = tuple(t.shape[-2:])
        t = t.flatten(2).transpose(1, 2).reshape(batch, heads, -1, head_dim)
        return self.norm(t), out_grid


def pooled_grid(grid: tuple[int, int], stride: int) -> tuple[int, int]:
    return grid if stride == 1 else tuple((side - 1) // stride + 1 for side in grid)


class _PoolingAttentionCore(nn.Module):
    """qkv -> (pool q, k, v) -> attention + residual q -> proj; [B, N, dim_in] -> [B, N', dim_out]."""

    def __init__(self, dim_in, dim_out, heads, q_stride, kv_stride, eps):
        super().__init__()
        if dim_out % heads:
            raise ValueError(f"heads ({heads}) must divide dim ({dim_out})")
        self.heads, self.head_dim = heads, dim_out // heads
        self.qkv = nn.Linear(dim_in, 3 * dim_out)
        self.pool_q = TokenPool(self.head_dim, q_stride, eps) if q_stride > 1 else None
        self.pool_k = TokenPool(self.head_dim, kv_stride, eps) if kv_stride > 1 else None
        self.pool_v = TokenPool(self.head_dim, kv_stride, eps) if kv_stride > 1 else None
        self.proj = nn.Linear(dim_out, dim_out)

    def forward(self, n, grid):
        batch, tokens, _ = n.shape
        q, k, v = self.qkv(n).reshape(batch, tokens, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q_grid = grid
        if self.pool_q is not None:
            q, q_grid = self.pool_q(q, grid)
        if self.pool_k is not None:
            k, _ = self.pool_k(k, grid)
            v, _ = self.pool_v(v, grid)
        o = F.scaled_dot_product_attention(q, k, v) + q  # residual pooling connection (MViTv2)
        o = o.transpose(1, 2).reshape(batch, -1, self.heads * self.head_dim)
        return self.proj(o), q_grid


class PoolingAttention(CouplingHalf):
    """F of a RevMViT block: LayerNorm + multi-head attention with pooled keys/values, shape-preserving."""

    def __init__(self, dim: int, heads: int, grid: tuple[int, int], kv_stride: int = 1, eps: float = 1e-6,
                 drop_path: float = 0.0):
        super().__init__()
        self.grid, self.drop_path = tuple(grid), drop_path
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.attn = _PoolingAttentionCore(dim, dim, heads, 1, kv_stride, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != self.grid[0] * self.grid[1]:
            raise ValueError(f"PoolingAttention expects [batch, {self.grid[0] * self.grid[1]}, dim] tokens "
                             f"(grid {self.grid}), got {tuple(x.shape)}")
        out, _ = self.attn(self.norm(x), self.grid)
        if self.training and self.drop_path > 0:
            keep = 1.0 - self.drop_path
            mask = torch.empty((x.shape[0], 1, 1), device=x.device, dtype=torch.float32).bernoulli_(keep) / keep
            out = out * mask.to(out.dtype)
        return out


class StageTransition(nn.Module):
    """Non-reversible MViT block between stages: pools tokens by ``q_stride`` and widens dim_in -> dim_out.

    ``x' = maxpool(proj(n)) + attention_qpool(n)``, ``out = x' + mlp(norm2(x'))`` with ``n = norm1(x)``.
    """

    def __init__(self, dim_in: int, dim_out: int, heads: int, grid: tuple[int, int], q_stride: int = 2,
                 kv_stride: int = 1, mlp_ratio: float = 4.0, eps: float = 1e-6):
        super().__init__()
        self.grid, self.q_stride = tuple(grid), q_stride
        self.out_grid = pooled_grid(self.grid, q_stride)
        self.norm1 = nn.LayerNorm(dim_in, eps=eps)
        self.skip_proj = nn.Linear(dim_in, dim_out)
        self.attn = _PoolingAttentionCore(dim_in, dim_out, heads, q_stride, kv_stride, eps)
        self.norm2 = nn.LayerNorm(dim_out, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(dim_out, int(dim_out * mlp_ratio)), nn.GELU(),
                                 nn.Linear(int(dim_out * mlp_ratio), dim_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        h, w = self.grid
        if tokens != h * w:
            raise ValueError(f"StageTransition expects {h * w} tokens (grid {self.grid}), got {tokens}")
        n = self.norm1(x)
        skip = self.skip_proj(n).transpose(1, 2).reshape(batch, -1, h, w)
        if self.q_stride > 1:
            skip = F.max_pool2d(skip, self.q_stride + 1, self.q_stride, (self.q_stride + 1) // 2)
        skip = skip.flatten(2).transpose(1, 2)
        attn, _ = self.attn(n, self.grid)
        x = skip + attn
        return x + self.mlp(self.norm2(x))


class RevMViT(nn.Module):
    """Reversible multiscale ViT: patch embedding, stages of reversible pooling-attention blocks,
    stage transitions (token pooling x2 per side, width change), mean pooling, norm, linear head.

    Args:
        dims, heads, depths: per stage width, heads and number of reversible blocks.
        kv_stride: key/value pooling stride in the first stage; halved at every transition
            (MViTv2's adaptive kv stride keeps the key grid about constant).
        patch_kernel, patch_stride: the convolutional patch embedding (MViT: 7 and 4).
        reversible: False builds the stored-activation twin; exact, frac_bits, anchor_every,
        schedule, token_chunk: ReversibleStack options.
    """

    def __init__(self, *, img_size: int = 224, in_chans: int = 3, num_classes: int = 1000,
                 dims=(96, 192, 384, 768), heads=(1, 2, 4, 8), depths=(1, 2, 5, 2), kv_stride: int = 4,
                 patch_kernel: int = 7, patch_stride: int = 4, mlp_ratio: float = 4.0, drop_path_rate: float = 0.0,
                 eps: float = 1e-6, reversible: bool = True, **stack_kwargs):
        super().__init__()
        options = stack_options(stack_kwargs)
        if stack_kwargs:
            raise TypeError(f"RevMViT got unexpected arguments {sorted(stack_kwargs)}")
        if not (len(dims) == len(heads) == len(depths)) or not dims:
            raise ValueError(f"dims, heads and depths need one entry per stage, got {dims}, {heads}, {depths}")
        for name, value in (("img_size", img_size), ("num_classes", num_classes), ("patch_stride", patch_stride),
                            ("kv_stride", kv_stride), *((f"depths[{i}]", d) for i, d in enumerate(depths))):
            check_positive(name, value)
        self.patch_embed = nn.Conv2d(in_chans, dims[0], patch_kernel, stride=patch_stride, padding=patch_kernel // 2)
        side = (img_size + 2 * (patch_kernel // 2) - patch_kernel) // patch_stride + 1
        grid = (side, side)
        self.img_size, self.grid = img_size, grid
        self.pos_embed = nn.Parameter(torch.zeros(1, side * side, dims[0]))
        rates = iter(drop_path_schedule(drop_path_rate, sum(depths)))
        layers = []
        for stage, (dim, n_heads, depth) in enumerate(zip(dims, heads, depths)):
            if stage > 0:
                transition = StageTransition(dims[stage - 1], dim, n_heads, grid, q_stride=2, kv_stride=kv_stride,
                                             mlp_ratio=mlp_ratio, eps=eps)
                layers.append(transition)
                grid = transition.out_grid
                kv_stride = max(1, kv_stride // 2)
            for _ in range(depth):
                rate = next(rates)
                layers.append(ReversibleBlock(
                    PoolingAttention(dim, n_heads, grid, kv_stride=kv_stride, eps=eps, drop_path=rate),
                    LayerNormMLP(dim, int(dim * mlp_ratio), activation="gelu", eps=eps, drop_path=rate),
                ))
        self.blocks = make_stack(layers, reversible=reversible, **options)
        self.out_grid = grid
        self.norm = nn.LayerNorm(dims[-1], eps=eps)
        self.head = nn.Linear(dims[-1], num_classes)
        init_transformer_weights(self)
        trunc_normal_(self.pos_embed, std=0.02, a=-0.04, b=0.04)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or images.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"RevMViT takes [batch, channels, {self.img_size}, {self.img_size}] images, got "
                             f"{tuple(images.shape)}")
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        x = self.blocks(x)
        return self.head(self.norm(x.mean(dim=1)))


def rev_mvit(preset: str = "xs", **kwargs) -> RevMViT:
    """A RevMViT preset ("xs": trains on CPU; "tiny": MViTv2-T layout) with overrides."""
    if preset not in MVIT_PRESETS:
        raise ValueError(f"unknown RevMViT preset {preset!r}; choose from {sorted(MVIT_PRESETS)}")
    return RevMViT(**{**MVIT_PRESETS[preset], **kwargs})
