"""QKV projection GEMM of the norm+attention half: raw operands, bias + RoPE epilogue.

    qkv[m, n] = sum_k n[m, k] * W[n, k] + b[n]     n = norm(x) * gamma + beta

The normalized rows n come from kernels/norm.py's normalize pass (the norm runs once per row,
in the GEMM operand dtype), so the main loop only loads and multiplies. The output
is the packed [M, (H + 2 KV) * D] buffer the attention kernel reads through strides. A column
tile holds HEADS_PER_TILE whole heads, each HEAD_PAD = next_power_of_2(D) lanes wide with its two
halves HEAD_PAD / 2 lanes apart (kernels/attention.py ``split_half_lanes``; the identity for a
power-of-two D), so the RoPE epilogue rotates the q and k heads of a tile in registers (token
index = row % tokens) and leaves the v heads alone. On sm_90, with descriptor-ready 16-bit operands
and a power-of-two D (a tile's columns are then W's rows side by side), the tiles arrive by TMA.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention import _table_key, _union, prune_by_table, rope_rotate, split_half_lanes
from .configs import interpreter_enabled

INTERPRET = interpreter_enabled()


def _qkv(bm, bk, heads_per_tile, warps, stages, tma=False):
    return triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "HEADS_PER_TILE": heads_per_tile, "GROUP_M": 8,
                          "USE_TMA": tma}, num_warps=warps, num_stages=stages)


# Per (arch, head-dim bucket): tiles BLOCK_M x (HEADS_PER_TILE * HEAD_PAD) x BLOCK_K, 128 or more
# columns wide at every head dim. No config uses local memory or stack (revtriton.aot). On sm_90 at
# head dim 128, two heads a tile by TMA (128 x 256, the tutorial-09 shape) issue at 0.15-0.16 of the
# tensor time in 213-218 registers, one head a tile at 0.30.
QKV_CONFIGS = {
    (90, 64): [_qkv(128, 64, 2, 8, 4, True), _qkv(128, 64, 2, 8, 3, True), _qkv(64, 64, 2, 4, 4, True)],
    (90, 128): [_qkv(128, 64, 2, 8, 3, True), _qkv(128, 64, 1, 8, 4, True), _qkv(64, 64, 1, 4, 4, True)],
    (90, 256): [_qkv(128, 64, 1, 8, 3, True), _qkv(64, 64, 1, 4, 3, True)],
    # (128 rows x 2 heads on 4 warps held 249 registers with triton 3.9: dropped)
    (80, 64): [_qkv(128, 32, 2, 8, 4), _qkv(64, 32, 2, 4, 4)],
    (80, 128): [_qkv(128, 32, 1, 8, 3), _qkv(64, 32, 1, 4, 4)],
    (80, 256): [_qkv(64, 32, 1, 8, 3)],
}
# fp32 operands (see kernels/attention.py's fp32 tables): narrower K steps, fewer stages.
QKV_CONFIGS.update({("fp32", 64): [_qkv(64, 32, 2, 4, 3)], ("fp32", 128): [_qkv(64, 32, 1, 4, 3)],
                    ("fp32", 256): [_qkv(64, 32, 1, 4, 2)]})
QKV_CONFIG_INTERPRETER = triton.Config({"BLOCK_M": 32, "BLOCK_K": 32, "HEADS_PER_TILE": 2, "GROUP_M": 4,
                                        "USE_TMA": True}, num_warps=4, num_stages=1)


def qkv_configs(head_dim: int | None = None, arch: int | None = None, element_size: int = 2) -> list:
    if INTERPRET:
        return [QKV_CONFIG_INTERPRETER]
    return _union(QKV_CONFIGS) if arch is None else QKV_CONFIGS[_table_key(head_dim, arch, element_size)]


@triton.autotune(configs=qkv_configs(), key=["M_BUCKET", "N", "K", "HEAD_DIM", "ROPE"],
                 prune_configs_by={"early_config_prune": prune_by_table(qkv_configs)}, cache_results=True)
@triton.jit(do_not_specialize=["M_BUCKET"])
def qkv_rope_gemm_kernel(X, W, BIAS, OUT, COS, SIN,
                         M, N, K, tokens, total_heads, rope_heads, M_BUCKET,
                         stride_xm, stride_wn, stride_wk, stride_om,
                         HAS_BIAS: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, TMA_READY: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr, HEADS_PER_TILE: tl.constexpr, GROUP_M: tl.constexpr,
                         USE_TMA: tl.constexpr):
    BLOCK_N: tl.constexpr = HEADS_PER_TILE * HEAD_PAD
    # By TMA (an sm_90 config, operands the launcher found descriptor-ready: 16-bit, W K-major) when
    # the tile's columns are W's rows side by side (power-of-two heads); pointer loads otherwise.
    TMA: tl.constexpr = USE_TMA and TMA_READY and HEAD_DIM == HEAD_PAD
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(total_heads, HEADS_PER_TILE)
    # Grouped ordering: GROUP_M row tiles share the W column tiles in L2.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    # Lane -> (head, column of that head): heads side by side, each in HEAD_PAD lanes.
    lanes_in_head, lane_ok = split_half_lanes(HEAD_DIM, HEAD_PAD)
    head_of_lane = pid_n * HEADS_PER_TILE + tl.arange(0, BLOCK_N) // HEAD_PAD
    if HEAD_DIM == HEAD_PAD:
        tile_cols = tl.arange(0, BLOCK_N)  # contiguous: pid_n * BLOCK_N + lane
        col_ok = head_of_lane < total_heads
    else:
        tile_cols = (tl.reshape(tl.broadcast_to(lanes_in_head[None, :], (HEADS_PER_TILE, HEAD_PAD)), (BLOCK_N,)) +
                     (tl.arange(0, BLOCK_N) // HEAD_PAD) * HEAD_DIM)
        col_ok = (head_of_lane < total_heads) & tl.reshape(
            tl.broadcast_to(lane_ok[None, :], (HEADS_PER_TILE, HEAD_PAD)), (BLOCK_N,))
    # Raw operands (the rows were normalized once, in the GEMM operand dtype): the main loop only
    # loads and multiplies. 64-bit scalar bases, 32-bit tile offsets.
    row0 = (pid_m * BLOCK_M).to(tl.int64)
    col0 = (pid_n * HEADS_PER_TILE * HEAD_DIM).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TMA:  # the copy engine brings the tiles; rows, columns and K past the edges arrive as zeros
        x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(W, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    else:  # rows / columns past the edge are clamped to valid addresses (never stored): only K is masked
        load_m = tl.minimum(offs_m, M - 1) - pid_m * BLOCK_M
        load_n = tl.where(col_ok, tile_cols, 0)
        x_ptrs = X + row0 * stride_xm + (load_m[:, None] * stride_xm + offs_k[None, :])
        w_ptrs = W + col0 * stride_wn + (load_n[None, :] * stride_wn + offs_k[:, None] * stride_wk)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(BIAS + col0 + tile_cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        if pid_n * HEADS_PER_TILE < rope_heads:  # a tile with q or k heads; v heads pass through
            pos = offs_m % tokens
            half = tl.arange(0, HEAD_PAD // 2)
            table = pos[:, None] * (HEAD_DIM // 2) + half[None, :]
            table_ok = row_ok[:, None] & (half < HEAD_DIM // 2)[None, :]
            cos = tl.load(COS + table, mask=table_ok, other=0.0)
            sin = tl.load(SIN + table, mask=table_ok, other=0.0)
            rotated = rope_rotate(acc, cos, sin, BLOCK_M, HEADS_PER_TILE, HEAD_PAD // 2)
            acc = tl.where((head_of_lane < rope_heads)[None, :], rotated, acc)
    out_ptrs = OUT + row0 * stride_om + col0 + (tl.arange(0, BLOCK_M)[:, None] * stride_om + tile_cols[None, :])
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
