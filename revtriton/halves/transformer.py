"""Transformer coupling halves: norm + MLP (G) and norm + attention (F).

Each is a :class:`CouplingHalf` whose ``couple`` calls the ops layer's one dispatch point
(``ops.dispatch.run_op``): on a GPU the implementation ``ops.backend`` measured fastest for the
shape (fused Triton kernels, or the cuBLAS + SDPA library path), pinned for the process; on CPU
the pure-torch reference (same weights, same math). ``forward(x)`` is H(x) on the reference path
(plain torch ops and autograd), for use outside a reversible stack.

Drop-path (stochastic depth) and layer scale are part of the half: drop-path becomes a
per-row scale of H(x) (drawn from the half's generator inside a stack, which the engine replays:
``halves.randomness``; the global one outside), layer scale is
folded into the last projection. A scaled coupling's residual scale (``couple(..., scale=)``,
``takes_scale``) goes into the couple epilogue too, so it costs no pass of its own.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops import dispatch
from ..ops.attention import (check_attention_shapes, head_group, head_group_parts, norm_attention_couple,
                             norm_attention_reference)
from ..ops.mlp import ACTIVATIONS, norm_mlp_couple, norm_mlp_reference, swiglu_mlp_couple, swiglu_mlp_reference
from ..ops.streams import ResidualScale
from .base import CouplingHalf, OpHalf, parameter
from .randomness import half_generator


def drop_path_scale(x: torch.Tensor, p: float, training: bool) -> torch.Tensor | None:
    """Per-row factor of drop-path (stochastic depth) with drop probability ``p``: 0 or 1/keep per
    sample, broadcast over its tokens (None when it drops nothing). Drawn from the half's generator
    inside a stack (replayed in the recompute: ``halves.randomness``), the global one outside."""
    if not training or p == 0.0:
        return None
    keep = 1.0 - p
    shape = (x.shape[0],) + (1,) * (x.dim() - 2)
    generator = half_generator(x.device)
    mask = torch.empty(shape, device=x.device, dtype=torch.float32).bernoulli_(keep, generator=generator) / keep
    return mask.expand(x.shape[:-1])


def layer_scaled(weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor | None) -> tuple:
    """Layer scale ``gamma`` folded into an output projection: ``diag(gamma) W``, ``gamma * b`` (as given
    without one)."""
    if gamma is None:
        return weight, bias
    gamma = gamma.to(weight.dtype)
    return weight * gamma[:, None], (None if bias is None else bias * gamma)


class _TransformerHalf(OpHalf, CouplingHalf):
    def __init__(self, dim: int, drop_path: float, layer_scale: float | None):
        super().__init__()
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not 0.0 <= drop_path < 1.0:
            raise ValueError(f"drop_path must be in [0, 1), got {drop_path}")
        self.dim = dim
        self.drop_path = drop_path
        self.layer_scale = nn.Parameter(torch.full((dim,), float(layer_scale))) if layer_scale is not None else None

    def _row_scale(self, x: torch.Tensor):
        return drop_path_scale(x, self.drop_path, self.training)

    def _scaled_out(self, weight, bias):
        return layer_scaled(weight, bias, parameter(self, "layer_scale"))

    def _check_input(self, x):
        if x.shape[-1] != self.dim:
            raise ValueError(f"{type(self).__name__}: input last dim {x.shape[-1]} != dim {self.dim}")

    # Subclasses give the op pair (couple_op, OpHalf's dispatching couple, and its pure-torch reference),
    # their weights and options.
    reference_op = None
    token_wise = False  # the MLPs: each output row is computed from its input row alone

    @property
    def rows_independent(self) -> bool:
        """Whether the stack may run this half by chunks of token rows (engine.rows): a token-wise half
        whose drop-path draws nothing (its draw is per sample)."""
        return self.token_wise and not (self.training and self.drop_path)
    # The engine hands a scaled coupling's ResidualScale to couple() (applied in the epilogue).
    takes_scale = True

    def weights(self) -> tuple:
        """The positional weights of this half's ops (the output projection with layer scale folded in)."""
        raise NotImplementedError

    def options(self) -> dict:
        """The keyword options of this half's ops but the row scale."""
        raise NotImplementedError

    def _norm_in_out_weights(self, norm: str, inner: str, outer: str) -> tuple:
        """The weights of a norm -> projection -> ... -> projection half (the submodules' names given):
        norm weight and bias, the inner projection's weight and bias, the outer one's (layer scale in)."""
        modules = self._modules
        norm, inner, outer = modules[norm], modules[inner], modules[outer]
        w_out, b_out = self._scaled_out(parameter(outer, "weight"), parameter(outer, "bias"))
        return (parameter(norm, "weight"), parameter(norm, "bias"), parameter(inner, "weight"),
                parameter(inner, "bias"), w_out, b_out)

    def operands(self, x):
        """(positional weights, keyword options) of this half's ops for input ``x``."""
        return self.weights(), dict(self.options(), row_scale=self._row_scale(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """H(x) on the pure-torch reference path (plain autograd; what a vanilla block runs)."""
        self._check_input(x)
        args, options = self.operands(x)
        return type(self).reference_op(x, *args, **options)

    def couple(self, res, x, sign, frac_bits=None, scale: ResidualScale | None = None):
        if self._compiled_call_impl is not None:
            # Compiled (``half.compile(...)``, regional compilation): H(x) is the compiled forward,
            # the epilogue eager, as any CouplingHalf's; torch.compile's kernels then stand in for
            # the fused ones (both are code generated for the same math).
            return super().couple(res, x, sign, frac_bits, scale=scale)
        if scale is None and not (self.training and self.drop_path):
            # Nothing drawn, no coupling scale: a runner bound to the call signature serves every
            # repeated call (every block, every step), skipping the checks, the dispatch and the
            # op's plan lookup, about two thirds of the couple's host work (ops.dispatch.run_bound).
            return dispatch.run_bound(type(self).couple_op, res, x, sign, frac_bits, self.weights(), self.options(),
                                      check=self._check_input)
        self._check_input(x)
        args, options = self.operands(x)
        return type(self).couple_op(res, x, sign, frac_bits, *args, scale=scale, **options)


class LayerNormMLP(_TransformerHalf):
    """G = fc2(act(fc1(LayerNorm(x)))), the ViT / GPT-2 MLP half."""

    token_wise = True

    def __init__(self, dim: int, hidden: int, activation: str = "gelu_tanh", bias: bool = True, eps: float = 1e-6,
                 drop_path: float = 0.0, layer_scale: float | None = None):
        super().__init__(dim, drop_path, layer_scale)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation, self.eps = activation, eps
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    couple_op, reference_op = norm_mlp_couple, norm_mlp_reference

    def weights(self):
        return self._norm_in_out_weights("norm", "fc1", "fc2")

    def options(self):
        return dict(norm="layer", activation=self.activation, eps=self.eps)


class RMSNormSwiGLU(_TransformerHalf):
    """G = down(silu(gate(n)) * up(n)), n = RMSNorm(x): the LLaMA MLP half."""

    token_wise = True

    def __init__(self, dim: int, hidden: int, eps: float = 1e-6, drop_path: float = 0.0,
                 layer_scale: float | None = None):
        super().__init__(dim, drop_path, layer_scale)
        self.eps = eps
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    couple_op, reference_op = swiglu_mlp_couple, swiglu_mlp_reference

    def weights(self):
        modules = self._modules
        w_down, _ = self._scaled_out(parameter(modules["down"], "weight"), None)
        return (parameter(modules["norm"], "weight"), parameter(modules["gate"], "weight"),
                parameter(modules["up"], "weight"), w_down)

    def options(self):
        return dict(eps=self.eps)


class _AttentionHalf(_TransformerHalf):
    samples_independent = True  # tokens see each other, samples do not (ReversibleStack token_chunk)
    def __init__(self, dim, heads, kv_heads, causal, rope_theta, norm, qkv_bias, proj_bias, eps, drop_path,
                 layer_scale):
        super().__init__(dim, drop_path, layer_scale)
        kv_heads = kv_heads or heads
        if heads <= 0 or dim % heads:
            raise ValueError(f"heads ({heads}) must divide dim ({dim})")
        if kv_heads <= 0 or heads % kv_heads:
            raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
        head_dim = dim // heads
        if rope_theta is not None and head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.causal, self.rope_theta, self.norm_kind, self.eps = causal, rope_theta, norm, eps
        self.norm = nn.LayerNorm(dim, eps=eps) if norm == "layer" else nn.RMSNorm(dim, eps=eps)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    couple_op, reference_op = norm_attention_couple, norm_attention_reference

    def _check_input(self, x):
        check_attention_shapes(x, self.dim, self.heads, self.kv_heads)

    def head_parts(self, wanted: int, like=None, cond=None) -> int:
        """The head groups the stack may compute this half in (engine.rows, ops.attention.head_group): none
        where drop-path draws (a draw a call) or the half is compiled (its compiled forward is whole)."""
        if (self.training and self.drop_path) or self._compiled_call_impl is not None or like is None:
            return 1
        return head_group_parts(self.kv_heads, wanted, like.shape[-2], like.shape[-1])

    def part_output(self, part: int, parts: int, x):
        """``H_part(x)``: head group ``part`` of ``parts`` on the reference path (engine.rows; the fused
        kernels take whole heads)."""
        self._check_input(x)
        weights, options = head_group(self.weights(), self.options(), part, parts)
        return type(self).reference_op(x, *weights, **options)

    def weights(self):
        return self._norm_in_out_weights("norm", "qkv", "proj")

    def options(self):
        return dict(heads=self.heads, kv_heads=self.kv_heads, causal=self.causal, rope_theta=self.rope_theta,
                    norm=self.norm_kind, eps=self.eps)


class LayerNormAttention(_AttentionHalf):
    """F = proj(attention(qkv(LayerNorm(x)))), the ViT / GPT-2 attention half."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True, causal: bool = False, eps: float = 1e-6,
                 drop_path: float = 0.0, layer_scale: float | None = None):
        super().__init__(dim, heads, None, causal, None, "layer", qkv_bias, True, eps, drop_path, layer_scale)


class RMSNormAttention(_AttentionHalf):
    """F for LLaMA-style models: RMSNorm, RoPE, grouped-query attention, no biases, causal."""

    def __init__(self, dim: int, heads: int, kv_heads: int | None = None, causal: bool = True,
                 rope_theta: float = 10000.0, eps: float = 1e-6, drop_path: float = 0.0,
                 layer_scale: float | None = None):
        super().__init__(dim, heads, kv_heads, causal, rope_theta, "rms", False, False, eps, drop_path, layer_scale)
