"""Calibration anchors for the static model: public-tutorial-class kernels, compiled like ours.

Two kernels written after the structure of Triton's tutorials (not copies):
- ``anchor_matmul_kernel``: the tutorial-03 matmul: grouped tile order, pointer tiles advanced
  along K, masks on the K tail, fp32 accumulator, one store (no epilogue work).
- ``anchor_attention_fwd_kernel``: the tutorial-06 Hopper forward: tensor descriptors (TMA) for
  Q, K, V and O, exp2-based online softmax, the causal diagonal in a second, masked loop.

DESIGN.md section 7 records what these score under the issue model on sm_90 (matmul 0.24-0.44
with 64-deep K tiles, 0.60 with 32-deep; attention forward 0.52 at head dim 128, ~1.03 at 64);
tests/test_static.py checks the model reproduces that ranking, and perf/static.py prints them
beside the library's kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from revtriton import aot


@triton.jit
def anchor_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    tile_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    offs_m = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_tile = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - step * BLOCK_K
        a = tl.load(a_tile, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_tile, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _anchor_attention_steps(acc, l_i, m_i, q, k_desc, v_desc, row0, start_m, lo, hi, qk_scale,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr):
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = k_desc.load([row0 + start_n, 0])
        qk = tl.dot(q, k.T)
        if DIAGONAL:
            qk = qk * qk_scale + tl.where(offs_m[:, None] >= start_n + offs_n[None, :], 0.0, -1.0e6)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk -= m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([row0 + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def anchor_attention_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sm_scale, rows, seq_len,
                                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                CAUSAL: tl.constexpr):
    start_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    row0 = batch_head * seq_len
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(v_ptr, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(o_ptr, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.44269504  # log2(e): exp2 instead of exp
    q = q_desc.load([row0 + start_m * BLOCK_M, 0])
    hi = start_m * BLOCK_M if CAUSAL else seq_len
    acc, l_i, m_i = _anchor_attention_steps(acc, l_i, m_i, q, k_desc, v_desc, row0, start_m, 0, hi, qk_scale,
                                            BLOCK_M, BLOCK_N, False)
    if CAUSAL:
        acc, l_i, m_i = _anchor_attention_steps(acc, l_i, m_i, q, k_desc, v_desc, row0, start_m, hi,
                                                hi + BLOCK_M, qk_scale, BLOCK_M, BLOCK_N, True)
    m_i += tl.math.log2(l_i)
    tl.store(lse_ptr + batch_head * seq_len + start_m * BLOCK_M + tl.arange(0, BLOCK_M), m_i)
    o_desc.store([row0 + start_m * BLOCK_M, 0], (acc / l_i[:, None]).to(q.dtype))


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the tutorial-03 family on Hopper.
MATMUL_CONFIGS = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (64, 128, 32, 4, 4))
# (head dim, BLOCK_M, BLOCK_N, warps, stages): the tutorial-06 Hopper choice per head dim.
ATTENTION_CONFIGS = ((128, 128, 128, 8, 3), (64, 128, 128, 8, 3), (64, 128, 64, 4, 3))


def anchor_launches(tokens: int = 8192, dim: int = 4096) -> list:
    """(name, aot.Launch, config) for every anchor config, bf16, at production sizes."""
    bf16 = torch.bfloat16
    out = []
    for bm, bn, bk, warps, stages in MATMUL_CONFIGS:
        a = torch.empty(tokens, dim, device="meta", dtype=bf16)
        b = torch.empty(dim, dim, device="meta", dtype=bf16)
        c = torch.empty(tokens, dim, device="meta", dtype=bf16)
        config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                               num_stages=stages)
        args = (a, b, c, tokens, dim, dim, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
        grid = (triton.cdiv(tokens, bm) * triton.cdiv(dim, bn),)
        out.append((f"tutorial03_matmul/{bm}x{bn}x{bk}w{warps}s{stages}",
                    aot.Launch(anchor_matmul_kernel, grid, args, {}, "anchor"), config))
    for hd, bm, bn, warps, stages in ATTENTION_CONFIGS:
        heads, seq = 4096 // hd, 4096
        q = torch.empty(2 * heads * seq, hd, device="meta", dtype=bf16)
        lse = torch.empty(2 * heads * seq, device="meta", dtype=torch.float32)
        config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        args = (q, q, q, q, lse, 0.125, 2 * heads * seq, seq)  # [batch * heads * seq, head dim] views
        out.append((f"tutorial06_attention_fwd/d{hd}/{bm}x{bn}w{warps}s{stages}",
                    aot.Launch(anchor_attention_fwd_kernel, (seq // bm, 2 * heads, 1), args,
                               {"HEAD_DIM": hd, "CAUSAL": False}, "anchor"), config))
    return out
