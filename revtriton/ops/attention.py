"""norm + attention coupling half: pure-torch references and the dispatching couple.

``norm_attention_couple`` goes through ``dispatch.run_op``. Its candidates cover each sub-op's
implementations (the projections: fused Triton GEMMs or cuBLAS; the attention core: the Triton
flash kernels or SDPA), raced together on first use (ops.backend):

===================  ===============================  ====================
candidate            QKV and out-projection GEMMs     attention core
===================  ===============================  ====================
``triton``           fused Triton (norm, RoPE, couple  Triton flash
                     in their pro- / epilogues)
``torch``            cuBLAS (F.linear), torch norm    SDPA
``triton_gemm_sdpa`` fused Triton                     SDPA
``torch_gemm_flash`` cuBLAS (F.linear), torch norm    Triton flash
===================  ===============================  ====================
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend
from .dispatch import kept_import, run_op, scale_option, triton_dtypes, triton_runs_on
from .reference import (apply_row_scale, normalize_reference, packed_segments,  # noqa: F401 (re-exported)
                        repeat_kv_heads, rope_tables_at, rotate_half_reference, sequence_mask)
from .streams import ResidualScale, library_couple_output


def check_attention_shapes(x, dim: int, heads: int, kv_heads: int, head_dim: int | None = None):
    if x.dim() != 3:
        raise ValueError(f"attention halves take [batch, tokens, dim] input, got rank {x.dim()} {tuple(x.shape)}")
    if x.shape[-1] != dim:
        raise ValueError(f"input last dim {x.shape[-1]} does not match the half's dim {dim}")
    if dim % heads:
        raise ValueError(f"heads ({heads}) must divide dim ({dim})")
    if heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")


def _heads(q, k, v, heads, kv_heads, qk_norm, rope_theta, positions, rope_inv_freq, rope_scale, rope_dims=None):
    """[B, T, heads*hd] projections -> [B, heads or kv_heads, T, hd], qk-normed and rotated (the first
    ``rope_dims`` of each head only, when given: partial rotary, GPT-NeoX's)."""
    batch, tokens, _ = q.shape
    head_dim = q.shape[-1] // heads
    q = q.view(batch, tokens, heads, head_dim).transpose(1, 2)
    k = k.view(batch, tokens, kv_heads, head_dim).transpose(1, 2)
    v = v.view(batch, tokens, kv_heads, head_dim).transpose(1, 2)
    if qk_norm is not None:
        q, k = qk_norm[0](q), qk_norm[1](k)
    if rope_theta is not None:
        rotated = head_dim if rope_dims is None else rope_dims
        at = torch.arange(tokens, device=q.device) if positions is None else positions.to(q.device)
        cos, sin = rope_tables_at(at, rotated, rope_theta, inv_freq=rope_inv_freq, scale=rope_scale)
        if positions is not None:  # [B, T, half] -> [B, 1, T, half]: one table per row, every head
            cos, sin = cos[:, None], sin[:, None]
        if rotated == head_dim:
            q, k = rotate_half_reference(q, cos, sin), rotate_half_reference(k, cos, sin)
        else:
            q, k = (torch.cat([rotate_half_reference(t[..., :rotated], cos, sin), t[..., rotated:]], dim=-1)
                    for t in (q, k))
    return q, k, v


def multi_head_attention_reference(q, k, v, *, heads, kv_heads, causal, rope_theta=None, dropout=0.0,
                                   positions=None, segments=None, window=None, qk_norm=None, rope_inv_freq=None,
                                   rope_scale=1.0, rope_dims=None):
    """Projected q [B, T, heads*hd], k and v [B, T, kv_heads*hd] -> attention output [B, T, heads*hd].

    ``positions`` [B, T]: RoPE positions (default 0..T-1); ``segments`` [B, T]: the token layout of
    padded or packed rows (see :func:`sequence_mask`; default: one sequence per row); ``window``:
    sliding-window attention; ``qk_norm``: ``(q_norm, k_norm)`` modules applied per head before RoPE
    (Qwen3); ``rope_inv_freq`` / ``rope_scale``: scaled RoPE (see :func:`.reference.rope_tables_at`); ``rope_dims``:
    partial rotary, the first ``rope_dims`` of each head rotated (frequencies over them)."""
    batch, tokens, _ = q.shape
    q, k, v = _heads(q, k, v, heads, kv_heads, qk_norm, rope_theta, positions, rope_inv_freq, rope_scale, rope_dims)
    k, v = repeat_kv_heads(k, heads), repeat_kv_heads(v, heads)
    if window is not None and window >= tokens:
        window = None  # the window covers every row
    if segments is None and window is None:
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)
    else:
        if segments is None:
            segments = torch.ones(batch, tokens, dtype=torch.long, device=q.device)
        mask = sequence_mask(segments, causal, window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    return o.transpose(1, 2).reshape(batch, tokens, o.shape[1] * o.shape[-1])


def flash_core_attention(q, k, v, *, heads, kv_heads, causal, rope_theta=None, positions=None, segments=None):
    """:func:`multi_head_attention_reference` (no window, no dropout) with the Triton flash kernels as
    the core (the token layout masked in them); RoPE runs in torch. The core of the
    ``torch_gemm_flash`` candidate."""
    from .fused_attention import flash_attention

    batch, tokens, _ = q.shape
    q, k, v = _heads(q, k, v, heads, kv_heads, None, rope_theta, positions, None, 1.0)
    o = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, segments=segments)
    return o.reshape(batch, tokens, heads * o.shape[-1])


def norm_attention_reference(x, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj, *, heads, kv_heads=None,
                             causal=False, rope_theta=None, norm="layer", eps=1e-6, row_scale=None,
                             positions=None, segments=None, core=multi_head_attention_reference):
    """H(x) = proj(attention(qkv(norm(x)))); qkv rows are [q (heads*hd), k (kv*hd), v (kv*hd)].
    ``positions`` / ``segments``: the token layout (see :func:`multi_head_attention_reference`);
    ``core``: the attention on the projections (:func:`multi_head_attention_reference`'s contract)."""
    kv_heads = kv_heads or heads
    head_dim = w_qkv.shape[0] // (heads + 2 * kv_heads)  # (of the whole width's heads, or a head group's)
    n = normalize_reference(x, norm_weight, norm_bias, norm=norm, eps=eps)
    q, k, v = F.linear(n, w_qkv, b_qkv).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    o = core(q, k, v, heads=heads, kv_heads=kv_heads, causal=causal, rope_theta=rope_theta, positions=positions,
             segments=segments)
    return apply_row_scale(F.linear(o, w_proj, b_proj), row_scale)


def norm_attention_couple(res, x, sign, frac_bits, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj, *, heads,
                          kv_heads=None, causal=False, rope_theta=None, norm="layer", eps=1e-6, row_scale=None,
                          scale: ResidualScale | None = None, positions=None, segments=None):
    """``res + sign * norm_attention(x)`` as ``(stream, port)`` (see revtriton.halves.base); a
    ``scale`` makes it a scaled coupling (streams.couple_output), applied in the couple epilogue.
    ``positions`` / ``segments`` [B, T]: padded or packed rows (:func:`sequence_mask`), in every
    candidate (the Triton kernels mask them without a T x T mask)."""
    kv_heads = kv_heads or heads
    check_attention_shapes(x, w_proj.shape[0], heads, kv_heads)
    layout = {name: t for name, t in (("positions", positions), ("segments", segments)) if t is not None}
    return run_op("norm_attention", res, x, sign, frac_bits, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj,
                  heads=heads, kv_heads=kv_heads, causal=causal, rope_theta=rope_theta, norm=norm, eps=eps,
                  row_scale=row_scale, **scale_option(scale), **layout)


def head_group_parts(kv_heads: int, wanted: int, tokens: int, dim: int) -> int:
    """Into how many head groups :func:`head_group` splits an attention of ``kv_heads`` key / value heads
    over samples of ``tokens`` tokens ``dim`` wide when ``wanted`` are asked for: the most that divide
    the kv heads, at most ``wanted``; 1 for samples of fewer tokens than ``dim``. (A group's backward
    makes a weight-sized gradient of the qkv projection, autograd's for a slice of it, where the whole
    half makes one: the groups save more than that where a sample's projections, ``tokens x 3 dim``,
    outweigh the weight, ``3 dim x dim``.)"""
    if tokens < dim:
        return 1
    return max(d for d in range(1, max(1, min(wanted, kv_heads)) + 1) if kv_heads % d == 0)


def head_group(weights, options, part: int, parts: int):
    """``norm_attention_couple``'s ``(weights, options)`` for head group ``part`` of ``parts``: H is the sum
    over its head groups of ``proj[:, group's columns](attention of the group's heads)``, the output
    projection's bias in the last group's (whose graph so reaches every parameter). Each group's q rows
    and its k / v heads (grouped-query attention keeps a q head with its kv head: ``parts`` divides the
    kv heads, :func:`head_group_parts`). The group's rows of the weights are gathered in one
    ``index_select`` (its backward: one weight-sized gradient, where a slice per q / k / v would make
    three and their sum). ReversibleStack(token_chunk=) computes a long
    sample's attention half so, one group's projections alive at a time (engine.rows)."""
    norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj = weights
    heads = options["heads"]
    kv_heads = options.get("kv_heads") or heads
    if not 0 <= part < parts or kv_heads % parts:
        raise ValueError(f"head group {part} of {parts}: the groups must divide the {kv_heads} kv heads")
    head_dim = w_qkv.shape[0] // (heads + 2 * kv_heads)
    q_rows, kv_rows = heads // parts * head_dim, kv_heads // parts * head_dim
    starts = (part * q_rows, heads * head_dim + part * kv_rows, (heads + kv_heads) * head_dim + part * kv_rows)
    index = torch.cat([torch.arange(start, start + size, device=w_qkv.device)
                       for start, size in zip(starts, (q_rows, kv_rows, kv_rows))])

    def rows(t):
        return None if t is None else t.index_select(0, index)

    group = (norm_weight, norm_bias, rows(w_qkv), rows(b_qkv), w_proj[:, part * q_rows:(part + 1) * q_rows],
             b_proj if part == parts - 1 else None)
    return group, dict(options, heads=heads // parts, kv_heads=kv_heads // parts)


# --------------------------------------------------------------------------------------------
# The candidates (ops.backend)


_fused = kept_import("fused_attention")  # its module, imported at the first fused call


def _norm_attention_triton(res, x, sign, frac_bits, *weights, **options):
    return _fused().fused_norm_attention_couple(res, x, sign, frac_bits, *weights, **options)


def _norm_attention_torch(res, x, sign, frac_bits, *weights, scale=None, **options):
    return library_couple_output(res, norm_attention_reference(x, *weights, **options), sign, frac_bits, scale)


def _norm_attention_triton_gemm_sdpa(res, x, sign, frac_bits, *weights, **options):
    return _fused().fused_norm_attention_couple(res, x, sign, frac_bits, *weights, core="sdpa", **options)


def _norm_attention_torch_gemm_flash(res, x, sign, frac_bits, *weights, scale=None, **options):
    h = norm_attention_reference(x, *weights, core=flash_core_attention, **options)
    return library_couple_output(res, h, sign, frac_bits, scale)


def _triton_supports(args, options) -> bool:
    from .fused_attention import SUPPORTED_HEAD_DIMS

    return triton_dtypes(args, options) and args[1].shape[-1] // options["heads"] in SUPPORTED_HEAD_DIMS


def _bind_fused(args, options, call_key):
    return _fused().bind_norm_attention_couple(args, options, call_key)


backend.register_op("norm_attention", lambda args, options: backend.couple_key(args, options, tokens=True))
backend.register_candidate("norm_attention", "triton", _norm_attention_triton, available=triton_runs_on,
                           supports=_triton_supports, planned=True, bind=_bind_fused)
backend.register_candidate("norm_attention", "torch", _norm_attention_torch)
backend.register_candidate("norm_attention", "triton_gemm_sdpa", _norm_attention_triton_gemm_sdpa,
                           available=triton_runs_on, supports=_triton_supports, planned=True, bind=_bind_fused)
backend.register_candidate("norm_attention", "torch_gemm_flash", _norm_attention_torch_gemm_flash,
                           available=triton_runs_on, supports=_triton_supports)
