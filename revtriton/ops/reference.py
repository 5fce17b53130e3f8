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
    w = None if weight is None else weight.to(xf.dtype)
    if xf.is_cuda:
        # torch's own norm ops: one aten op each way where the formula below takes several (on CPU a
        # LayerNorm MLP half's forward + backward counted 46 aten ops with them, 75 with the formula).
        # This is the library path the measured choice races on a GPU; the engine's rebuild runs it again.
        shape = (x.shape[-1],)
        y = F.layer_norm(xf, shape, w, None, eps) if norm == "layer" else F.rms_norm(xf, shape, w, eps)
    elif torch.is_grad_enabled() and (xf.requires_grad or (w is not None and w.requires_grad)):
        # Spelled out elsewhere (the test oracle): the CPU layer_norm kernel's statistics leave a constant
        # row's centred values nonzero, and its weight gradient 3e-5 off in fp32 (tests/test_tiles.py).
        # With grad, the formula's values through a Function that keeps the input and a row's statistics,
        # not the centred and normalized rows autograd would keep (two of the input's size: a long
        # sequence's attention half keeps them while its projections are live, issue 36).
        y = _RowNorm.apply(xf, w, norm == "layer", eps)
    else:
        y = _row_norm_value(xf, w, norm == "layer", eps)[0]
    y = y.to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def _row_norm_value(xf, w, centred: bool, eps: float):
    """``(norm(xf) * w, mean or None, rstd)``: the formula (LayerNorm centres, RMSNorm does not); in one
    input-sized buffer where no graph is made (the same ops in place: the same bits)."""
    mean = xf.mean(-1, keepdim=True) if centred else None
    xc = xf if mean is None else xf - mean
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if torch.is_grad_enabled() and (xf.requires_grad or (w is not None and w.requires_grad)):
        y = xc * rstd
        return (y if w is None else y * w), mean, rstd
    y = xc * rstd if mean is None else xc.mul_(rstd)  # (xc is x itself without centring)
    return (y if w is None else y.mul_(w)), mean, rstd


class _RowNorm(torch.autograd.Function):
    """The CPU norm's formula (:func:`_row_norm_value`) keeping ``x`` and a row's mean and rstd for
    backward, which rebuilds the normalized rows from them. Its backward is torch ops (the statistics
    recomputed from ``x`` under ``create_graph``), so second-order gradients are the formula's too."""

    @staticmethod
    def forward(ctx, xf, w, centred: bool, eps: float):
        y, mean, rstd = _row_norm_value(xf, w, centred, eps)
        ctx.centred, ctx.eps = centred, eps
        ctx.save_for_backward(xf, w, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        xf, w, mean, rstd = ctx.saved_tensors
        create_graph = torch.is_grad_enabled()
        if create_graph:  # the statistics again, as functions of x this time
            _, mean, rstd = _row_norm_value(xf, None, ctx.centred, ctx.eps)
            xhat = (xf if mean is None else xf - mean) * rstd
            dw = (grad * xhat).reshape(-1, xf.shape[-1]).sum(0) if w is not None and ctx.needs_input_grad[1] else None
            dx = None
            if ctx.needs_input_grad[0]:
                g = grad if w is None else grad * w
                dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
                dx = (dx if mean is None else dx - g.mean(-1, keepdim=True)) * rstd
            return dx, dw, None, None
        # The same in place, at most two input-sized buffers alive (a long sample's attention half runs this
        # beside its projections, issue 36): the normalized rows, then the product for dw and the projection
        # (its buffer reused), then the gradient through w, the result in the normalized rows' buffer.
        xhat = xf * rstd if mean is None else (xf - mean).mul_(rstd)
        product = grad * xhat
        dw = product.reshape(-1, xf.shape[-1]).sum(0) if w is not None and ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            # d/dx of (x - mean) * rstd: the gradient less its projections on the normalized row (rstd
            # depends on every element) and, for LayerNorm, on the row's mean.
            along = (product if w is None else product.mul_(w)).mean(-1, keepdim=True)
            del product
            g = grad if w is None else grad * w
            dx = torch.sub(g, xhat.mul_(along), out=xhat)
            if mean is not None:
                dx.sub_(g.mean(-1, keepdim=True))
            dx.mul_(rstd)
        return dx, dw, None, None


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


# -- attention: RoPE frequencies, grouped-query heads, token layouts -----------------------------


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2], fp32: ``theta ** (-2i / head_dim)``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_tables_at(positions, head_dim: int, theta: float, *, inv_freq=None, scale: float = 1.0) -> tuple:
    """RoPE's cos, sin [..., head_dim / 2] fp32 at integer ``positions`` [...] ([T], or [B, T] for packed
    or padded rows), rotate-half convention (both halves of a head share the angles): one product per
    entry, the same bits wherever a position repeats. ``inv_freq`` [head_dim / 2] replaces theta's
    frequencies and ``scale`` multiplies both tables (RoPE scaling: Llama 3, linear, YaRN, as the
    model's own rotary embedding computes them)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float32)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.contiguous(), sin.contiguous()


def rotate_half_reference(t, cos, sin):
    """Rotate-half RoPE over ``t``'s last dim: ``[t1 c - t2 s, t2 c + t1 s]`` with ``cos`` / ``sin`` the
    half-width tables (:func:`rope_tables_at`), shaped to broadcast against ``t[..., :half]``; computed
    in float32 or wider (float64 stays float64), returned in t's dtype. ``-sin`` is the inverse (the
    rotation's transpose: the backward)."""
    half = t.shape[-1] // 2
    compute = torch.promote_types(t.dtype, torch.float32)
    t1, t2 = t[..., :half].to(compute), t[..., half:].to(compute)
    return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1).to(t.dtype)


def repeat_kv_heads(t, heads):  # grouped-query attention: each kv head serves heads // kv_heads query heads
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


# -- token layouts: padding masks and packed sequences -------------------------------------------


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Sequence numbers (1, 2, ...) [B, T] of packed rows: a sequence starts wherever a position is
    not its predecessor + 1 (Hugging Face's rule for DataCollatorWithFlattening's position_ids)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1) + 1


def sequence_mask(segments: torch.Tensor, causal: bool, window: int | None = None) -> torch.Tensor:
    """Boolean attention mask [B, 1, T, T] from ``segments`` [B, T] (0: padding, k >= 1: the k-th
    sequence of the row): a token sees the keys of its own sequence (causally when ``causal``), never
    padding; a padding query sees every real key (causally), as the library's padding masks hide keys
    only, so a loss read at padding positions matches theirs. A query with no key left (left padding's
    first positions) sees itself, so its row stays finite. ``window`` (sliding-window attention,
    Mistral's): a query sees only the ``window`` latest keys, itself included."""
    padding_query = (segments == 0)[:, None, :, None]
    same = segments[:, None, :, None] == segments[:, None, None, :]
    allowed = (same | padding_query) & (segments != 0)[:, None, None, :]
    tokens = segments.shape[-1]
    if causal:
        allowed &= torch.ones(tokens, tokens, dtype=torch.bool, device=segments.device).tril_()
    if window is not None:
        allowed &= torch.ones(tokens, tokens, dtype=torch.bool, device=segments.device).triu_(1 - window)
    return see_self_if_empty(allowed)


def see_self_if_empty(allowed: torch.Tensor) -> torch.Tensor:
    """Rows [..., T_q, T_k] with no allowed key see their own position (the last T_q keys)."""
    queries, keys = allowed.shape[-2:]
    own = torch.arange(keys - queries, keys, device=allowed.device)[:, None] == torch.arange(keys, device=allowed.device)
    return allowed | (own & ~allowed.any(-1, keepdim=True))
