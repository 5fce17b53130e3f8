"""RevGPT: decoder-only language models whose blocks form one reversible stack.

Two styles, same parameter counts as the originals of equal size:

* ``"gpt2"``: learned positions, LayerNorm (eps 1e-5), GELU-tanh MLP (4x), biases, tied
  input/output embeddings (GPT-2 124M: 124,439,808 parameters).
* ``"llama"``: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases,
  untied output head (LLaMA-2 7B: 6,738,415,616 parameters).

Blocks are reversible couplings (F = norm + causal attention, G = norm + MLP).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import ReversibleBlock
from ..ops.linear_cross_entropy import linear_cross_entropy
from ..halves import LayerNormAttention, LayerNormMLP, RMSNormAttention, RMSNormSwiGLU
from .common import (check_positive, drop_path_schedule, init_transformer_weights, make_stack, stack_options,
                     trunc_normal_)


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024  # longest sequence (learned positions; RoPE models only check it)
    dim: int = 768
    depth: int = 12
    heads: int = 12
    kv_heads: int | None = None  # grouped-query attention (llama style); None: = heads
    hidden: int | None = None  # MLP hidden size; None: 4 * dim (gpt2), LLaMA's 8/3 rule rounded to 256 (llama)
    style: str = "gpt2"  # "gpt2" or "llama"
    eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool | None = None  # None: True for gpt2, False for llama
    dropout: float = 0.0  # after the embeddings
    drop_path_rate: float = 0.0

    def resolved(self) -> "GPTConfig":
        if self.style not in ("gpt2", "llama"):
            raise ValueError(f"style must be 'gpt2' or 'llama', got {self.style!r}")
        for name in ("vocab_size", "block_size", "dim", "depth", "heads"):
            check_positive(name, getattr(self, name))
        hidden = self.hidden
        if hidden is None:
            hidden = 4 * self.dim if self.style == "gpt2" else 256 * math.ceil(int(8 * self.dim / 3) / 256)
        tie = self.tie_embeddings if self.tie_embeddings is not None else self.style == "gpt2"
        kv_heads = self.kv_heads or self.heads
        if self.style == "gpt2" and kv_heads != self.heads:
            raise ValueError("grouped-query attention (kv_heads != heads) is only available in the llama style")
        return dataclasses.replace(self, hidden=hidden, tie_embeddings=tie, kv_heads=kv_heads)


GPT_PRESETS = {
    "gpt2": GPTConfig(),
    "gpt2-medium": GPTConfig(dim=1024, depth=24, heads=16),
    "gpt2-large": GPTConfig(dim=1280, depth=36, heads=20),
    "gpt2-tiny": GPTConfig(vocab_size=256, block_size=256, dim=128, depth=4, heads=4),
    "llama2-7b": GPTConfig(style="llama", vocab_size=32000, block_size=4096, dim=4096, depth=32, heads=32,
                           hidden=11008),
    "llama3-8b": GPTConfig(style="llama", vocab_size=128256, block_size=8192, dim=4096, depth=32, heads=32,
                           kv_heads=8, hidden=14336, rope_theta=500000.0),
    "llama-tiny": GPTConfig(style="llama", vocab_size=256, block_size=256, dim=128, depth=4, heads=4, kv_heads=2,
                            hidden=352),
}


class RevGPT(nn.Module):
    """Reversible decoder-only LM. ``model(idx, targets=None) -> (logits, loss)``: loss None without
    targets; with targets the fused chunked loss, and logits None (``return_logits=True``: both).

    ``reversible=False`` builds the stored-activation twin; ``exact``, ``frac_bits``,
    ``anchor_every``, ``schedule``, ``token_chunk`` are ReversibleStack options.
    """

    def __init__(self, config: GPTConfig | None = None, *, reversible: bool = True, **kwargs):
        super().__init__()
        options = stack_options(kwargs)
        config = dataclasses.replace(config or GPTConfig(), **kwargs).resolved()
        self.config = c = config
        self.tok_embed = nn.Embedding(c.vocab_size, c.dim)
        self.pos_embed = nn.Embedding(c.block_size, c.dim) if c.style == "gpt2" else None
        self.drop = nn.Dropout(c.dropout)
        blocks = []
        for rate in drop_path_schedule(c.drop_path_rate, c.depth):
            if c.style == "gpt2":
                f = LayerNormAttention(c.dim, c.heads, qkv_bias=True, causal=True, eps=c.eps, drop_path=rate)
                g = LayerNormMLP(c.dim, c.hidden, activation="gelu_tanh", eps=c.eps, drop_path=rate)
            else:
                f = RMSNormAttention(c.dim, c.heads, kv_heads=c.kv_heads, causal=True, rope_theta=c.rope_theta,
                                     eps=c.eps, drop_path=rate)
                g = RMSNormSwiGLU(c.dim, c.hidden, eps=c.eps, drop_path=rate)
            blocks.append(ReversibleBlock(f, g))
        self.blocks = make_stack(blocks, reversible=reversible, **options)
        self.norm = nn.LayerNorm(c.dim, eps=c.eps) if c.style == "gpt2" else nn.RMSNorm(c.dim, eps=c.eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight
        self._init_weights()

    def _init_weights(self):
        init_transformer_weights(self)
        # GPT-2: residual projections scaled by 1/sqrt(2 * depth).
        std = 0.02 / math.sqrt(2 * self.config.depth)
        for block in self.blocks:
            f, g = block.coupling_halves()
            for linear in (f.proj, getattr(g, "fc2", None), getattr(g, "down", None)):
                if linear is not None:
                    trunc_normal_(linear.weight, std=std, a=-2 * std, b=2 * std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, return_logits: bool | None = None):
        """``(logits, loss)``. With ``targets`` the loss is the chunked linear + cross-entropy
        (:func:`revtriton.ops.linear_cross_entropy.linear_cross_entropy`: no ``tokens x vocab``
        logits are made) and ``logits`` is None, unless ``return_logits=True`` (then the full
        logits and their cross-entropy, the same loss)."""
        if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"RevGPT takes [batch, tokens] integer token ids, got {idx.dtype} {tuple(idx.shape)}")
        tokens = idx.shape[1]
        if tokens > self.config.block_size:
            raise ValueError(f"sequence of {tokens} tokens exceeds block_size {self.config.block_size}")
        x = self.tok_embed(idx)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(tokens, device=idx.device))
        x = self.norm(self.blocks(self.drop(x)))
        if targets is None:
            return self.lm_head(x), None
        if targets.shape != idx.shape:
            raise ValueError(f"targets must match idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        if return_logits:
            logits = self.lm_head(x)
            return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                           ignore_index=-100)
        hidden = x.reshape(-1, x.shape[-1])
        return None, linear_cross_entropy(hidden, self.lm_head.weight, targets.reshape(-1), ignore_index=-100)


def rev_gpt(preset: str = "gpt2", **kwargs) -> RevGPT:
    """A RevGPT preset (see ``GPT_PRESETS``) with config fields or stack options overridden."""
    if preset not in GPT_PRESETS:
        raise ValueError(f"unknown RevGPT preset {preset!r}; choose from {sorted(GPT_PRESETS)}")
    return RevGPT(GPT_PRESETS[preset], **kwargs)


def rev_llama(preset: str = "llama2-7b", **kwargs) -> RevGPT:
    """A LLaMA-style RevGPT preset ("llama2-7b", "llama3-8b", "llama-tiny")."""
    if GPT_PRESETS.get(preset, GPTConfig()).style != "llama":
        raise ValueError(f"{preset!r} is not a LLaMA-style preset; choose from "
                         f"{sorted(k for k, v in GPT_PRESETS.items() if v.style == 'llama')}")
    return rev_gpt(preset, **kwargs)
