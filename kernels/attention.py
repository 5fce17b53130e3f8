"""Flash attention (forward with the row log-sum-exp, backward without atomics) and its configs.

Layout: q [B, T, H, D], k and v [B, T, KV, D], any batch / token / head strides, unit stride on D
(so q, k and v can be views into the packed output of the QKV GEMM, [B*T, (H + 2 KV) * D]).
o, dq, dk, dv are written in the same [B, T, heads, D] layout; lse and delta are [B, H, T] fp32.
Grouped-query attention: query head h reads kv head h // (H // KV) (repeat_interleave order).

Backward is deterministic: one launch whose programs are of two kinds, decided by the program's
row in the grid: a dk/dv program owns one key block of one kv head and loops over every query
block of every query head in its group (so GQA sums in registers, no atomics); a dq program
owns one query block of one query head and loops over the key blocks. Both read the row
log-sum-exp of the forward and delta = rowsum(dO * O) from the preprocessing kernel. With RoPE
applied to q and k before attention (in the QKV GEMM epilogue), the backward un-rotates dq and
dk before storing them (the RoPE backward, fused).

Every loop runs the blocks that need no mask first and the masked ones (the causal diagonal, or
the ragged end of the sequence) last, so the common case pays for no mask.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

HEAD_DIMS = (16, 32, 64, 128)  # 64 and 128 are compiled ahead of time; 16 and 32 serve small tests

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def seq_bucket(seq_len: int) -> int:
    """Autotune key for the token count: next power of two, clamped to [16, 8192]."""
    return min(max(triton.next_power_of_2(seq_len), 16), 8192)


def _fwd(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def _bwd(fixed, stream, warps, stages):
    return triton.Config({"BLOCK_FIXED": fixed, "BLOCK_STREAM": stream}, num_warps=warps, num_stages=stages)


# Per (arch, head dim <= 64 or 128). Every config compiles for its arch with no local memory and no
# stack (revtriton.aot); configs that needed 255 registers plus stack were dropped.
FWD_CONFIGS = {
    (90, 64): [_fwd(128, 64, 4, 3), _fwd(128, 64, 8, 3), _fwd(64, 64, 4, 3), _fwd(128, 128, 8, 2)],
    (90, 128): [_fwd(128, 64, 8, 3), _fwd(64, 64, 4, 3)],
    (80, 64): [_fwd(128, 64, 8, 3), _fwd(64, 64, 4, 3), _fwd(128, 128, 8, 2)],
    (80, 128): [_fwd(128, 64, 8, 3), _fwd(64, 64, 4, 3)],
}
BWD_CONFIGS = {
    (90, 64): [_bwd(64, 64, 8, 2), _bwd(128, 32, 8, 2), _bwd(64, 32, 4, 3)],
    (90, 128): [_bwd(64, 32, 8, 2), _bwd(32, 32, 4, 3)],
    (80, 64): [_bwd(32, 64, 4, 2), _bwd(32, 32, 4, 3), _bwd(32, 32, 4, 2)],
    (80, 128): [_bwd(64, 32, 8, 2), _bwd(32, 32, 4, 3), _bwd(32, 32, 4, 2)],
}
# The interpreter runs programs serially: few, large tiles; one config (no autotune without a GPU).
FWD_CONFIG_INTERPRETER = _fwd(32, 32, 4, 1)
BWD_CONFIG_INTERPRETER = _bwd(32, 32, 4, 1)


def _table_key(head_dim, arch):
    return (90 if arch >= 90 else 80, 64 if head_dim is None or head_dim <= 64 else 128)


def config_key(config):
    return tuple(sorted(config.kwargs.items())) + (config.num_warps, config.num_stages)


def _union(table):
    seen, out = set(), []
    for configs in table.values():
        for c in configs:
            if config_key(c) not in seen:
                seen.add(config_key(c))
                out.append(c)
    return out


def fwd_configs(head_dim: int | None = None, arch: int | None = None) -> list:
    """Forward configs (BLOCK_M query rows per program, BLOCK_N keys per step) for (head dim, arch);
    both None: the union the kernel is decorated with."""
    if INTERPRET:
        return [FWD_CONFIG_INTERPRETER]
    return _union(FWD_CONFIGS) if arch is None else FWD_CONFIGS[_table_key(head_dim, arch)]


def bwd_configs(head_dim: int | None = None, arch: int | None = None) -> list:
    """Backward configs (BLOCK_FIXED rows a program owns, BLOCK_STREAM rows per loop step)."""
    if INTERPRET:
        return [BWD_CONFIG_INTERPRETER]
    return _union(BWD_CONFIGS) if arch is None else BWD_CONFIGS[_table_key(head_dim, arch)]


def delta_configs(head_dim: int | None = None, arch: int | None = None) -> list:
    return [triton.Config({"BLOCK_M": 32 if INTERPRET else 64}, num_warps=4, num_stages=1)]


def device_arch() -> int:
    import torch  # only reached when tuning on a GPU

    return torch.cuda.get_device_capability()[0] * 10


def prune_by_table(lister):
    """early_config_prune: keep the configs listed for the running device and the HEAD_DIM."""

    def prune(configs, named_args, **kwargs):
        if len(configs) <= 1:
            return configs
        wanted = {config_key(c) for c in lister(kwargs["HEAD_DIM"], device_arch())}
        return [c for c in configs if config_key(c) in wanted] or configs[:1]

    return prune


@triton.jit
def rope_rotate(x, cos, sin, ROWS: tl.constexpr, HALF: tl.constexpr):
    """Rotate-half RoPE of x [ROWS, 2*HALF] (fp32) with cos/sin [ROWS, HALF]; pass -sin to undo it.

    Pairs element d with d + HALF: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    pairs = tl.permute(tl.reshape(x, (ROWS, 2, HALF)), (0, 2, 1))
    x1, x2 = tl.split(pairs)
    rotated = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return tl.reshape(tl.permute(rotated, (0, 2, 1)), (ROWS, 2 * HALF))


@triton.jit
def _fwd_steps(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi, offs_m, offs_n, offs_d, seq_len,
               qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Online-softmax steps over key blocks [lo, hi); MASKED: apply the causal and sequence masks."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            col_ok = cols < seq_len
            k_t = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        else:
            k_t = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None])
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))
        # Every row sees key 0 in its first step, so m_new is finite and alpha never NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        else:
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=fwd_configs(), key=["HEAD_DIM", "CAUSAL", "seq_bucket"],
                 prune_configs_by={"early_config_prune": prune_by_table(fwd_configs)}, cache_results=True)
@triton.jit
def attention_fwd_kernel(Q, K, V, O, LSE,
                         stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                         stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
                         heads, group, seq_len, seq_bucket, sm_scale,
                         HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    kvh = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    qk_scale = sm_scale * 1.4426950408889634  # scores in log2 units: exp2 instead of exp

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Key blocks that need no mask first (entirely below the diagonal / inside the sequence),
    # then the masked ones (the diagonal, or the ragged tail).
    if CAUSAL:
        split = (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N
        hi = tl.minimum((pid_m + 1) * BLOCK_M, seq_len)
    else:
        split = (seq_len // BLOCK_N) * BLOCK_N
        hi = seq_len
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, 0, split, offs_m, offs_n,
                               offs_d, seq_len, qk_scale, False, CAUSAL, DOT_PRECISION, BLOCK_N)
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, split, hi, offs_m, offs_n,
                               offs_d, seq_len, qk_scale, True, CAUSAL, DOT_PRECISION, BLOCK_N)

    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural log of sum_j exp(sm_scale * q.k_j)
    tl.store(LSE + pid_bh * seq_len + offs_m, lse, mask=row_ok)


@triton.autotune(configs=delta_configs(), key=["HEAD_DIM"], cache_results=True)
@triton.jit
def attention_bwd_delta_kernel(O, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh,
                               heads, seq_len, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, t] = sum_d dO * O (fp32): the softmax-backward row term."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dt + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + pid_bh * seq_len + offs_m, tl.sum(o * do, 1), mask=row_ok)


@triton.jit
def _dkdv_steps(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, lo, hi, offs_n, offs_d,
                seq_len, qk_scale, CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_STREAM: tl.constexpr):
    """dk, dv contributions of the query blocks [lo, hi) of one query head."""
    for start_m in range(lo, hi, BLOCK_STREAM):
        offs_m = start_m + tl.arange(0, BLOCK_STREAM)
        row_ok = offs_m < seq_len
        q_t = tl.load(q_base + offs_m[None, :] * stride_qt + offs_d[:, None], mask=row_ok[None, :], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION) * qk_scale  # [keys, queries]
        p_t = tl.exp2(s_t - lse[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dq_steps(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo, hi, offs_m, offs_d, seq_len,
              qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_STREAM: tl.constexpr):
    """dq contributions of the key blocks [lo, hi); MASKED: apply the causal and sequence masks."""
    for start_n in range(lo, hi, BLOCK_STREAM):
        offs_n = start_n + tl.arange(0, BLOCK_STREAM)
        col_ok = offs_n < seq_len
        k_t = tl.load(k_base + offs_n[None, :] * stride_kt + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        v_t = tl.load(v_base + offs_n[None, :] * stride_vt + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            # (an out-of-range key would add 0 * exp2(-lse), which is NaN when exp2 overflows)
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, SIN, COS,
                  stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                  stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                  stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
                  pid_n, b, kvh, heads, group, seq_len, sm_scale,
                  HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  BLOCK_FIXED: tl.constexpr, BLOCK_STREAM: tl.constexpr):
    """dk, dv of one key block of kv head ``kvh``, summed over its query heads (no atomics)."""
    offs_n = pid_n * BLOCK_FIXED + tl.arange(0, BLOCK_FIXED)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < seq_len
    k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_FIXED, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_FIXED, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    # Causal: query blocks crossing the diagonal need the mask, the ones after it do not.
    # Out-of-range queries need no mask: their q and dO load as zeros and add nothing.
    lo = 0
    split = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_FIXED // BLOCK_STREAM) * BLOCK_STREAM  # earlier queries see none of these keys
        split = lo + tl.cdiv((pid_n + 1) * BLOCK_FIXED - lo, BLOCK_STREAM) * BLOCK_STREAM
    for g in range(0, group):
        h = kvh * group + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * heads + h) * seq_len
        dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, stride_qt, stride_dot,
                             lo, tl.minimum(split, seq_len), offs_n, offs_d, seq_len, qk_scale, CAUSAL,
                             DOT_PRECISION, BLOCK_STREAM)
        dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base, stride_qt, stride_dot,
                             split, seq_len, offs_n, offs_d, seq_len, qk_scale, False, DOT_PRECISION, BLOCK_STREAM)
    dk = dk * sm_scale
    if ROPE:
        half = tl.arange(0, HEAD_DIM // 2)
        cos = tl.load(COS + offs_n[:, None] * (HEAD_DIM // 2) + half[None, :], mask=col_ok[:, None], other=0.0)
        sin = tl.load(SIN + offs_n[:, None] * (HEAD_DIM // 2) + half[None, :], mask=col_ok[:, None], other=0.0)
        dk = rope_rotate(dk, cos, -sin, BLOCK_FIXED, HEAD_DIM // 2)
    tl.store(DK + b * stride_dkb + kvh * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + b * stride_dvb + kvh * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_program(Q, K, V, DO, LSE, DELTA, DQ, SIN, COS,
                stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                stride_dqb, stride_dqt, stride_dqh,
                pid_m, b, h, heads, group, seq_len, sm_scale,
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_FIXED: tl.constexpr, BLOCK_STREAM: tl.constexpr):
    """dq of one query block of query head ``h``."""
    kvh = h // group
    offs_m = pid_m * BLOCK_FIXED + tl.arange(0, BLOCK_FIXED)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    row_base = (b * heads + h) * seq_len
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    qk_scale = sm_scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_FIXED, HEAD_DIM], dtype=tl.float32)
    # Key blocks that need no mask first (below the diagonal / inside the sequence), then the
    # masked ones (the diagonal, or the ragged tail).
    if CAUSAL:
        split = (pid_m * BLOCK_FIXED // BLOCK_STREAM) * BLOCK_STREAM
        hi = tl.minimum((pid_m + 1) * BLOCK_FIXED, seq_len)
    else:
        split = (seq_len // BLOCK_STREAM) * BLOCK_STREAM
        hi = seq_len
    dq = _dq_steps(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, 0, split, offs_m, offs_d, seq_len,
                   qk_scale, False, CAUSAL, DOT_PRECISION, BLOCK_STREAM)
    dq = _dq_steps(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, split, hi, offs_m, offs_d, seq_len,
                   qk_scale, True, CAUSAL, DOT_PRECISION, BLOCK_STREAM)
    dq = dq * sm_scale
    if ROPE:
        half = tl.arange(0, HEAD_DIM // 2)
        cos = tl.load(COS + offs_m[:, None] * (HEAD_DIM // 2) + half[None, :], mask=row_ok[:, None], other=0.0)
        sin = tl.load(SIN + offs_m[:, None] * (HEAD_DIM // 2) + half[None, :], mask=row_ok[:, None], other=0.0)
        dq = rope_rotate(dq, cos, -sin, BLOCK_FIXED, HEAD_DIM // 2)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.autotune(configs=bwd_configs(), key=["HEAD_DIM", "CAUSAL", "ROPE", "seq_bucket"],
                 prune_configs_by={"early_config_prune": prune_by_table(bwd_configs)}, cache_results=True)
@triton.jit
def attention_bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, COS, SIN,
                         stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                         stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                         stride_dqb, stride_dqt, stride_dqh, stride_dkb, stride_dkt, stride_dkh,
                         stride_dvb, stride_dvt, stride_dvh,
                         heads, kv_heads, group, seq_len, seq_bucket, sm_scale, dkdv_programs,
                         HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, BLOCK_FIXED: tl.constexpr, BLOCK_STREAM: tl.constexpr):
    """Grid (cdiv(T, BLOCK_FIXED), B*KV + B*H): rows < B*KV are dk/dv programs, the rest dq programs."""
    pid_block = tl.program_id(0)
    pid_row = tl.program_id(1)
    if pid_row < dkdv_programs:
        _dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, SIN, COS,
                      stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                      stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                      stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
                      pid_block, pid_row // kv_heads, pid_row % kv_heads, heads, group, seq_len, sm_scale,
                      HEAD_DIM, CAUSAL, ROPE, DOT_PRECISION, BLOCK_FIXED, BLOCK_STREAM)
    else:
        row = pid_row - dkdv_programs
        _dq_program(Q, K, V, DO, LSE, DELTA, DQ, SIN, COS,
                    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                    stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                    stride_dqb, stride_dqt, stride_dqh,
                    pid_block, row // heads, row % heads, heads, group, seq_len, sm_scale,
                    HEAD_DIM, CAUSAL, ROPE, DOT_PRECISION, BLOCK_FIXED, BLOCK_STREAM)
