"""Pure-torch references of the coupling halves' math: the CPU path and the test oracle.

The bottom of ops/: it imports nothing from revtriton, so the launchers (ops/gemm.py), the fused
Functions and the dispatching couples can all use it without import cycles.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("gelu_tanh", "gelu", "relu")
NORMS = ("layer", "rms")


def normalize_reference(x, weight, bias, *, norm: str, eps: float):
    """LayerNorm or RMSNorm over the last dim, statistics in fp32 (fp64 for fp64 input), result in x's dtype."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    xf = x.double() if x.dtype == torch.float64 else x.float()  # stats in fp32 at least
    if norm == "layer":
        xf = xf - xf.mean(-1, keepdim=True)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype) if weight is None else (y * weight.to(xf.dtype)).to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def activation_reference(h, activation: str):
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "gelu":
        return F.gelu(h)
    if activation == "relu":
        return F.relu(h)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def apply_row_scale(h, row_scale):
    # row_scale: one factor per token row (drop-path's mask / keep probability), shape h.shape[:-1].
    return h if row_scale is None else h * row_scale.unsqueeze(-1).to(h.dtype)


def norm_mlp_reference(x, norm_weight, norm_bias, w1, b1, w2, b2, *, norm="layer", activation="gelu_tanh",
                       eps=1e-6, row_scale=None):
    """H(x) = fc2(act(fc1(norm(x)))) (optionally times a per-row scale)."""
    n = normalize_reference(x, norm_weight, norm_bias, norm=norm, eps=eps)
    h = activation_reference(F.linear(n, w1, b1), activation)
    return apply_row_scale(F.linear(h, w2, b2), row_scale)


def swiglu_mlp_reference(x, norm_weight, w_gate, w_up, w_down, *, eps=1e-6, row_scale=None):
    """H(x) = down(silu(gate(n)) * up(n)) with n = rmsnorm(x) (LLaMA's MLP)."""
    n = normalize_reference(x, norm_weight, None, norm="rms", eps=eps)
    return apply_row_scale(F.linear(F.silu(F.linear(n, w_gate)) * F.linear(n, w_up), w_down), row_scale)
