"""Flash attention launchers and the fused norm+attention coupling half (Triton), with references.

Attention tensors use the layout of the packed QKV GEMM output, so no copy sits between the
GEMM and the attention kernel: q [B, T, H, D], k and v [B, T, KV, D] (any batch / token / head
strides, unit stride on D), o [B, T, H, D]; lse and delta [B, H, T] fp32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import dispatch, gemm, limits, norm_rows
from .graph import backward_keeps_graph
from .launches import LaunchPlan, PlanCache, cdiv, plan_key, unused_pointer
from .reference import repeat_kv_heads, rope_tables_at, rotate_half_reference, sequence_mask
from .streams import (ResidualScale, check_frac_bits, check_residual_scale, couple_result, function_outputs,
                      port_gradient, residual_gradient)
from .tma import ensure_descriptor_allocator, strides_tma_ready, tma_aligned

from revtriton.kernels.configs import next_power_of_2  # kernels/ (revtriton/__init__.py maps it in a checkout)

SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 8))  # kernels/attention.py HEAD_DIMS: multiples of 8, 16..256


def _attention_kernels():
    from revtriton.kernels import attention

    return attention


# --------------------------------------------------------------------------------------------
# Checks


def check_head_dim(head_dim: int):
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported by the Triton attention kernels "
                         f"(supported: every multiple of 8 from 16 to 256)")


def _check_attention_inputs(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on head_dim, got strides {t.stride()}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q, k, v must share one of fp16 / bf16 / fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    batch, tokens, heads, head_dim = q.shape
    if k.shape[0] != batch or k.shape[1] != tokens or k.shape[3] != head_dim:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} (batch, tokens, head_dim)")
    if heads % k.shape[2]:
        raise ValueError(f"kv_heads ({k.shape[2]}) must divide heads ({heads})")
    check_head_dim(head_dim)
    if tokens == 0 or batch == 0:
        raise ValueError(f"empty attention input {tuple(q.shape)}")


def _dot_precision(dtype):
    # fp32 inputs get full fp32 products (the tests' 1e-5 bar); 16-bit inputs ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides_bth(t):
    return t.stride(0), t.stride(1), t.stride(2)


# --------------------------------------------------------------------------------------------
# Flash attention: references


def _expand_kv(q, k, v):
    """[B, T, heads, D] -> [B, heads, T, D] with kv heads repeated for GQA."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return q, repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1])


def attention_fwd_reference(q, k, v, *, causal: bool, sm_scale: float | None = None):
    """(o [B, T, H, D], lse [B, H, T] fp32) in torch; same layout as :func:`attention_fwd`."""
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh = _expand_kv(q, k, v)
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=sm_scale)
    scores = (qh.float() @ kh.float().transpose(-1, -2)) * sm_scale
    if causal:
        tokens = q.shape[1]
        keep = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return o.transpose(1, 2).contiguous(), torch.logsumexp(scores, dim=-1)


def attention_bwd_reference(q, k, v, do, *, causal: bool, sm_scale: float | None = None, rope=None):
    """(dq, dk, dv) by autograd through SDPA; with ``rope=(cos, sin)`` ([T, D/2] each), dq and dk are
    taken back through the rotation (q and k are the rotated tensors), as :func:`attention_bwd` does."""
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        qh, kh, vh = _expand_kv(*leaves)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=sm_scale).transpose(1, 2)
        dq, dk, dv = torch.autograd.grad(o, leaves, do)
    if rope is not None:
        dq, dk = rope_unrotate_reference(dq, *rope), rope_unrotate_reference(dk, *rope)
    return dq, dk, dv


def rope_tables(tokens: int, head_dim: int, theta: float, device):
    """cos, sin [tokens, head_dim / 2] fp32 (rotate-half RoPE; both halves share the angles)."""
    return rope_tables_at(torch.arange(tokens, device=device), head_dim, theta)


def rope_rotate_reference(t, cos, sin):
    """t [B, T, heads, D] rotated (the QKV epilogue's layout); cos/sin [T, D/2], or [B, T, D/2] (a table
    per row): :func:`~revtriton.ops.reference.rotate_half_reference` with the tables over the heads."""
    return rotate_half_reference(t, cos.unsqueeze(-2), sin.unsqueeze(-2))


def rope_unrotate_reference(t, cos, sin):
    """The transpose (= inverse) of :func:`rope_rotate_reference`: the RoPE backward."""
    return rope_rotate_reference(t, cos, -sin)


# --------------------------------------------------------------------------------------------
# Flash attention: launchers


# The last layout's kernel arguments: every layer of a model (and the backward's rebuild and
# gradient passes) gets the same segments tensor, so they are made once a step, not per call.
# Keyed on the tensor itself (held here, so its identity cannot be reused), its version (an
# in-place change makes them again) and the current CUDA stream: arguments are only reused on the
# stream that made them, so freeing them (when the entry is replaced) can never race a kernel of
# another stream (PaReprop's side stream makes its own).
_last_segment_args: tuple | None = None


def _segment_args(segments, batch: int, tokens: int, causal: bool, like: torch.Tensor):
    """(SEG, SELF_UNTIL, stride, SPANS) kernel arguments of padded / packed rows, ``segments`` [B, T]
    as :func:`revtriton.ops.attention.sequence_mask` reads them (0: padding, k >= 1: the row's k-th
    sequence); dummies without. SELF_UNTIL [B]: a padding query before it has no real key to see
    (causal: the row's first real token; otherwise T when the row has none, else 0), so it sees itself.
    SPANS: :func:`segment_spans`."""
    global _last_segment_args
    if segments is None:
        unused = unused_pointer(like)
        return unused, unused, 0, unused
    if not isinstance(segments, torch.Tensor) or tuple(segments.shape) != (batch, tokens):
        raise ValueError(f"segments must be a [{batch}, {tokens}] tensor, got "
                         f"{tuple(segments.shape) if isinstance(segments, torch.Tensor) else type(segments).__name__}")
    cacheable = not segments.is_inference()  # (inference tensors have no version counter)
    stream = torch.cuda.current_stream(like.device).cuda_stream if like.is_cuda else None
    key = (segments._version, causal, like.device, stream) if cacheable else None
    last = _last_segment_args
    if cacheable and last is not None and last[0] is segments and last[1] == key:
        return last[2]
    seg = segments.to(device=like.device, dtype=torch.int32).contiguous()
    real = seg != 0
    has_real = real.any(1)
    first_real = real.to(torch.int32).argmax(1) if causal else torch.zeros_like(has_real, dtype=torch.int64)
    self_until = torch.where(has_real, first_real, tokens).to(torch.int32).contiguous()
    args = seg, self_until, seg.stride(0), segment_spans(seg, self_until)
    if cacheable:
        _last_segment_args = (segments, key, args)
    return args


def segment_spans(seg: torch.Tensor, self_until: torch.Tensor) -> torch.Tensor:
    """int32 [B, 6, T]: per token, [first, end) of the keys it may see as a query (rows 0, 1) and of
    the queries that may see it as a key (rows 2, 3), under the kernels' mask (see kernels/attention.py
    key_codes / query_bounds), and [first, end) of its run (rows 4, 5).

    Spans: supersets are fine (the mask still applies inside); the kernels skip the blocks outside a
    program's union. A real token's sequence spans its first to last token; a padding query that sees
    every real key spans the row's real tokens; one that sees only itself, itself. Codes above T share
    one bucket and rows with a negative code span the whole row (both only widen spans).

    Runs: exact, never wider. A real token's run is the stretch of consecutive tokens with its code
    around it (every query of it sees every key of it, causality aside); a padding token has none,
    [T, 0). Where a program's rows all share one run, the blocks inside it need no mask (the kernels'
    unmasked loop). No host sync."""
    batch, tokens = seg.shape
    pos = torch.arange(tokens, device=seg.device).expand(batch, tokens)
    real = seg != 0
    alone = ~real & (pos < self_until[:, None])
    sees_all = ~real & ~alone  # padding queries that see every real key

    def first_end(mask):  # [first, end) of a row's True entries, [T, 0) when none
        some = mask.any(1, keepdim=True)
        first = torch.where(some, mask.int().argmax(1, keepdim=True), tokens)
        end = torch.where(some, tokens - mask.flip(1).int().argmax(1, keepdim=True), 0)
        return first, end

    bucket = seg.clamp(0, tokens).long()
    own_first = torch.full((batch, tokens + 1), tokens, device=seg.device).scatter_reduce(1, bucket, pos, "amin")
    own_end = torch.full((batch, tokens + 1), 0, device=seg.device).scatter_reduce(1, bucket, pos + 1, "amax")
    own_first, own_end = own_first.gather(1, bucket), own_end.gather(1, bucket)
    real_first, real_end = first_end(real)
    all_first, all_end = first_end(sees_all)
    key_first = torch.where(real, own_first, torch.where(alone, pos, real_first))
    key_end = torch.where(real, own_end, torch.where(alone, pos + 1, real_end))
    query_first = torch.where(real, torch.minimum(own_first, all_first), torch.where(alone, pos, tokens))
    query_end = torch.where(real, torch.maximum(own_end, all_end), torch.where(alone, pos + 1, 0))
    spans = torch.stack([key_first, key_end, query_first, query_end], 1)
    whole = torch.tensor([0, tokens, 0, tokens], device=seg.device)[None, :, None]
    spans = torch.where((seg < 0).any(1)[:, None, None], whole, spans)
    return torch.cat([spans, torch.stack(segment_runs(seg), 1)], 1).to(torch.int32).contiguous()


def segment_runs(seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T], [B, T]): per token, the first token and the end of the stretch of consecutive tokens
    with its code (padding tokens: T and 0, no run)."""
    batch, tokens = seg.shape
    pos = torch.arange(tokens, device=seg.device).expand(batch, tokens)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    ends = torch.ones_like(seg, dtype=torch.bool)
    ends[:, :-1] = starts[:, 1:]
    run_first = torch.where(starts, pos, 0).cummax(1).values
    run_end = torch.where(ends, pos + 1, tokens).flip(1).cummin(1).values.flip(1)
    real = seg != 0
    return torch.where(real, run_first, tokens), torch.where(real, run_end, 0)


class AttentionForwardLaunch:
    """:func:`attention_fwd` for one signature (q, k, v and ``out``'s shapes, strides, dtype and
    device; causal; segments or not): its checks and arguments worked out at construction, then
    called with each call's tensors."""

    launcher = "attention_fwd"  # (aot.recording_launches names launches by it)
    __slots__ = ("kernel", "out_shape", "dtype", "device", "lse_shape", "grid", "qkv_strides", "out_strides", "tail",
                 "meta", "causal", "segments", "kv_strides_ready")

    def __init__(self, q, k, v, *, causal: bool, sm_scale: float | None = None, out=None, segments=None):
        _check_attention_inputs(q, k, v)
        batch, tokens, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
            raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor with unit stride on head_dim")
        self.out_shape, self.dtype, self.device = (batch, tokens, heads, head_dim), q.dtype, q.device
        self.lse_shape = (batch, heads, tokens)
        self.causal, self.segments = bool(causal), segments is not None
        kernels = _attention_kernels()
        self.kernel = kernels.attention_fwd_kernel
        grid = lambda meta: (cdiv(tokens, meta["BLOCK_M"]) * batch * heads,)  # noqa: E731
        limits.check_grid("attention_fwd", grid({"BLOCK_M": 16}))
        self.grid = grid
        # K / V may be copied at a call (to an aligned layout): their strides are then the copy's.
        self.qkv_strides = (_strides_bth(q), _strides_bth(k), _strides_bth(v))
        self.kv_strides_ready = strides_tma_ready(k), strides_tma_ready(v)  # (the base addresses: each call's)
        self.out_strides = _strides_bth(out) if out is not None else (tokens * heads * head_dim, heads * head_dim,
                                                                      head_dim)
        self.tail = (batch, heads, kv_heads, tokens, kernels.seq_bucket(tokens), sm_scale)
        self.meta = dict(HEAD_DIM=head_dim, HEAD_PAD=kernels.head_pad(head_dim), CAUSAL=bool(causal),
                         SEGMENTS=segments is not None, DOT_PRECISION=_dot_precision(q.dtype))

    def __call__(self, q, k, v, out=None, segments=None):
        if out is None:
            out = torch.empty(self.out_shape, device=self.device, dtype=self.dtype)
        q_strides, k_strides, v_strides = self.qkv_strides
        if self.device.type != "meta":  # (meta: the static model's recording; the packed layout is aligned)
            # K / V arrive by TMA on sm_90: odd views are copied once to an aligned layout.
            k_ready, v_ready = self.kv_strides_ready
            if not (k_ready and tma_aligned(k)):
                k = k.contiguous()
                k_strides = _strides_bth(k)
            if not (v_ready and tma_aligned(v)):
                v = v.contiguous()
                v_strides = _strides_bth(v)
            ensure_descriptor_allocator(self.device)
        lse = torch.empty(self.lse_shape, device=self.device, dtype=torch.float32)
        batch, heads, _, tokens = self.tail[:4]
        seg, self_until, stride_segb, spans = _segment_args(segments, batch, tokens, self.causal, lse)
        dispatch.launch(self.kernel, self.grid, q, k, v, out, lse, seg, self_until, spans, *q_strides, *k_strides,
                        *v_strides, *self.out_strides, stride_segb, *self.tail, **self.meta)
        return out, lse


def attention_fwd(q, k, v, *, causal: bool, sm_scale: float | None = None, out=None, segments=None):
    """Flash attention forward: (o [B, T, H, D], lse [B, H, T] fp32). One launch.

    ``out`` (optional) is a [B, T, H, D] tensor to write o into (e.g. a view of the out-projection's
    input buffer). ``segments`` [B, T] (optional): padded / packed rows (see :func:`_segment_args`),
    masked in the kernel (no T x T mask).
    """
    launch = AttentionForwardLaunch(q, k, v, causal=causal, sm_scale=sm_scale, out=out, segments=segments)
    return launch(q, k, v, out, segments)


class AttentionBackwardLaunch:
    """:func:`attention_bwd` for one signature (the tensors' shapes, strides, dtypes and device; causal;
    the RoPE tables' layout; segments or not): its checks, grids and switches worked out at
    construction, then called with each call's tensors (the fused half's backward keeps one in its
    launch plan)."""

    launcher = "attention_bwd"  # (aot.recording_launches names launches by it)
    __slots__ = ("dims", "sm_scale", "causal", "stride_ropeb", "options", "dq_grid", "dkdv_grid",
                 "tma_strides", "kernels")

    def __init__(self, q, k, v, o, lse, do, *, causal: bool, sm_scale: float | None = None, rope=None,
                 dq=None, dk=None, dv=None, segments=None):
        _check_attention_inputs(q, k, v)
        batch, tokens, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        for name, t in (("o", o), ("do", do)):
            if t.shape != q.shape or t.stride(-1) != 1:
                raise ValueError(f"{name} must be {tuple(q.shape)} with unit stride on head_dim, got {tuple(t.shape)}")
        if lse.shape != (batch, heads, tokens) or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise ValueError(f"lse must be a contiguous fp32 [{batch}, {heads}, {tokens}] tensor")
        for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if t is not None and (t.shape != like.shape or t.dtype != like.dtype or t.stride(-1) != 1):
                raise ValueError(f"{name} must be a {tuple(like.shape)} {like.dtype} tensor with unit stride on "
                                 f"head_dim")
        self.stride_ropeb = 0
        if rope is not None:
            cos, sin = rope
            if cos.shape not in ((tokens, head_dim // 2), (batch, tokens, head_dim // 2)) or sin.shape != cos.shape:
                raise ValueError(f"rope tables must be [{tokens}, {head_dim // 2}] or [{batch}, {tokens}, "
                                 f"{head_dim // 2}], got {tuple(cos.shape)}")
            self.stride_ropeb = head_dim // 2 * tokens if cos.dim() == 3 else 0  # (the contiguous fp32 copy's)
        self.dims = (batch, heads, kv_heads, tokens)
        self.causal = bool(causal)
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.kernels = kernels = _attention_kernels()
        self.dq_grid = lambda meta: (cdiv(tokens, meta["BLOCK_FIXED"]) * batch * heads,)  # noqa: E731
        self.dkdv_grid = lambda meta: (cdiv(tokens, meta["BLOCK_FIXED"]) * batch * kv_heads,)  # noqa: E731
        limits.check_grid("attention_bwd", self.dq_grid({"BLOCK_FIXED": 16}))
        self.options = dict(HEAD_DIM=head_dim, HEAD_PAD=kernels.head_pad(head_dim), CAUSAL=self.causal,
                            ROPE=rope is not None, SEGMENTS=segments is not None, DOT_PRECISION=_dot_precision(q.dtype))
        # Tiles arrive by TMA on sm_90: a view whose strides (the signature's) or base address (each
        # call's) cannot be described is copied once to an aligned layout.
        self.tma_strides = tuple(strides_tma_ready(t, q.element_size()) for t in (q, k, v, do))  # (do: cast to q's)

    def __call__(self, q, k, v, o, lse, do, rope=None, dq=None, dk=None, dv=None, segments=None):
        batch, heads, kv_heads, tokens = self.dims
        if do.dtype != q.dtype:
            do = do.to(q.dtype)
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        if rope is not None:
            cos, sin = (t.float().contiguous() for t in rope)
        else:
            cos = sin = unused_pointer(lse)
        seg, self_until, stride_segb, spans = _segment_args(segments, batch, tokens, self.causal, lse)
        if q.device.type != "meta":  # (meta: the static model's recording; the packed layout is aligned)
            q, k, v, do = (t if ready and tma_aligned(t) else t.contiguous()
                           for t, ready in zip((q, k, v, do), self.tma_strides))
            ensure_descriptor_allocator(q.device)
        delta = torch.empty_like(lse)
        kernels, bucket = self.kernels, self.kernels.seq_bucket(tokens)
        q_s, k_s, v_s, do_s = _strides_bth(q), _strides_bth(k), _strides_bth(v), _strides_bth(do)
        tail = (self.stride_ropeb, batch, heads, kv_heads, tokens, bucket, self.sm_scale)
        # dq first: it writes delta = rowsum(dO * O), which the dk/dv pass reads.
        dispatch.launch(kernels.attention_bwd_dq_kernel, self.dq_grid, q, k, v, o, do, lse, delta, dq, cos, sin, seg,
                        self_until, spans, *q_s, *k_s, *v_s, *_strides_bth(o), *do_s, *_strides_bth(dq), stride_segb,
                        *tail, **self.options)
        dispatch.launch(kernels.attention_bwd_dkdv_kernel, self.dkdv_grid, q, k, v, do, lse, delta, dk, dv, cos, sin,
                        seg, self_until, spans, *q_s, *k_s, *v_s, *do_s, *_strides_bth(dk), *_strides_bth(dv),
                        stride_segb, *tail, **self.options)
        return dq, dk, dv


def attention_bwd(q, k, v, o, lse, do, *, causal: bool, sm_scale: float | None = None, rope=None,
                  dq=None, dk=None, dv=None, segments=None):
    """Flash attention backward: (dq, dk, dv). Two launches: dq (with the delta pre-pass fused), then dk/dv.

    Deterministic (no atomics). ``rope=(cos, sin)`` ([T, D/2] fp32, or [B, T, D/2]: one table per
    batch row, at its positions): q and k were rotated before attention, so dq and dk are rotated
    back (the RoPE backward) before they are stored. dq / dk / dv (optional) are tensors to write
    into (e.g. views of a packed dqkv buffer). ``segments``: as :func:`attention_fwd`'s.
    """
    launch = AttentionBackwardLaunch(q, k, v, o, lse, do, causal=causal, sm_scale=sm_scale, rope=rope, dq=dq, dk=dk,
                                     dv=dv, segments=segments)
    return launch(q, k, v, o, lse, do, rope, dq, dk, dv, segments)


class FlashAttention(torch.autograd.Function):
    """The Triton attention core as an autograd op on [B, T, H, D] q and [B, T, KV, D] k, v: the
    core of the library-GEMM candidate (cuBLAS projections, Triton flash attention)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, segments):
        o, lse = attention_fwd(q, k, v, causal=causal, segments=segments)
        ctx.causal = causal
        ctx.save_for_backward(q, k, v, o, lse, segments)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, segments = ctx.saved_tensors
        if do.stride(-1) != 1:
            do = do.contiguous()
        dq, dk, dv = attention_bwd(q, k, v, o, lse, do, causal=ctx.causal, segments=segments)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, *, causal: bool, segments=None):
    """o [B, T, H, D] = softmax(q k^T / sqrt(D)) v with the Triton kernels, differentiable (GQA: k and
    v have KV heads; ``segments``: padded / packed rows, see :func:`attention_fwd`). Two launches
    backward, one forward."""
    return FlashAttention.apply(q, k, v, bool(causal), segments)


# --------------------------------------------------------------------------------------------
# SDPA as the attention core of the fused half (its other candidate core)


def _sdpa_core(qkv, plan, keep_graph: bool):
    """Attention of the packed, rotated qkv [M, (H + 2 KV) D] by SDPA (flash / cuDNN / efficient on a
    GPU). Returns (o [B, T, H, D] contiguous, graph): ``graph`` = (SDPA's output, the qkv leaf) for
    :func:`_sdpa_core_backward` when ``keep_graph``, else None."""
    leaf = qkv.detach().requires_grad_() if keep_graph else qkv
    with torch.set_grad_enabled(keep_graph):
        q, k, v = (t.transpose(1, 2) for t in _split_heads(leaf, plan.batch, plan.tokens, plan.heads,
                                                             plan.kv_heads, plan.head_dim))
        # padded / packed rows: the library path's [B, 1, T, T] mask (causal inside it)
        mask = None if plan.segments is None else sequence_mask(plan.segments, plan.causal)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=plan.causal and mask is None,
                                           enable_gqa=plan.kv_heads != plan.heads)
    rows = o.detach().transpose(1, 2).contiguous()
    return rows, ((o, leaf) if keep_graph else None)


def _sdpa_core_backward(graph, do, plan, retain: bool):
    """dqkv [M, (H + 2 KV) D] from SDPA's graph, with dq and dk taken back through the RoPE of the
    QKV epilogue (the rotation's transpose), as attention_bwd does in its kernels."""
    o, leaf = graph
    grad_o = do.view(plan.batch, plan.tokens, plan.heads, plan.head_dim).transpose(1, 2).to(o.dtype)
    dqkv, = torch.autograd.grad(o, leaf, grad_o, retain_graph=retain)
    if plan.rope is not None:
        packed = dqkv.view(plan.batch, plan.tokens, plan.heads + 2 * plan.kv_heads, plan.head_dim)
        rotated = plan.heads + plan.kv_heads
        packed[:, :, :rotated] = rope_unrotate_reference(packed[:, :, :rotated], *plan.rope)
    return dqkv


# --------------------------------------------------------------------------------------------
# QKV projection: norm prologue, bias + RoPE epilogue (kernels/attention_qkv.py)


def _qkv_kernels():
    from revtriton.kernels import attention_qkv

    return attention_qkv


_ROPE_CACHE: dict = {}


def cached_rope_tables(tokens: int, head_dim: int, theta: float, device):
    """:func:`rope_tables`, kept per (tokens, head_dim, theta, device): a few KiB each."""
    key = (tokens, head_dim, float(theta), torch.device(device))
    if key not in _ROPE_CACHE:
        if len(_ROPE_CACHE) > 32:
            _ROPE_CACHE.clear()
        _ROPE_CACHE[key] = rope_tables(tokens, head_dim, theta, device)
    return _ROPE_CACHE[key]


def qkv_projection_reference(n, w_qkv, b_qkv, *, heads, kv_heads, tokens, rope=None):
    """[M, (H + 2 KV) D] = rope(n @ W^T + b) on the q and k heads; n [M, dim] normalized rows (M = B * tokens)."""
    qkv = n.float() @ w_qkv.float().t()
    if b_qkv is not None:
        qkv = qkv + b_qkv.float()
    if rope is not None:
        head_dim = w_qkv.shape[0] // (heads + 2 * kv_heads)
        rows = qkv.shape[0]
        rotated = qkv[:, :(heads + kv_heads) * head_dim].reshape(rows // tokens, tokens, heads + kv_heads, head_dim)
        rotated = rope_rotate_reference(rotated, *rope).reshape(rows, -1)
        qkv = torch.cat([rotated, qkv[:, (heads + kv_heads) * head_dim:]], dim=1)
    return qkv.to(w_qkv.dtype)


class QKVLaunch:
    """:func:`qkv_projection` for one signature (n, w_qkv, b_qkv and the RoPE tables' metadata, the
    head counts, tokens): its checks and arguments at construction, then called with each call's
    tensors."""

    launcher = "qkv_projection"  # (aot.recording_launches names launches by it)
    __slots__ = ("kernel", "rows", "cols", "dtype", "device", "grid", "args", "tma_possible", "meta", "meta_tma")

    def __init__(self, n, w_qkv, b_qkv, *, heads, kv_heads, tokens, rope=None):
        if not isinstance(n, torch.Tensor) or n.dim() != 2 or n.stride(1) != 1:
            raise ValueError(f"n must be a 2-D [tokens, dim] tensor with unit column stride, got "
                             f"{tuple(n.shape) if isinstance(n, torch.Tensor) else type(n).__name__}")
        M, dim = n.shape
        N = w_qkv.shape[0]
        if w_qkv.dim() != 2 or w_qkv.shape[1] != dim or N % (heads + 2 * kv_heads):
            raise ValueError(f"w_qkv {tuple(w_qkv.shape)} is not [(heads + 2 kv_heads) * head_dim, {dim}]")
        head_dim = N // (heads + 2 * kv_heads)
        check_head_dim(head_dim)
        if n.dtype != w_qkv.dtype:
            raise TypeError(f"n dtype {n.dtype} != w_qkv dtype {w_qkv.dtype}: GEMM operands are raw, in one dtype")
        if M % tokens:
            raise ValueError(f"{M} rows are not a whole number of {tokens}-token sequences")
        if b_qkv is not None and (b_qkv.shape != (N,) or b_qkv.stride(0) != 1):
            raise ValueError(f"b_qkv must be a contiguous [{N}] vector, got {tuple(b_qkv.shape)}")
        table_rows = tokens
        if rope is not None:
            cos, sin = rope
            if cos.shape not in ((tokens, head_dim // 2), (M, head_dim // 2)) or sin.shape != cos.shape \
                    or cos.dtype != torch.float32:
                raise ValueError(f"rope tables must be fp32 [{tokens} or {M}, {head_dim // 2}]")
            table_rows = cos.shape[0]  # the kernel reads row r's angles at r % table_rows
        self.rows, self.cols, self.dtype, self.device = M, N, w_qkv.dtype, n.device
        self.kernel = _qkv_kernels().qkv_rope_gemm_kernel
        total_heads = heads + 2 * kv_heads
        column_tiles = lambda meta: cdiv(total_heads, meta["HEADS_PER_TILE"])  # noqa: E731
        self.grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * column_tiles(meta),)  # noqa: E731
        self.args = (M, N, dim, table_rows, total_heads, heads + kv_heads, next_power_of_2(M),
                     n.stride(0), w_qkv.stride(0), w_qkv.stride(1), N)  # the output: a fresh [M, N]
        # sm_90 configs load by TMA where both operands can be described: 16-bit, W read K-major ([N, K]
        # rows of an nn.Linear weight), 16-byte aligned rows (the kernel also needs a power-of-two head
        # dim). The strides decide here, the base addresses at each call.
        self.tma_possible = (n.element_size() == 2 and w_qkv.stride(1) == 1 and strides_tma_ready(n)
                             and strides_tma_ready(w_qkv))
        self.meta, self.meta_tma = (dict(
            HAS_BIAS=b_qkv is not None, ROPE=rope is not None, HEAD_DIM=head_dim,
            HEAD_PAD=_attention_kernels().head_pad(head_dim), DOT_PRECISION=_dot_precision(w_qkv.dtype),
            TMA_READY=tma) for tma in (False, True))

    def __call__(self, n, w_qkv, b_qkv, rope=None):
        out = torch.empty(self.rows, self.cols, device=self.device, dtype=self.dtype)
        if self.rows == 0:
            return out
        cos, sin = rope if rope is not None else (unused_pointer(out),) * 2
        tma = self.tma_possible and tma_aligned(n) and tma_aligned(w_qkv)
        if tma:
            ensure_descriptor_allocator(self.device)
        bias = unused_pointer(out) if b_qkv is None else b_qkv
        dispatch.launch(self.kernel, self.grid, n, w_qkv, bias, out, cos, sin, *self.args,
                        **(self.meta_tma if tma else self.meta))
        return out


def qkv_projection(n, w_qkv, b_qkv, *, heads, kv_heads, tokens, rope=None):
    """One launch: ``rope(n @ w_qkv.T + b_qkv)`` -> packed qkv [M, (H + 2 KV) * D] in w_qkv's dtype.

    n [M, dim]: the normalized rows (``norm_rows.normalize``) in the GEMM operand dtype, w_qkv's
    (rows are batch-major tokens, M = B * tokens); rope = (cos, sin) [tokens, D/2] (shared by the
    sequences), [M, D/2] (a table per row: packed or padded rows' positions) or None.
    """
    return QKVLaunch(n, w_qkv, b_qkv, heads=heads, kv_heads=kv_heads, tokens=tokens, rope=rope)(n, w_qkv, b_qkv, rope)


# --------------------------------------------------------------------------------------------
# The fused norm+attention coupling half


def _split_heads(qkv, batch, tokens, heads, kv_heads, head_dim):
    """Views q [B, T, H, D], k and v [B, T, KV, D] into the packed [M, (H + 2 KV) D] buffer."""
    packed = qkv.view(batch, tokens, heads + 2 * kv_heads, head_dim)
    # One split (one op, about 3 us of host time) where three slices cost about 11.
    return packed.split_with_sizes((heads, kv_heads, kv_heads), 2)


def _compute_dtype(x, w_qkv):
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return w_qkv.dtype


def _check_fused_inputs(res, x, frac_bits, w_qkv, w_proj, heads, kv_heads, norm, rope_theta, row_scale):
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"attention halves take [batch, tokens, dim] input, got "
                         f"{'rank ' + str(x.dim()) + ' ' + str(tuple(x.shape)) if isinstance(x, torch.Tensor) else x}")
    batch, tokens, dim = x.shape
    if not isinstance(heads, int) or heads <= 0 or dim % heads:
        raise ValueError(f"heads ({heads}) must divide dim ({dim})")
    if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    check_head_dim(dim // heads)
    if norm not in ("layer", "rms"):
        raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
    head_dim = dim // heads
    if w_qkv.shape != ((heads + 2 * kv_heads) * head_dim, dim):
        raise ValueError(f"w_qkv {tuple(w_qkv.shape)} != [{(heads + 2 * kv_heads) * head_dim}, {dim}]")
    if w_proj.shape != (dim, heads * head_dim):
        raise ValueError(f"w_proj {tuple(w_proj.shape)} != [{dim}, {heads * head_dim}]")
    if res.shape != x.shape:
        raise ValueError(f"res {tuple(res.shape)} must have the shape of x {tuple(x.shape)}")
    if frac_bits is None and not res.is_floating_point():
        raise TypeError(f"a float residual stream must be floating point, got {res.dtype}")
    if frac_bits is not None and res.dtype != torch.int32:
        raise TypeError(f"an exact residual stream must be int32, got {res.dtype}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be fp16 / bf16 / fp32, got {x.dtype}")
    if row_scale is not None and row_scale.shape != x.shape[:-1]:
        raise ValueError(f"row_scale {tuple(row_scale.shape)} must be [batch, tokens] = {tuple(x.shape[:-1])}")
    if rope_theta is not None and not rope_theta > 0:
        raise ValueError(f"rope_theta must be positive or None, got {rope_theta!r}")


ATTENTION_CORES = ("triton", "sdpa")

# Couple plans (each with its forward's launches) by call signature: a repeated call skips the
# checks and the launch arguments' arithmetic (launches.LaunchPlan).
_plans = PlanCache()


def _check_layout(x, positions, segments):
    for name, t in (("positions", positions), ("segments", segments)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(x.shape[:2])
                              or t.is_floating_point()):
            raise ValueError(f"{name} must be an integer [batch, tokens] = {list(x.shape[:2])} tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")


class _Plan:
    """Shapes and switches of one couple call (constant across forward and backward)."""

    def __init__(self, x, sign, frac_bits, heads, kv_heads, causal, rope_theta, norm, eps, dot_dtype, core="triton",
                 positions=None, segments=None):
        if core not in ATTENTION_CORES:
            raise ValueError(f"core must be one of {ATTENTION_CORES}, got {core!r}")
        self.core = core  # the attention core between the two GEMMs: Triton flash kernels or SDPA
        self.batch, self.tokens, self.dim = x.shape
        self.rows = self.batch * self.tokens
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = self.dim // heads
        self.sign, self.frac_bits = sign, frac_bits
        self.causal, self.norm, self.eps = bool(causal), norm, eps
        self.dot_dtype = dot_dtype
        # RoPE tables [T, D/2] shared by the rows, or [B, T, D/2] at each row's ``positions``
        self.rope = None
        if rope_theta is not None:
            self.rope = (cached_rope_tables(self.tokens, self.head_dim, rope_theta, x.device) if positions is None
                         else rope_tables_at(positions.to(x.device), self.head_dim, rope_theta))
        self.segments = segments  # [B, T] padded / packed rows (ops.attention.sequence_mask), or None
        # The forward's launches, built at its first call (kept with the plan: launches.LaunchPlan).
        self.launches = LaunchPlan()


def _fused_forward(plan: _Plan, res, x, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj, row_scale, scale,
                   keep_graph=False):
    """The four launches (a coupling ``scale`` in the last one's epilogue). Returns (stream
    [B, T, dim], saved tensors for backward, SDPA's graph when the core is SDPA and ``keep_graph``).
    ``x`` and ``res`` go to the launches as they are when contiguous (gemm.row_operand)."""
    launches = plan.launches
    x2 = gemm.row_operand(x, plan.dim)
    n, mean, rstd = launches.launch(0, lambda: norm_rows.NormalizeLaunch(                               # launch 1
        gemm.as_rows(x2, plan.dim), norm=plan.norm, eps=plan.eps, norm_weight=norm_weight, norm_bias=norm_bias,
        out_dtype=plan.dot_dtype))(x2, norm_weight, norm_bias)
    rope = plan.rope
    if rope is not None and rope[0].dim() == 3:  # a table per row (positions): [B * T, D/2]
        rope = tuple(t.view(plan.rows, -1) for t in rope)
    qkv = launches.launch(1, lambda: QKVLaunch(n, w_qkv, b_qkv, heads=plan.heads, kv_heads=plan.kv_heads,  # launch 2
                                               tokens=plan.tokens, rope=rope))(n, w_qkv, b_qkv, rope)
    graph = lse = None
    if plan.core == "sdpa":
        o, graph = _sdpa_core(qkv, plan, keep_graph)
    else:
        q, k, v = _split_heads(qkv, plan.batch, plan.tokens, plan.heads, plan.kv_heads, plan.head_dim)
        o, lse = launches.launch(2, lambda: AttentionForwardLaunch(                                # launch 3
            q, k, v, causal=plan.causal, segments=plan.segments))(q, k, v, None, plan.segments)
    o2 = o.view(plan.rows, plan.heads * plan.head_dim)
    res2 = gemm.row_operand(res, plan.dim)
    stream = launches.launch(3, lambda: gemm.LinearCoupleLaunch(                                    # launch 4
        o2, w_proj, b_proj, gemm.as_rows(res2, plan.dim), plan.sign, frac_bits=plan.frac_bits, row_scale=row_scale,
        scale=scale, out_shape=res.shape))(o2, w_proj, b_proj, res2, row_scale, scale)
    return stream, (x2, mean, rstd, n, qkv, o, lse), graph


def _fused_backward(plan: _Plan, g, x2, mean, rstd, n, qkv, o, lse, norm_weight, norm_bias, w_qkv, w_proj,
                    row_scale, param_dtypes, need_dx=True, sdpa_graph=None, retain=False):
    """Gradients of sign * H(x) given g = d loss / d stream: ten launches (nine without biases),
    every weight gradient a raw GEMM (split-K partials when it cannot fill the GPU), every bias and
    norm-parameter gradient a partial sum reduced in one fixed-order launch at the end (no
    weight-sized temporaries in torch)."""
    dt, rows = plan.dot_dtype, plan.rows
    gamma_dtype, beta_dtype, w_qkv_dtype, b_qkv_dtype, w_proj_dtype, b_proj_dtype = param_dtypes
    g2 = gemm.as_rows(g, plan.dim)
    x2 = gemm.as_rows(x2, plan.dim)  # (the forward kept x as it came: [B, T, dim] when contiguous)
    # The backward's launches, kept in the plan per gradient layout and per gradients asked for.
    back = plan.launches.launch(("backward", tuple(param_dtypes), need_dx, g2.stride(), g2.dtype), LaunchPlan)
    # out-projection: gs = sign * row_scale * g in the operand dtype (db_proj partials on the way),
    # dO = gs @ W_proj, dW_proj = gs^T @ o.
    gs, db_proj = back.launch(0, lambda: gemm.ScaleRowsLaunch(                                        # launch 1
        g2, alpha=plan.sign, row_scale=row_scale, out_dtype=dt, col_sums=b_proj_dtype is not None,
        sums_dtype=b_proj_dtype))(g2, row_scale)
    do = back.launch(1, lambda: gemm.LinearInputGradLaunch(gs, w_proj, out_dtype=dt))(gs, w_proj)   # launch 2
    pending = []
    dw_proj = dw_qkv = None
    if w_proj_dtype is not None:
        o2 = o.view(rows, -1)
        dw_proj = back.launch(2, lambda: gemm.LinearWeightGradLaunch(gs, o2, out_dtype=w_proj_dtype))(  # launch 3
            gs, o2, pending)
    # attention (+ RoPE backward), written straight into the packed dqkv buffer.
    if plan.core == "sdpa":
        dqkv = _sdpa_core_backward(sdpa_graph, do, plan, retain)
    else:
        dqkv = torch.empty_like(qkv)
        q, k, v = _split_heads(qkv, plan.batch, plan.tokens, plan.heads, plan.kv_heads, plan.head_dim)
        dq, dk, dv = _split_heads(dqkv, plan.batch, plan.tokens, plan.heads, plan.kv_heads, plan.head_dim)
        do = do.view(o.shape)
        back.launch(7, lambda: AttentionBackwardLaunch(q, k, v, o, lse, do, causal=plan.causal, rope=plan.rope,
                                                       dq=dq, dk=dk, dv=dv, segments=plan.segments))(  # launches 4, 5
            q, k, v, o, lse, do, plan.rope, dq, dk, dv, plan.segments)
    dqkv2 = dqkv.view(rows, -1)
    layout = dqkv2.stride()  # (the SDPA core's gradient is autograd's: its layout keys the launches reading it)
    # QKV projection and the norm: dN = dqkv @ W_qkv, then the norm backward (dgamma / dbeta partials).
    dx = norm_part = None
    if need_dx or gamma_dtype is not None or beta_dtype is not None:
        dn = back.launch((3, layout), lambda: gemm.LinearInputGradLaunch(                              # launch 6
            dqkv2, w_qkv, out_dtype=torch.float32))(dqkv2, w_qkv)
        dx, norm_part = back.launch(4, lambda: norm_rows.NormBwdLaunch(                                      # launch 7
            dn, x2, (mean, rstd), norm_weight, norm=plan.norm, has_bias=norm_bias is not None))(
            dn, x2, (mean, rstd), norm_weight)
        dx = dx.view(plan.batch, plan.tokens, plan.dim)
    if w_qkv_dtype is not None:
        dw_qkv = back.launch((5, layout), lambda: gemm.LinearWeightGradLaunch(                         # launch 8
            dqkv2, n, out_dtype=w_qkv_dtype))(dqkv2, n, pending)
    db_qkv = None
    if b_qkv_dtype is not None:
        _, db_qkv = back.launch((6, layout), lambda: gemm.ScaleRowsLaunch(                             # launch 9
            dqkv2, store=False, col_sums=True, sums_dtype=b_qkv_dtype))(dqkv2)
    gemm.reduce_partials(db_proj, db_qkv, norm_part, *pending)                                         # launch 10
    dgamma, dbeta = norm_rows.norm_param_grads(norm_part, norm_weight, norm_bias is not None)
    return (dx, dgamma, dbeta, dw_qkv, None if db_qkv is None else db_qkv.out, dw_proj,
            None if db_proj is None else db_proj.out)


class FusedNormAttentionCouple(torch.autograd.Function):
    """Autograd Function of the fused half: forward 4 launches, backward 10 (9 without biases)."""

    @staticmethod
    def forward(ctx, plan, res, x, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj, row_scale, scale):
        stream, (x2, mean, rstd, n, qkv, o, lse), ctx.sdpa_graph = _fused_forward(
            plan, res, x, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj, row_scale, scale, keep_graph=True)
        ctx.plan = plan
        ctx.res_scale = None if scale is None else scale.value  # not the forward's dropped bits
        ctx.param_dtypes = [None if t is None else t.dtype for t in (norm_weight, norm_bias, w_qkv, b_qkv, w_proj,
                                                                      b_proj)]
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(x2, mean, rstd, n, qkv, o, lse, norm_weight, norm_bias, w_qkv, w_proj, row_scale)
        return function_outputs(ctx, stream, plan.frac_bits, scaled=scale is not None)

    @staticmethod
    def backward(ctx, *grads):
        plan = ctx.plan
        g = port_gradient(grads, plan.frac_bits, ctx.res_scale)
        x2, mean, rstd, n, qkv, o, lse, norm_weight, norm_bias, w_qkv, w_proj, row_scale = ctx.saved_tensors
        grad_res = residual_gradient(grads, plan.frac_bits, plan.sign, ctx.res_scale) if ctx.needs_input_grad[1] \
            else None
        if g is None:
            return (None, grad_res) + (None,) * 9
        # SDPA's graph (SDPA core) is dropped once used unless the backward keeps the graph.
        # (A second backward without retain_graph fails above, on the freed saved tensors.)
        retain = backward_keeps_graph()
        sdpa_graph = ctx.sdpa_graph
        if not retain:
            ctx.sdpa_graph = None
        need = ctx.needs_input_grad
        # Only the gradients asked for: a frozen parameter's dtype is passed as None.
        param_dtypes = [dtype if need[i + 3] else None for i, dtype in enumerate(ctx.param_dtypes)]
        with torch.autocast(g.device.type, enabled=False):
            dx, dgamma, dbeta, dw_qkv, db_qkv, dw_proj, db_proj = _fused_backward(
                plan, g, x2, mean, rstd, n, qkv, o, lse, norm_weight, norm_bias, w_qkv, w_proj, row_scale,
                param_dtypes, need_dx=need[2], sdpa_graph=sdpa_graph, retain=retain)
        param_grads = [None if d is None or not need[i + 3] else d.to(dtype) for i, (d, dtype) in
                       enumerate(zip((dgamma, dbeta, dw_qkv, db_qkv, dw_proj, db_proj), ctx.param_dtypes))]
        return (None, grad_res, None if dx is None or not need[2] else dx.to(ctx.x_dtype), *param_grads, None, None)


def fused_norm_attention_couple(res, x, sign, frac_bits, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj, *,
                                heads, kv_heads=None, causal=False, rope_theta=None, norm="layer", eps=1e-6,
                                row_scale=None, scale: ResidualScale | None = None, core: str = "triton",
                                positions=None, segments=None, call_key=None):
    """``res + sign * proj(attention(qkv(norm(x))))`` as ``(stream, port)`` with the Triton kernels.

    Same semantics as ``ops.attention.norm_attention_reference`` + ``streams.couple_output``
    (``scale``: a scaled coupling, ``scale * res + H(x)`` forward, ``(res - H(x)) / scale`` inverse).
    Forward: normalize (once per row, in the operand dtype) -> QKV GEMM (raw operands, bias +
    RoPE epilogue) -> flash attention -> out-projection GEMM (bias, row_scale, residual +/- or
    the exact int32 add, the coupling scale): 4 launches. ``core="sdpa"`` runs the attention core
    with SDPA instead of the Triton flash kernels (the GEMMs stay fused; ops.backend races both).
    ``positions`` [B, T] (RoPE positions, default 0..T-1) and ``segments`` [B, T] (padded / packed
    rows, ``ops.attention.sequence_mask``'s): the token layout, in the kernels (no T x T mask).
    Tensors for backward are kept only when something requires grad. Under autocast the GEMM and
    attention operands are in the autocast dtype (weights cast, x normalized from its own dtype),
    with fp32 accumulation. ``call_key``: this call's signature when the dispatch has it
    (``dispatch.run_op``), so the plan's key is not worked out twice.
    """
    kv_heads = kv_heads or heads
    # A plan kept per call signature (its launches with it) unless the token layout makes it the
    # call's own (RoPE tables at the positions, the segments' arguments).
    key = None
    if positions is None and segments is None:
        key = call_key if call_key is not None else plan_key(
            "norm_attention", scale, res, x, sign, frac_bits, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj,
            heads, kv_heads, causal, rope_theta, norm, eps, row_scale, core)
    plan = _plans.get(key)
    if plan is None:  # the checks (a later call of this signature would pass them too)
        if sign not in (1, -1):
            raise ValueError(f"sign must be +1 or -1, got {sign!r}")
        if frac_bits is not None:
            check_frac_bits(frac_bits)
        _check_fused_inputs(res, x, frac_bits, w_qkv, w_proj, heads, kv_heads, norm, rope_theta, row_scale)
        scale = check_residual_scale(scale, sign, frac_bits, res)
        _check_layout(x, positions, segments)
        plan = _Plan(x, sign, frac_bits, heads, kv_heads, causal, rope_theta, norm, eps, _compute_dtype(x, w_qkv),
                     core, positions, segments)
    dot_dtype = plan.dot_dtype
    if row_scale is not None:
        row_scale = row_scale.reshape(plan.rows).to(torch.float32).contiguous()
    # Weights in the operand dtype (a no-op without autocast); autograd takes the cast back.
    w_qkv_c, w_proj_c = gemm.as_operand(w_qkv, dot_dtype), gemm.as_operand(w_proj, dot_dtype)
    tensors = (res, x, norm_weight, norm_bias, w_qkv_c, b_qkv, w_proj_c, b_proj)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if not needs_grad:
        stream, _, _ = _fused_forward(plan, res, x, norm_weight, norm_bias, w_qkv_c, b_qkv, w_proj_c, b_proj,
                                      row_scale, scale)
        _plans.keep(key, plan)
        return stream, None
    out = FusedNormAttentionCouple.apply(plan, res, x, norm_weight, norm_bias, w_qkv_c, b_qkv, w_proj_c, b_proj,
                                         row_scale, scale)
    _plans.keep(key, plan)
    return couple_result(out, frac_bits, scaled=scale is not None)


_BOUND_OPTIONS = {"heads", "kv_heads", "causal", "rope_theta", "norm", "eps", "row_scale"}


def bind_norm_attention_couple(args, options, call_key):
    """A runner ``(res, x, *weights)`` of later calls of this call's signature (ops.dispatch.bind_op):
    the plan this signature's call kept (its core with it), no checks, no key, no plan lookup. None
    without a kept plan, with a row scale or a token layout (each call's)."""
    res, x, sign, frac_bits, *params = args
    if call_key is None or options.get("row_scale") is not None or set(options) != _BOUND_OPTIONS:
        return None
    plan = _plans.get(call_key)
    if plan is None:
        return None
    dot_dtype = plan.dot_dtype
    as_operand = gemm.as_operand
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (res, x, *params)):
        def run(res, x, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj):
            out = FusedNormAttentionCouple.apply(plan, res, x, norm_weight, norm_bias, as_operand(w_qkv, dot_dtype),
                                                 b_qkv, as_operand(w_proj, dot_dtype), b_proj, None, None)
            return couple_result(out, frac_bits, scaled=False)
    else:
        def run(res, x, norm_weight, norm_bias, w_qkv, b_qkv, w_proj, b_proj):
            stream, _, _ = _fused_forward(plan, res, x, norm_weight, norm_bias, as_operand(w_qkv, dot_dtype), b_qkv,
                                          as_operand(w_proj, dot_dtype), b_proj, None, None)
            return stream, None
    return run
