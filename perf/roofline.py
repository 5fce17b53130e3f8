"""Roofline of every coupling half at the production shapes: FLOPs, bytes, launches, bound times.

Plain arithmetic (no torch, no GPU). For each production shape (:data:`SHAPES`), each half
("mlp": norm + MLP; "attention": norm + QKV (+ RoPE) + attention core + out-projection), each
phase and each path it lists the kernels as :class:`Op` (name, kind, FLOPs, bytes) and turns them
into times on a :class:`GPU`:

phases
    "forward"    the no-grad couple ``res + H(x)`` of the stack's forward;
    "recompute"  the engine's with-grad inverse couple ``res - H(x)`` in backward, which also
                 saves what the half's backward needs;
    "backward"   the half's gradient given its output gradient: input gradient, weight and bias
                 gradients, norm backward.
paths
    "fused"      what revtriton's fused path launches (revtriton/ops/fused_mlp.py,
                 fused_attention.py, gemm.py), each launch counted with its *minimum* bytes: every
                 tensor it reads or writes, once (tile re-reads are assumed to hit L2);
    "unfused"    the eager PyTorch path a user would otherwise run in the same reversible
                 engine (torch LayerNorm / RMSNorm, F.linear via cuBLAS, elementwise activation,
                 SDPA flash attention, the same couple semantics), every eager kernel's reads and
                 writes counted. Assumptions: :func:`unfused_ops`.

Common setting (both paths; it is revtriton's, and the sweep's on a GPU)
    * bf16 autocast: GEMM and attention operands bf16, fp32 accumulation; fp32 master weights
      (``master_fp32=True``), so every weight is cast to bf16 at each use (autocast does this for
      the eager path; the fused halves call ``w.to(dot_dtype)``).
    * streams are int32 fixed point (``exact=True``, the library default) or fp32 (``exact=False``):
      4 bytes an element either way. The half sees the stream's value in fp32 (the engine's
      ``from_fixed`` pass in exact mode); the stream gradients are fp32.
    * engine passes around a half (``engine=True``, same on both paths, named ``engine.*``): exact
      mode adds the value conversion, the range guard (forward) and the int32 checksum (one of the
      block's two sums per half); the backward negates the incoming gradient (``-dy``) and adds the
      half's input gradient into the other stream's gradient.
    * no drop-path (row_scale), no layer scale; parameter gradients land in ``p.grad`` that is None
      (no accumulation add). Tiny launches (bias casts, ``torch.zeros`` of a bias gradient) are
      listed: on a GPU their cost is the launch, not the bytes.

FLOPs count tensor-core (matmul) work only, 2 per multiply-add; elementwise and reduction kernels
carry 0 FLOPs (at < 50 FLOP/byte they never reach the compute roof). Causal attention counts half
the score matrix (the FlashAttention convention). The fused attention backward runs 7 matmuls per
key/query tile pair (a dk/dv pass with 4, a dq pass with 3: no atomics) = 3.5x the forward's 2; the
SDPA (FlashAttention-2) backward runs 5 = 2.5x.

Times (:func:`op_time`, :func:`phase_time`): ``max(flops / (peak * eff_compute), bytes / (bw *
eff_memory)) + launches * launch_overhead``. The pure roofline ("bound") uses efficiency 1 and no
launch overhead; the estimate ("est") uses :data:`DEFAULT_EFFICIENCY` (table in
:class:`Efficiency`) unless a caller substitutes its own per-op efficiency (``efficiency_for``),
e.g. the static model's predicted fraction of tensor-core time for the fused GEMMs and attention.

It is a model: where a GPU has measured a kernel, the measurement replaces it.
Run ``python -m perf.roofline`` for the table (``--float-streams``, ``--gpus``, ``--json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

KINDS = ("gemm", "attention", "elementwise", "reduction")
HALVES = ("mlp", "attention")
PHASES = ("forward", "recompute", "backward")
PATHS = ("fused", "unfused")

# Element sizes in bytes.
STREAM = 4   # int32 fixed point or fp32 residual stream
VALUE = 4    # the fp32 stream value a half sees; fp32 gradients, fp32 dx
BF16 = 2     # compute dtype under autocast
FP32 = 4     # statistics, fp32 params and gradients
NORM_PARTIAL_PROGRAMS = 512  # revtriton.ops.gemm.row_partial_programs on a GPU


# ------------------------------------------------------------------------------------------
# Hardware


@dataclass(frozen=True)
class GPU:
    """Peak numbers of one GPU. ``peak_flops``: dense bf16 tensor-core FLOP/s; ``bandwidth``: HBM B/s."""

    name: str
    peak_flops: float
    bandwidth: float
    sms: int
    l2_bytes: int
    source: str = ""


# Sources (vendor datasheets; "dense" = half the with-sparsity number the datasheets print):
# - H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: BF16 tensor 1,979 TFLOPS with sparsity ->
#   989.4 dense; HBM3 3.35 TB/s; 132 SMs and 50 MB L2 (NVIDIA H100 / Hopper architecture whitepaper).
# - H200 SXM: NVIDIA H200 datasheet: the same GH100 chip (BF16 1,979 sparse -> 989.4 dense),
#   141 GB HBM3e at 4.8 TB/s; 132 SMs, 50 MB L2.
# - A100 SXM4 80GB: NVIDIA A100 datasheet: BF16 tensor 312 TFLOPS dense (624 with sparsity),
#   HBM2e 2,039 GB/s; 108 SMs, 40 MB L2 (NVIDIA A100 / Ampere architecture whitepaper).
H100 = GPU("H100 SXM", 989.4e12, 3.35e12, 132, 50 * 2**20, "NVIDIA H100 datasheet (SXM5), dense bf16")
H200 = GPU("H200", 989.4e12, 4.8e12, 132, 50 * 2**20, "NVIDIA H200 datasheet (SXM), dense bf16")
A100 = GPU("A100 SXM 80GB", 312e12, 2.039e12, 108, 40 * 2**20, "NVIDIA A100 datasheet (SXM4 80GB), dense bf16")
GPUS = {"h100": H100, "h200": H200, "a100": A100}


# ------------------------------------------------------------------------------------------
# Production shapes


@dataclass(frozen=True)
class Shape:
    """One production shape: model width, MLP, attention layout, and the token batch.

    ``mlp``: "gelu_tanh" (fc1 -> GELU -> fc2) or "swiglu" (down(silu(gate) * up));
    ``norm``: "layer" or "rms"; ``bias``: biases on every linear (and LayerNorm's beta);
    ``rope``: rotary embedding of q and k; ``kv_heads`` < ``heads`` is grouped-query attention.
    """

    name: str
    dim: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    seq: int
    causal: bool
    norm: str
    mlp: str
    bias: bool
    rope: bool
    note: str = ""

    def __post_init__(self):
        if self.heads * self.head_dim != self.dim:
            raise ValueError(f"{self.name}: heads x head_dim != dim")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: kv_heads must divide heads")
        if self.norm not in ("layer", "rms") or self.mlp not in ("gelu_tanh", "swiglu"):
            raise ValueError(f"{self.name}: norm {self.norm!r} / mlp {self.mlp!r}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def qkv_width(self) -> int:
        """Columns of the packed QKV projection: (heads + 2 kv_heads) x head_dim."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim


# All at 8192 tokens. ViT-B/16 and ViT-L/16 really see 197 tokens an image (196 patches + class
# token); 8192 is not a multiple of 197, so the ViTs use seq 256 x batch 32 (ViT at 256 px with
# /16 patches, or any 256-token crop): the GEMMs are identical per token, the attention core
# costs 256/197 = 1.30x more per token than at 197.
SHAPES = {
    "vit_b": Shape("vit_b", 768, 3072, 12, 12, 64, 32, 256, False, "layer", "gelu_tanh", True, False,
                   "ViT-B/16 widths; seq 256 x batch 32 stands for 197-token images"),
    "gpt2": Shape("gpt2", 768, 3072, 12, 12, 64, 8, 1024, True, "layer", "gelu_tanh", True, False,
                  "GPT-2 124M widths, causal, seq 1024 x batch 8"),
    "vit_l": Shape("vit_l", 1024, 4096, 16, 16, 64, 32, 256, False, "layer", "gelu_tanh", True, False,
                   "ViT-L/16 widths; seq 256 x batch 32 stands for 197-token images"),
    "llama7b": Shape("llama7b", 4096, 11008, 32, 32, 128, 2, 4096, True, "rms", "swiglu", False, True,
                     "LLaMA(-2)-7B: SwiGLU 11008, RMSNorm, RoPE, causal, seq 4096 x batch 2"),
    "llama3_8b": Shape("llama3_8b", 4096, 14336, 32, 8, 128, 1, 8192, True, "rms", "swiglu", False, True,
                       "LLaMA-3-8B: SwiGLU 14336, GQA 32 q / 8 kv heads, RoPE, causal, seq 8192 x batch 1"),
}


# ------------------------------------------------------------------------------------------
# Ops


@dataclass(frozen=True)
class Op:
    """One kernel launch (or ``launches`` identical ones).

    kind: "gemm" | "attention" | "elementwise" | "reduction". ``flops``: matmul FLOPs. ``bytes``:
    DRAM bytes read + written, each tensor once. ``mnk``: a GEMM's output rows, output columns and
    reduction depth (for tile counts and wave quantisation). ``backward``: an attention backward
    kernel (its own efficiency). ``engine``: a pass of the reversible engine, not of the half.
    ``io``: (tensor, bytes) terms that make up ``bytes``; reads first, then writes, each
    prefixed "r:" or "w:".
    """

    name: str
    kind: str
    flops: int
    bytes: int
    launches: int = 1
    mnk: tuple | None = None
    backward: bool = False
    engine: bool = False
    io: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"op {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.flops < 0 or self.bytes < 0 or self.launches < 0:
            raise ValueError(f"op {self.name!r}: negative flops / bytes / launches")


def _op(name, kind, *, reads=(), writes=(), flops=0, **kw) -> Op:
    """An Op whose bytes are the sum of named reads and writes (terms of 0 bytes are dropped)."""
    io = tuple(("r:" + n, int(b)) for n, b in reads if b) + tuple(("w:" + n, int(b)) for n, b in writes if b)
    return Op(name, kind, int(flops), sum(b for _, b in io), io=io, **kw)


def _gemm(name, m, n, k, *, reads, writes, accumulators=1, **kw) -> Op:
    """A GEMM whose output grid is [m, n] with depth k; ``accumulators`` = 2 for the dual-B kernel
    (SwiGLU's gate and up share a tile grid over the hidden width)."""
    return _op(name, "gemm", reads=reads, writes=writes, flops=2 * m * n * k * accumulators, mnk=(m, n, k), **kw)


def _cast(name, elements, src, dst) -> Op:
    return _op(name, "elementwise", reads=[(name.split(".")[-1], elements * src)],
               writes=[(name.split(".")[-1], elements * dst)])


def total_flops(ops: Iterable[Op]) -> int:
    return sum(op.flops for op in ops)


def total_bytes(ops: Iterable[Op]) -> int:
    return sum(op.bytes for op in ops)


def launch_count(ops: Iterable[Op]) -> int:
    return sum(op.launches for op in ops)


def attention_core_flops(shape: Shape, matmuls: int = 2) -> int:
    """FLOPs of ``matmuls`` [T x T x head_dim] products per (batch, query head), causal halved.

    The forward has 2 (Q K^T and P V); FlashAttention-2's backward 5; revtriton's backward 7.
    Grouped-query attention does not change it: every query head still sees every key.
    """
    full = matmuls * 2 * shape.batch * shape.heads * shape.seq * shape.seq * shape.head_dim
    return full // 2 if shape.causal else full


# ------------------------------------------------------------------------------------------
# Engine passes (the same on both paths)


def _engine_ops(shape: Shape, phase: str, exact: bool) -> list[Op]:
    e = shape.tokens * shape.dim
    ops = []
    if phase in ("forward", "recompute") and exact:
        ops.append(_op("engine.value", "elementwise", reads=[("stream int32", e * STREAM)],
                       writes=[("value fp32", e * VALUE)], engine=True))
    if phase == "forward" and exact:
        ops.append(_op("engine.range_guard", "reduction", reads=[("stream", e * STREAM)], engine=True))
    if phase in ("forward", "recompute") and exact:
        ops.append(_op("engine.checksum", "reduction", reads=[("stream", e * STREAM)], engine=True))
    if phase == "backward":
        ops.append(_op("engine.neg_dy", "elementwise", reads=[("dy", e * VALUE)], writes=[("-dy", e * VALUE)],
                       engine=True))
        ops.append(_op("engine.grad_accumulate", "elementwise", reads=[("dy", e * VALUE), ("x.grad", e * VALUE)],
                       writes=[("dx", e * VALUE)], engine=True))
    return ops


# ------------------------------------------------------------------------------------------
# Fused path (revtriton's Triton kernels)


def _normalize_op(shape: Shape) -> list[Op]:
    """norm_rows.normalize: x read once, the normalized rows written once in bf16 (and the stats)."""
    m, d = shape.tokens, shape.dim
    return [_op("normalize", "reduction", reads=[("x", m * d * VALUE), *_norm_param_reads(shape)],
                writes=[("n bf16", m * d * BF16), ("mean", m * FP32), ("rstd", m * FP32)])]


def _norm_param_reads(shape: Shape) -> list:
    d = shape.dim
    return [("gamma", d * FP32)] + ([("beta", d * FP32)] if shape.norm == "layer" else [])


def _scale_rows_op(name: str, m: int, d: int, *, col_sums: bool, store: bool = True, src: int = VALUE) -> Op:
    """gemm.scale_rows: g read once, sign (* row scale) applied, written in bf16; bias partials."""
    p = min(m, NORM_PARTIAL_PROGRAMS)
    return _op(name, "reduction", reads=[("g", m * d * src)],
               writes=[("g bf16", m * d * BF16 if store else 0), ("partials", p * d * FP32 if col_sums else 0)])


def _weight_grad(name: str, n_out: int, n_in: int, m: int, *, reads) -> list[Op]:
    """A raw weight-gradient GEMM [n_out, n_in] over m tokens (split-K partials when the output
    cannot fill the GPU: gemm.split_k_plan at 132 SMs, the partials reduced in the final pass)."""
    splits = _split_k(n_out, n_in, m)
    out = [("dW fp32", n_out * n_in * FP32 * (splits if splits > 1 else 1))]
    return [_gemm(name, n_out, n_in, m, reads=reads, writes=out)]


def _split_k(m: int, n: int, k: int, sms: int = 132) -> int:
    """revtriton.ops.gemm.split_k_plan (kept in sync by tests/test_roofline.py)."""
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    if 2 * tiles >= sms or k < 2048:
        return 1
    splits = min(math.ceil(sms / tiles), k // 1024, 8)
    per_split = math.ceil(math.ceil(k / splits) / 256) * 256
    return math.ceil(k / per_split)


def _reduce_op(shape: Shape, jobs: list) -> list[Op]:
    """gemm.reduce_partials: every partial sum of a half's backward, four per launch."""
    if not jobs:
        return []
    ops = []
    for first in range(0, len(jobs), 4):
        group = jobs[first:first + 4]
        ops.append(_op("reduce_partials", "reduction", reads=[(n, rows * width * FP32) for n, rows, width in group],
                       writes=[(n, width * FP32) for n, _, width in group]))
    return ops


def _fused_mlp(shape: Shape, phase: str, master_fp32: bool) -> list[Op]:
    m, d, h = shape.tokens, shape.dim, shape.hidden
    swiglu = shape.mlp == "swiglu"
    h1 = 2 * h if swiglu else h  # GEMM1 output columns (SwiGLU: gate and up)
    bias = shape.bias and not swiglu
    w_names = ["w_gate", "w_up", "w_down"] if swiglu else ["w1", "w2"]
    casts = [_cast(f"cast.{n}", h * d, FP32, BF16) for n in w_names] if master_fp32 else []
    if phase in ("forward", "recompute"):
        save = phase == "recompute"
        gemm1 = _gemm("gemm1_act" if not swiglu else "gemm1_swiglu", m, h, d, accumulators=2 if swiglu else 1,
                      reads=[("n bf16", m * d * BF16), ("W1" if not swiglu else "W_gate|W_up", h1 * d * BF16),
                             ("b1", h * FP32 if bias else 0)],
                      writes=[("act bf16", m * h * BF16), ("preact bf16 (saved)", m * h1 * BF16 if save else 0)])
        gemm2 = _gemm("gemm2_couple", m, d, h,
                      reads=[("act", m * h * BF16), ("W2", d * h * BF16), ("b2", d * FP32 if bias else 0),
                             ("res", m * d * STREAM)],
                      writes=[("stream", m * d * STREAM)])
        return casts + _normalize_op(shape) + [gemm1, gemm2]
    # backward (FusedNormMLPCouple.backward / FusedSwiGLUCouple.backward)
    ops = list(casts)
    ops.append(_scale_rows_op("scale_grad", m, d, col_sums=bias))
    ops.append(_gemm("dh_act_bwd", m, h, d, reads=[("g bf16", m * d * BF16), ("W2", d * h * BF16),
                                                   ("preact", m * h1 * BF16)],
                     writes=[("dpreact bf16", m * h1 * BF16),
                             ("db1 partials", math.ceil(m / 64) * h * FP32 if bias else 0)]))
    ops += _weight_grad("dw2", d, h, m, reads=[("g bf16", m * d * BF16), ("act bf16", m * h * BF16)])
    ops += _weight_grad("dw1", h1, d, m, reads=[("dpreact", m * h1 * BF16), ("n bf16", m * d * BF16)])
    ops.append(_gemm("dn_input_grad", m, d, h1, reads=[("dpreact", m * h1 * BF16), ("W1", h1 * d * BF16)],
                     writes=[("dn fp32", m * d * FP32)]))
    ops.append(_norm_bwd_op(shape))
    params = 2 if shape.norm == "layer" else 1
    jobs = [("dgamma/dbeta", min(m, NORM_PARTIAL_PROGRAMS), params * d)]
    if bias:
        jobs += [("db2", min(m, NORM_PARTIAL_PROGRAMS), d), ("db1", math.ceil(m / 64), h)]
    for name, n_out, n_in in (("dW2", d, h), ("dW1", h1, d)):
        if _split_k(n_out, n_in, m) > 1:
            jobs.append((name, _split_k(n_out, n_in, m), n_out * n_in))
    return ops + _reduce_op(shape, jobs)


def _norm_bwd_op(shape: Shape) -> Op:
    """norm_rows.norm_bwd_partials: the row kernel with dgamma / dbeta partials."""
    m, d = shape.tokens, shape.dim
    params = 2 if shape.norm == "layer" else 1
    p = min(m, NORM_PARTIAL_PROGRAMS)
    return _op("norm_bwd", "reduction",
               reads=[("dn", m * d * FP32), ("x", m * d * VALUE), ("mean", m * FP32), ("rstd", m * FP32),
                      ("gamma", d * FP32)],
               writes=[("dx fp32", m * d * VALUE), ("partials", params * p * d * FP32)])


def _fused_attention(shape: Shape, phase: str, master_fp32: bool) -> list[Op]:
    m, d, nq = shape.tokens, shape.dim, shape.qkv_width
    hd = shape.head_dim
    q_el, kv_el = m * shape.heads * hd, m * shape.kv_heads * hd
    lse = shape.batch * shape.heads * shape.seq * FP32
    rope = shape.seq * hd * FP32 if shape.rope else 0  # cos and sin, [T, hd/2] fp32 each
    bias = shape.bias
    if phase in ("forward", "recompute"):
        # The saved tensors (x, stats, n, qkv, o, lse) are written by the forward anyway: same bytes.
        ops = [_cast("cast.w_qkv", nq * d, FP32, BF16), _cast("cast.w_proj", d * d, FP32, BF16)] if master_fp32 else []
        ops += _normalize_op(shape)
        ops.append(_gemm("qkv_rope_gemm", m, nq, d,
                         reads=[("n bf16", m * d * BF16), ("W_qkv", nq * d * BF16),
                                ("b_qkv", nq * FP32 if bias else 0), ("cos/sin", rope)],
                         writes=[("qkv bf16", m * nq * BF16)]))
        ops.append(_op("attention_fwd", "attention", flops=attention_core_flops(shape, 2),
                       reads=[("q", q_el * BF16), ("k", kv_el * BF16), ("v", kv_el * BF16)],
                       writes=[("o", q_el * BF16), ("lse", lse)]))
        ops.append(_gemm("proj_couple", m, d, d,
                         reads=[("o", m * d * BF16), ("W_proj", d * d * BF16), ("b_proj", d * FP32 if bias else 0),
                                ("res", m * d * STREAM)],
                         writes=[("stream", m * d * STREAM)]))
        return ops
    # backward (_fused_backward + FusedNormAttentionCouple.backward + autograd's cast backward)
    ops = [_scale_rows_op("scale_grad", m, d, col_sums=bias)]
    ops.append(_gemm("do_input_grad", m, d, d, reads=[("g bf16", m * d * BF16), ("W_proj", d * d * BF16)],
                     writes=[("do bf16", m * d * BF16)]))
    ops += _weight_grad("dw_proj", d, d, m, reads=[("g bf16", m * d * BF16), ("o", m * d * BF16)])
    # dq pass (delta = rowsum(dO * O) fused: QK^T, dP, dQ), then the dk/dv pass (QK^T, dV, dP, dK)
    ops.append(_op("attention_bwd_dq", "attention", flops=attention_core_flops(shape, 3), backward=True,
                   reads=[("q", q_el * BF16), ("k", kv_el * BF16), ("v", kv_el * BF16), ("o", q_el * BF16),
                          ("do", q_el * BF16), ("lse", lse), ("cos/sin", rope)],
                   writes=[("dq", q_el * BF16), ("delta", lse)]))
    ops.append(_op("attention_bwd_dkdv", "attention", flops=attention_core_flops(shape, 4), backward=True,
                   reads=[("q", q_el * BF16), ("k", kv_el * BF16), ("v", kv_el * BF16), ("do", q_el * BF16),
                          ("lse", lse), ("delta", lse), ("cos/sin", rope)],
                   writes=[("dk", kv_el * BF16), ("dv", kv_el * BF16)]))
    ops.append(_gemm("dn_qkv_input_grad", m, d, nq, reads=[("dqkv", m * nq * BF16), ("W_qkv", nq * d * BF16)],
                     writes=[("dn fp32", m * d * FP32)]))
    ops.append(_norm_bwd_op(shape))
    ops += _weight_grad("dw_qkv", nq, d, m, reads=[("dqkv", m * nq * BF16), ("n bf16", m * d * BF16)])
    if bias:
        ops.append(_scale_rows_op("db_qkv_col_sums", m, nq, col_sums=True, store=False, src=BF16))
    params = 2 if shape.norm == "layer" else 1
    jobs = [("dgamma/dbeta", min(m, NORM_PARTIAL_PROGRAMS), params * d)]
    if bias:
        jobs += [("db_proj", min(m, NORM_PARTIAL_PROGRAMS), d), ("db_qkv", min(m, NORM_PARTIAL_PROGRAMS), nq)]
    for name, n_out, n_in in (("dW_proj", d, d), ("dW_qkv", nq, d)):
        if _split_k(n_out, n_in, m) > 1:
            jobs.append((name, _split_k(n_out, n_in, m), n_out * n_in))
    ops += _reduce_op(shape, jobs)
    # The Function returns weight grads in the dtype of its (bf16-cast) weight inputs; autograd's
    # cast backward takes them back to the fp32 parameters.
    if master_fp32:
        ops += [_cast("cast_bwd.dw_qkv", nq * d, BF16, FP32), _cast("cast_bwd.dw_proj", d * d, BF16, FP32)]
    return ops


def fused_ops(shape: Shape, half: str, phase: str, *, master_fp32: bool = True) -> list[Op]:
    """The fused path's launches of one half and phase (engine passes not included).

    MLP forward / recompute: [weight casts], normalize (the norm once per row, written in bf16),
    GEMM1 (raw operands; bias + activation or SwiGLU in the epilogue; the recompute also stores
    the pre-activation), GEMM2 (bias, residual +/- or the exact int32 add in the epilogue). MLP
    backward: [weight casts], the gradient scaled and cast once (db2 partials), the dH GEMM
    (activation derivative and db1 partials in the epilogue), dW2 and dW1 as raw GEMMs over the
    kept activations and normalized rows (split-K when the output tiles cannot fill the GPU), dN,
    the norm backward with dgamma/dbeta partials, one reduction of every partial sum.
    Attention forward / recompute: [weight casts], normalize, QKV GEMM (raw operands, bias and
    RoPE epilogue), flash attention forward, out-projection couple GEMM. Backward: the gradient
    scaled and cast once (db_proj partials), dO GEMM, dW_proj, the attention backward's dq pass (delta
    fused) and dk/dv pass (RoPE backward inside), dN GEMM, the norm backward, dW_qkv over the normalized rows, db_qkv column
    sums, one reduction, and the cast back of the weight gradients (fp32 master weights only).
    """
    _check(half, phase)
    return (_fused_mlp if half == "mlp" else _fused_attention)(shape, phase, master_fp32)


# ------------------------------------------------------------------------------------------
# Unfused path (eager PyTorch + cuBLAS + SDPA)


def _couple_fwd_unfused(shape: Shape, exact: bool) -> list[Op]:
    """``res +/- h`` of a bf16 half output h, as revtriton's eager couple runs it."""
    e = shape.tokens * shape.dim
    if not exact:
        return [_op("couple.add", "elementwise", reads=[("res fp32", e * STREAM), ("h bf16", e * BF16)],
                    writes=[("stream", e * STREAM)])]
    # streams.quantize_reference + the int32 add (ExactAdd.forward): 7 eager kernels
    return [_cast("couple.h.float", e, BF16, FP32),
            _op("couple.mul_2^k", "elementwise", reads=[("h", e * FP32)], writes=[("h", e * FP32)]),
            _op("couple.round_", "elementwise", reads=[("h", e * FP32)], writes=[("h", e * FP32)]),
            _op("couple.nan_to_num_", "elementwise", reads=[("h", e * FP32)], writes=[("h", e * FP32)]),
            _op("couple.clamp_", "elementwise", reads=[("h", e * FP32)], writes=[("h", e * FP32)]),
            _cast("couple.to_int32", e, FP32, STREAM),
            _op("couple.add_int32", "elementwise", reads=[("res", e * STREAM), ("q", e * STREAM)],
                writes=[("stream", e * STREAM)])]


def _couple_bwd_unfused(shape: Shape) -> list[Op]:
    """The couple's backward to h: the sign (a neg kernel) and the cast of the fp32 grad to bf16."""
    e = shape.tokens * shape.dim
    return [_op("couple_bwd.neg", "elementwise", reads=[("g", e * VALUE)], writes=[("-g", e * VALUE)]),
            _cast("couple_bwd.to_bf16", e, FP32, BF16)]


def _norm_fwd_unfused(shape: Shape) -> list[Op]:
    m, d = shape.tokens, shape.dim
    layer = shape.norm == "layer"
    return [_op("layer_norm" if layer else "rms_norm", "reduction",
                reads=[("x fp32", m * d * VALUE), *_norm_param_reads(shape)],
                writes=[("n fp32", m * d * FP32), ("mean", m * FP32 if layer else 0), ("rstd", m * FP32)])]


def _norm_bwd_unfused(shape: Shape) -> list[Op]:
    m, d = shape.tokens, shape.dim
    layer = shape.norm == "layer"
    name = "layer_norm_bwd" if layer else "rms_norm_bwd"
    stats = [("mean", m * FP32 if layer else 0), ("rstd", m * FP32)]
    return [_op(name + ".dx", "reduction",
                reads=[("dn fp32", m * d * FP32), ("x", m * d * VALUE), *stats, ("gamma", d * FP32)],
                writes=[("dx fp32", m * d * VALUE)]),
            _op(name + ".dgamma_dbeta", "reduction", reads=[("dn fp32", m * d * FP32), ("x", m * d * VALUE), *stats],
                writes=[("dgamma/dbeta", (2 if layer else 1) * d * FP32)])]


def _linear_fwd_unfused(name, m, n, k, bias, *, inp="in bf16", out="out bf16") -> Op:
    """F.linear under autocast: cuBLASLt GEMM with the bias in its epilogue (bias already bf16)."""
    return _gemm(name, m, n, k,
                 reads=[(inp, m * k * BF16), ("W bf16", n * k * BF16), ("b bf16", n * BF16 if bias else 0)],
                 writes=[(out, m * n * BF16)])


def _linear_bwd_unfused(name, m, n, k, bias, master_fp32) -> list[Op]:
    """Autograd of y = x W^T + b (x [m, k], W [n, k]) with bf16 operands: dX, dW, db, cast backward."""
    ops = [_gemm(name + ".dX", m, k, n, reads=[("dy", m * n * BF16), ("W", n * k * BF16)],
                 writes=[("dx", m * k * BF16)]),
           _gemm(name + ".dW", n, k, m, reads=[("dy", m * n * BF16), ("x", m * k * BF16)],
                 writes=[("dW bf16", n * k * BF16)])]
    if bias:
        ops.append(_op(name + ".db", "reduction", reads=[("dy", m * n * BF16)], writes=[("db", n * BF16)]))
    if master_fp32:
        ops.append(_cast(name + ".cast_bwd.W", n * k, BF16, FP32))
        if bias:
            ops.append(_cast(name + ".cast_bwd.b", n, BF16, FP32))
    return ops


def _weight_casts_unfused(named: list, master_fp32: bool) -> list[Op]:
    """Autocast's bf16 copies of the fp32 weights and biases (one per use)."""
    return [_cast("cast." + n, elements, FP32, BF16) for n, elements in named if elements] if master_fp32 else []


def _unfused_mlp(shape: Shape, phase: str, exact: bool, master_fp32: bool) -> list[Op]:
    m, d, h = shape.tokens, shape.dim, shape.hidden
    swiglu, bias = shape.mlp == "swiglu", shape.bias
    if phase in ("forward", "recompute"):
        # (recompute: autograd saves n bf16, the pre-activations and the stats, which the forward
        # writes anyway; no extra kernel)
        if swiglu:
            ops = _weight_casts_unfused([("w_gate", h * d), ("w_up", h * d), ("w_down", d * h)], master_fp32)
            ops += _norm_fwd_unfused(shape)
            ops += [_cast("cast.n.gate", m * d, FP32, BF16), _linear_fwd_unfused("gate", m, h, d, False),
                    _cast("cast.n.up", m * d, FP32, BF16), _linear_fwd_unfused("up", m, h, d, False),
                    _op("silu", "elementwise", reads=[("gate", m * h * BF16)], writes=[("silu", m * h * BF16)]),
                    _op("mul", "elementwise", reads=[("silu", m * h * BF16), ("up", m * h * BF16)],
                        writes=[("act", m * h * BF16)]),
                    _linear_fwd_unfused("down", m, d, h, False)]
        else:
            ops = _weight_casts_unfused([("w1", h * d), ("b1", h if bias else 0), ("w2", d * h),
                                         ("b2", d if bias else 0)], master_fp32)
            ops += _norm_fwd_unfused(shape)
            ops += [_cast("cast.n", m * d, FP32, BF16), _linear_fwd_unfused("fc1", m, h, d, bias),
                    _op("gelu_tanh", "elementwise", reads=[("z", m * h * BF16)], writes=[("act", m * h * BF16)]),
                    _linear_fwd_unfused("fc2", m, d, h, bias)]
        return ops + _couple_fwd_unfused(shape, exact)
    ops = _couple_bwd_unfused(shape)
    if swiglu:
        ops += _linear_bwd_unfused("down", m, d, h, False, master_fp32)
        ops += [_op("mul_bwd.d_silu", "elementwise", reads=[("g", m * h * BF16), ("up", m * h * BF16)],
                    writes=[("d silu", m * h * BF16)]),
                _op("mul_bwd.d_up", "elementwise", reads=[("g", m * h * BF16), ("silu", m * h * BF16)],
                    writes=[("d up", m * h * BF16)]),
                _op("silu_bwd", "elementwise", reads=[("d silu", m * h * BF16), ("gate", m * h * BF16)],
                    writes=[("d gate", m * h * BF16)])]
        ops += _linear_bwd_unfused("gate", m, h, d, False, master_fp32)
        ops += _linear_bwd_unfused("up", m, h, d, False, master_fp32)
        ops += [_cast("cast_bwd.n.gate", m * d, BF16, FP32), _cast("cast_bwd.n.up", m * d, BF16, FP32),
                _op("grad_sum.n", "elementwise", reads=[("dn gate", m * d * FP32), ("dn up", m * d * FP32)],
                    writes=[("dn", m * d * FP32)])]
    else:
        ops += _linear_bwd_unfused("fc2", m, d, h, bias, master_fp32)
        ops.append(_op("gelu_tanh_bwd", "elementwise", reads=[("g", m * h * BF16), ("z", m * h * BF16)],
                       writes=[("dz", m * h * BF16)]))
        ops += _linear_bwd_unfused("fc1", m, h, d, bias, master_fp32)
        ops.append(_cast("cast_bwd.n", m * d, BF16, FP32))
    return ops + _norm_bwd_unfused(shape)


def _rope_fwd_unfused(name: str, elements: int) -> list[Op]:
    """Hugging Face style ``t * cos + rotate_half(t) * sin`` in bf16 (rotate_half = cat(-t2, t1))."""
    e, half = elements, elements // 2
    return [_op(f"rope.{name}.neg", "elementwise", reads=[("t2", half * BF16)], writes=[("-t2", half * BF16)]),
            _op(f"rope.{name}.cat", "elementwise", reads=[("-t2|t1", e * BF16)], writes=[("rot", e * BF16)]),
            _op(f"rope.{name}.mul_cos", "elementwise", reads=[("t", e * BF16)], writes=[("t*cos", e * BF16)]),
            _op(f"rope.{name}.mul_sin", "elementwise", reads=[("rot", e * BF16)], writes=[("rot*sin", e * BF16)]),
            _op(f"rope.{name}.add", "elementwise", reads=[("a", e * BF16), ("b", e * BF16)],
                writes=[("out", e * BF16)])]


def _rope_bwd_unfused(name: str, elements: int) -> list[Op]:
    """Autograd of the HF RoPE: two muls, neg, two slice backwards (zeros + copy each), two adds."""
    e, half = elements, elements // 2
    ops = [_op(f"rope_bwd.{name}.g_cos", "elementwise", reads=[("g", e * BF16)], writes=[("g*cos", e * BF16)]),
           _op(f"rope_bwd.{name}.g_sin", "elementwise", reads=[("g", e * BF16)], writes=[("g*sin", e * BF16)]),
           _op(f"rope_bwd.{name}.neg", "elementwise", reads=[("g2", half * BF16)], writes=[("-g2", half * BF16)])]
    for part in ("t1", "t2"):
        ops += [_op(f"rope_bwd.{name}.slice_bwd_{part}.zeros", "elementwise", writes=[("full", e * BF16)]),
                _op(f"rope_bwd.{name}.slice_bwd_{part}.copy", "elementwise", reads=[("g half", half * BF16)],
                    writes=[("half", half * BF16)])]
    ops += [_op(f"rope_bwd.{name}.acc{i}", "elementwise", reads=[("a", e * BF16), ("b", e * BF16)],
                writes=[("sum", e * BF16)]) for i in (1, 2)]
    return ops


def _unfused_attention(shape: Shape, phase: str, exact: bool, master_fp32: bool) -> list[Op]:
    m, d, nq, hd = shape.tokens, shape.dim, shape.qkv_width, shape.head_dim
    q_el, kv_el = m * shape.heads * hd, m * shape.kv_heads * hd
    lse = shape.batch * shape.heads * shape.seq * FP32
    bias, gqa = shape.bias, shape.kv_heads != shape.heads
    if phase in ("forward", "recompute"):
        ops = _weight_casts_unfused([("w_qkv", nq * d), ("b_qkv", nq if bias else 0), ("w_proj", d * d),
                                     ("b_proj", d if bias else 0)], master_fp32)
        ops += _norm_fwd_unfused(shape)
        ops += [_cast("cast.n", m * d, FP32, BF16), _linear_fwd_unfused("qkv", m, nq, d, bias)]
        if shape.rope:
            ops += _rope_fwd_unfused("q", q_el) + _rope_fwd_unfused("k", kv_el)
        ops.append(_op("sdpa_flash_fwd", "attention", flops=attention_core_flops(shape, 2),
                       reads=[("q", q_el * BF16), ("k", kv_el * BF16), ("v", kv_el * BF16)],
                       writes=[("o", q_el * BF16), ("lse", lse)]))
        ops.append(_linear_fwd_unfused("proj", m, d, d, bias, inp="o bf16"))
        return ops + _couple_fwd_unfused(shape, exact)
    ops = _couple_bwd_unfused(shape)
    ops += _linear_bwd_unfused("proj", m, d, d, bias, master_fp32)
    # SDPA flash backward (FlashAttention-2 in PyTorch): preprocess (delta, zero the fp32 dq
    # accumulator), the main kernel (dq by fp32 atomics; dk / dv per query head under GQA), dq
    # conversion, and the sum of dk / dv over each query-head group under GQA.
    kv_out = q_el if gqa else kv_el
    ops.append(_op("sdpa_flash_bwd.dot_do_o", "reduction", reads=[("o", q_el * BF16), ("do", q_el * BF16)],
                   writes=[("delta", lse), ("dq_accum zero", q_el * FP32)]))
    ops.append(_op("sdpa_flash_bwd", "attention", flops=attention_core_flops(shape, 5), backward=True,
                   reads=[("q", q_el * BF16), ("k", kv_el * BF16), ("v", kv_el * BF16), ("do", q_el * BF16),
                          ("lse", lse), ("delta", lse)],
                   writes=[("dq_accum fp32", q_el * FP32), ("dk", kv_out * BF16), ("dv", kv_out * BF16)]))
    ops.append(_op("sdpa_flash_bwd.convert_dq", "elementwise", reads=[("dq_accum", q_el * FP32)],
                   writes=[("dq", q_el * BF16)]))
    if gqa:
        ops += [_op(f"sdpa_flash_bwd.sum_{t}_groups", "reduction", reads=[(t + " expanded", q_el * BF16)],
                    writes=[(t, kv_el * BF16)]) for t in ("dk", "dv")]
    if shape.rope:
        ops += _rope_bwd_unfused("q", q_el) + _rope_bwd_unfused("k", kv_el)
    ops.append(_op("split_bwd.cat_dqkv", "elementwise", reads=[("dq|dk|dv", m * nq * BF16)],
                   writes=[("dqkv", m * nq * BF16)]))
    ops += _linear_bwd_unfused("qkv", m, nq, d, bias, master_fp32)
    ops.append(_cast("cast_bwd.n", m * d, BF16, FP32))
    return ops + _norm_bwd_unfused(shape)


def unfused_ops(shape: Shape, half: str, phase: str, *, exact: bool = True, master_fp32: bool = True) -> list[Op]:
    """The eager path's kernels of one half and phase (engine passes not included).

    Assumptions (each chosen so that the eager path is not made slower than it is):
    * bf16 autocast with fp32 master weights: each weight and bias is cast to bf16 at each use
      (one kernel each); the fp32 norm output is cast to bf16 by each F.linear that reads it (a
      non-leaf tensor is not in autocast's cache: SwiGLU's gate and up linears cast it twice).
    * LayerNorm and RMSNorm are one fused torch kernel each (``F.layer_norm``; ``F.rms_norm`` has a
      fused CUDA kernel in recent PyTorch), run in fp32 under autocast (fp32 output, stats saved);
      their backward is a dx kernel plus a dgamma(/dbeta) kernel, each reading dn and x.
    * F.linear is one cuBLASLt GEMM with the bias in its epilogue; the activation is a separate
      elementwise kernel (cuBLAS has no GELU-tanh / SiLU*up epilogue on this path). Its backward is
      dX and dW GEMMs, a separate bias-gradient reduction, and autocast's cast backward of W and b.
    * GELU-tanh, SiLU and the SwiGLU product are eager bf16 kernels (mul: one kernel reading both);
      the backward of the product is two kernels, SiLU and GELU backward one each.
    * Attention: packed QKV linear, q / k / v as strided views (no copies); RoPE Hugging Face style
      in bf16 (rotate_half by neg + cat; 5 kernels forward, 9 backward per tensor); SDPA's flash
      backend (FlashAttention-2) with native GQA (no repeat_kv copy); its output layout makes the
      head merge a view. The backward: SDPA's preprocess, main kernel (dq through an fp32
      accumulator, dk / dv expanded to the query heads under GQA, then summed per group), dq
      conversion; q / k / v gradients concatenated back into the packed QKV gradient (one copy).
    * The couple: exact mode runs revtriton's eager epilogue (``streams.quantize_reference`` and
      the int32 add: 7 kernels), float mode one fused add of the fp32 stream and the bf16 output;
      its backward is a neg kernel (the sign) and the cast of the fp32 gradient to bf16.
    * Launches only; kernels are not fused by torch.compile (that is a different baseline).
    """
    _check(half, phase)
    return (_unfused_mlp if half == "mlp" else _unfused_attention)(shape, phase, exact, master_fp32)


def half_ops(shape: Shape | str, half: str, phase: str, path: str, *, exact: bool = True, engine: bool = True,
             master_fp32: bool = True) -> list[Op]:
    """Every launch of one half, phase and path, the engine's passes around it first when ``engine``."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    ops = fused_ops(shape, half, phase, master_fp32=master_fp32) if path == "fused" else \
        unfused_ops(shape, half, phase, exact=exact, master_fp32=master_fp32)
    return (_engine_ops(shape, phase, exact) if engine else []) + ops


def _check(half, phase):
    if half not in HALVES:
        raise ValueError(f"half must be one of {HALVES}, got {half!r}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


# ------------------------------------------------------------------------------------------
# Times


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of the roof per kind of kernel, and the cost of one launch.

    Defaults (H100 / H200; A100 in :data:`A100_EFFICIENCY`), assumptions to be replaced by
    measurements (or by the static model's per-kernel prediction, via ``efficiency_for``):

    =====================  ======  ==========================================================
    gemm                   0.75    of dense bf16 peak: cuBLAS bf16 at M = 8192, N, K >= 768
    attention_fwd          0.45    of peak: SDPA flash (FlashAttention-2 class) forward on H100
    attention_bwd          0.35    of peak: its backward on H100
    memory                 0.85    of HBM bandwidth: streaming elementwise kernels (and any
                                   kernel that ends up memory-bound, GEMMs included)
    reduction_memory       0.80    of HBM bandwidth: row / column reductions (norms, sums)
    launch_overhead_s      4 us    per launch: launch gap, ramp-up and tail of a kernel
    =====================  ======  ==========================================================
    """

    gemm: float = 0.75
    attention_fwd: float = 0.45
    attention_bwd: float = 0.35
    memory: float = 0.85
    reduction_memory: float = 0.80
    launch_overhead_s: float = 4e-6

    def for_op(self, op: Op) -> tuple[float, float]:
        """(compute efficiency, memory efficiency) of ``op``."""
        if op.kind == "gemm":
            return self.gemm, self.memory
        if op.kind == "attention":
            return (self.attention_bwd if op.backward else self.attention_fwd), self.memory
        if op.kind == "reduction":
            return 1.0, self.reduction_memory
        return 1.0, self.memory


DEFAULT_EFFICIENCY = Efficiency()
# A100: cuBLAS reaches a larger share of its lower peak; FlashAttention-2 reaches 50-73% of peak
# forward and somewhat less backward on A100 (Dao 2023, figs. 4-6; head dim 64 is the low end).
A100_EFFICIENCY = Efficiency(gemm=0.80, attention_fwd=0.55, attention_bwd=0.45)
ROOF = Efficiency(1.0, 1.0, 1.0, 1.0, 1.0, 0.0)  # the pure roofline: no losses, no launch cost


def default_efficiency(gpu: GPU) -> Efficiency:
    return A100_EFFICIENCY if gpu.name.startswith("A100") else DEFAULT_EFFICIENCY


EfficiencyLike = Efficiency | tuple


def op_time(op: Op, gpu: GPU, efficiency: EfficiencyLike | None = None, *,
            launch_overhead_s: float | None = None) -> float:
    """Seconds: ``max(flops / (peak * eff_compute), bytes / (bw * eff_memory)) + launches * overhead``.

    ``efficiency``: an :class:`Efficiency` (default: :func:`default_efficiency` of the GPU) or a
    ``(compute, memory)`` pair for this op; ``launch_overhead_s`` overrides the Efficiency's (a
    pair has none: 0 unless given).
    """
    if efficiency is None:
        efficiency = default_efficiency(gpu)
    if isinstance(efficiency, Efficiency):
        eff_c, eff_m = efficiency.for_op(op)
        overhead = efficiency.launch_overhead_s if launch_overhead_s is None else launch_overhead_s
    else:
        eff_c, eff_m = efficiency
        overhead = 0.0 if launch_overhead_s is None else launch_overhead_s
    if not (0 < eff_c <= 1 and 0 < eff_m <= 1):
        raise ValueError(f"efficiencies must be in (0, 1], got {(eff_c, eff_m)} for {op.name}")
    return max(op.flops / (gpu.peak_flops * eff_c), op.bytes / (gpu.bandwidth * eff_m)) + op.launches * overhead


def bound_time(op: Op, gpu: GPU) -> float:
    """The pure roofline of one op: ``max(flops / peak, bytes / bandwidth)``, no launch cost."""
    return op_time(op, gpu, ROOF)


def limited_by(op: Op, gpu: GPU) -> str:
    """"compute" or "memory": which roof bounds the op at full efficiency."""
    return "compute" if op.flops / gpu.peak_flops >= op.bytes / gpu.bandwidth else "memory"


def phase_time(ops: Sequence[Op], gpu: GPU, efficiency: Efficiency | None = None, *,
               efficiency_for: Callable[[Op], EfficiencyLike | None] | None = None) -> float:
    """Seconds for a list of ops run one after the other.

    ``efficiency_for(op)`` may return a ``(compute, memory)`` pair or an :class:`Efficiency` for that
    op (e.g. the static model's predicted fraction for a fused GEMM), or None for the default
    (``efficiency``, else the GPU's default). Launch overhead comes from ``efficiency`` either way.
    """
    base = efficiency if efficiency is not None else default_efficiency(gpu)
    total = 0.0
    for op in ops:
        chosen = efficiency_for(op) if efficiency_for is not None else None
        if chosen is None:
            total += op_time(op, gpu, base)
        else:
            total += op_time(op, gpu, chosen, launch_overhead_s=base.launch_overhead_s)
    return total


def phase_bound(ops: Sequence[Op], gpu: GPU) -> float:
    """Sum of the ops' pure roofline times (seconds)."""
    return sum(bound_time(op, gpu) for op in ops)


def compute_share(ops: Sequence[Op], gpu: GPU) -> float:
    """Fraction of the phase's roofline time spent in compute-bound ops."""
    total = phase_bound(ops, gpu)
    return sum(bound_time(op, gpu) for op in ops if limited_by(op, gpu) == "compute") / total if total else 0.0


# ------------------------------------------------------------------------------------------
# Wave quantisation


def gemm_tiles(m: int, n: int, block_m: int = 128, block_n: int = 128) -> int:
    """Output tiles of an [m, n] GEMM result with [block_m, block_n] tiles (one program each)."""
    if min(m, n, block_m, block_n) <= 0:
        raise ValueError("sizes must be positive")
    return math.ceil(m / block_m) * math.ceil(n / block_n)


def wave_quantization(tiles: int, sms: int) -> tuple[float, float]:
    """(waves = tiles / sms, efficiency = tiles / (ceil(tiles / sms) * sms)): one tile per SM at a time."""
    if tiles <= 0 or sms <= 0:
        raise ValueError("tiles and sms must be positive")
    return tiles / sms, tiles / (math.ceil(tiles / sms) * sms)


def attention_programs(shape: Shape, block: int = 128, *, backward: bool = False) -> int:
    """Programs of revtriton's attention kernels: forward cdiv(seq, BLOCK_M) x batch x heads; backward
    cdiv(seq, BLOCK_FIXED) x batch x (kv_heads dk/dv programs + heads dq programs)."""
    rows = math.ceil(shape.seq / block)
    return rows * shape.batch * ((shape.kv_heads + shape.heads) if backward else shape.heads)


def gemm_wave_efficiency(op: Op, gpu: GPU, block_m: int = 128, block_n: int = 128) -> float:
    """Wave efficiency of a GEMM op's output tiling on ``gpu`` (1.0 for ops without ``mnk``)."""
    if op.mnk is None:
        return 1.0
    m, n, _ = op.mnk
    return wave_quantization(gemm_tiles(m, n, block_m, block_n), gpu.sms)[1]


# ------------------------------------------------------------------------------------------
# Table


@dataclass
class Row:
    shape: str
    half: str
    phase: str
    path: str
    gflop: float
    mb: float
    launches: int
    bound_us: dict      # GPU name -> pure roofline, microseconds
    est_us: dict        # GPU name -> with the efficiency table and launch overhead
    limited_by: dict    # GPU name -> "compute 87%" (share of the bound time in compute-bound ops)


def table(shapes: Iterable[Shape | str] | None = None, gpus: Sequence[GPU] = (H100, H200), *, exact: bool = True,
          engine: bool = True, master_fp32: bool = True,
          efficiency_for: Callable[[Op], EfficiencyLike | None] | None = None) -> list[Row]:
    """One row per (shape, half, phase, path). ``efficiency_for`` applies to the fused path only."""
    rows = []
    for shape in (SHAPES.values() if shapes is None else shapes):
        shape = SHAPES[shape] if isinstance(shape, str) else shape
        for half in HALVES:
            for phase in PHASES:
                for path in PATHS:
                    ops = half_ops(shape, half, phase, path, exact=exact, engine=engine, master_fp32=master_fp32)
                    chooser = efficiency_for if path == "fused" else None
                    rows.append(Row(
                        shape.name, half, phase, path, total_flops(ops) / 1e9, total_bytes(ops) / 1e6,
                        launch_count(ops),
                        {g.name: phase_bound(ops, g) * 1e6 for g in gpus},
                        {g.name: phase_time(ops, g, efficiency_for=chooser) * 1e6 for g in gpus},
                        {g.name: _share_label(compute_share(ops, g)) for g in gpus}))
    return rows


def _share_label(share: float) -> str:
    return f"compute {share:.0%}" if share >= 0.5 else f"memory {1 - share:.0%}"


def speedups(rows: Sequence[Row]) -> list[dict]:
    """Per (shape, half, phase) and per shape's whole block step: unfused est / fused est, per GPU."""
    by_key = {(r.shape, r.half, r.phase, r.path): r for r in rows}
    out = []
    shapes = list(dict.fromkeys(r.shape for r in rows))
    gpu_names = list(rows[0].est_us) if rows else []
    for shape in shapes:
        step = {p: {g: 0.0 for g in gpu_names} for p in PATHS}
        for half in HALVES:
            for phase in PHASES:
                fused, unfused = by_key.get((shape, half, phase, "fused")), by_key.get((shape, half, phase, "unfused"))
                if fused is None or unfused is None:
                    continue
                for g in gpu_names:
                    step["fused"][g] += fused.est_us[g]
                    step["unfused"][g] += unfused.est_us[g]
                out.append({"shape": shape, "half": half, "phase": phase,
                            "bytes_ratio": unfused.mb / fused.mb,
                            **{g: unfused.est_us[g] / fused.est_us[g] for g in gpu_names}})
        out.append({"shape": shape, "half": "block", "phase": "step (fwd+recompute+bwd)", "bytes_ratio": float("nan"),
                    **{g: step["unfused"][g] / step["fused"][g] for g in gpu_names}})
    return out


def _short(gpu_name: str) -> str:
    return gpu_name.split()[0]


def markdown(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table, then the predicted speed-ups (fused vs eager) per GPU."""
    if not rows:
        return ""
    gpu_names = list(rows[0].est_us)
    head = ["shape", "half", "phase", "path", "GFLOP", "MB", "launches"]
    for g in gpu_names:
        head += [f"{_short(g)} bound us", f"{_short(g)} est us"]
    head.append(f"limited by ({_short(gpu_names[0])})")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.shape, r.half, r.phase, r.path, f"{r.gflop:.1f}", f"{r.mb:.1f}", str(r.launches)]
        for g in gpu_names:
            cells += [f"{r.bound_us[g]:.0f}", f"{r.est_us[g]:.0f}"]
        cells.append(r.limited_by[gpu_names[0]])
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Predicted speed-up of the fused path over eager (unfused est / fused est):", ""]
    head = ["shape", "half", "phase", "bytes unfused/fused"] + [_short(g) for g in gpu_names]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in speedups(rows):
        ratio = "" if math.isnan(s["bytes_ratio"]) else f"{s['bytes_ratio']:.2f}"
        lines.append("| " + " | ".join([s["shape"], s["half"], s["phase"], ratio] +
                                      [f"{s[g]:.2f}x" for g in gpu_names]) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.roofline", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                        help="production shapes to count (default: all)")
    parser.add_argument("--gpus", nargs="+", choices=list(GPUS), default=["h100", "h200"],
                        help="GPUs whose peaks the estimates use")
    parser.add_argument("--float-streams", action="store_true", help="fp32 streams instead of int32 fixed point")
    parser.add_argument("--no-engine", action="store_true", help="leave out the engine's passes around a half")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and speed-ups as JSON")
    args = parser.parse_args(argv)
    gpus = [GPUS[g] for g in args.gpus]
    rows = table(args.shapes, gpus, exact=not args.float_streams, engine=not args.no_engine)
    mode = "float (fp32) streams" if args.float_streams else "exact (int32) streams"
    print(f"Roofline per half, 8192 tokens, bf16 autocast, {mode}; "
          + "; ".join(f"{g.name}: {g.peak_flops / 1e12:.1f} TFLOP/s, {g.bandwidth / 1e12:.2f} TB/s" for g in gpus))
    print("bound = pure roofline (efficiency 1, no launch cost); est = Efficiency table + 4 us a launch\n")
    print(markdown(rows))
    if args.json:
        doc = {"mode": mode, "gpus": [dataclasses.asdict(g) for g in gpus],
               "efficiency": {g.name: dataclasses.asdict(default_efficiency(g)) for g in gpus},
               "shapes": {s: dataclasses.asdict(SHAPES[s]) for s in args.shapes},
               "rows": [dataclasses.asdict(r) for r in rows], "speedups": speedups(rows)}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
