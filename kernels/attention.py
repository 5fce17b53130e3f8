"""Flash attention (forward with the row log-sum-exp, backward without atomics) and its configs.

Layout: q [B, T, H, D], k and v [B, T, KV, D], any batch / token / head strides, unit stride on D
(so q, k and v can be views into the packed output of the QKV GEMM, [B*T, (H + 2 KV) * D]).
o, dq, dk, dv are written in the same [B, T, heads, D] layout; lse and delta are [B, H, T] fp32.
Grouped-query attention: query head h reads kv head h // (H // KV) (repeat_interleave order).

Head dims: every multiple of 8 from 16 to 256. Tiles are HEAD_PAD = next_power_of_2(D) wide and
the lanes past D are masked (never copied). The backward keeps each half of a head in its own
half of the tile (lane c holds column (c // HALF_PAD) * D/2 + c % HALF_PAD), so the RoPE pairs
(d, d + D/2) sit HALF_PAD lanes apart at any head dim; for a power-of-two D that is the identity.

Forward (tutorial-06 family): one program per (query block, batch x head), folded into the grid's
x dimension; K / V tiles arrive by TMA (tensor descriptors, sm_90 configs: ``USE_TMA``) or
cp.async pointer loads (sm_80); exp2 online softmax; causal tiles above the diagonal skipped.

Backward (deterministic, no atomics), two launches. The dq pass runs first: program (query block,
batch x head) computes its rows' delta = rowsum(dO * O) (the pre-pass, fused: it has O and dO
in hand), stores it, and accumulates dq over the key blocks. The dk/dv pass: program (key block,
batch x kv head) accumulates dk and dv over the query blocks of every query head in its group, in
registers (GQA summed without atomics), reading the delta the dq pass wrote. Both order causal
blocks longest first. With RoPE applied to q and k before attention (in the QKV GEMM epilogue),
dq and dk are rotated back before they are stored (the RoPE backward, fused).

Padded and packed rows (``SEGMENTS``): each token's sequence number (SEG [B, T] int32, 0 for
padding) masks the scores as ``ops.attention.sequence_mask`` does (a real key of the query's own
sequence; a padding query sees every real key, or itself when none comes before it: SELF_UNTIL
[B]), with no [T, T] mask in memory; the online softmax guards rows that have seen no key yet.
Only the blocks a program's rows can reach run (SPANS [B, 6, T]: per token, the keys it may see
and the queries that may see it), so packed sequences cost about their own blocks, not the whole
row's. In the backward passes the blocks inside the run of one sequence that all of a program's
rows (dq) or keys (dk/dv) share take the unmasked loop (SPANS rows 4, 5: each token's run), the
rest the masked one; the forward masks every block (an unmasked loop there cost it its register
budget at head dim 128). The RoPE backward reads tables [T, D/2] shared by the batch, or one per
batch row (``stride_ropeb``: packed rows' positions).

Every loop runs the blocks that need no mask first and the masked ones (the causal diagonal, or
the ragged end of the sequence) last, so the common case pays for no mask. Batch and head offsets
are 64-bit; offsets inside one head's [T, D] slab are 32-bit per tile on a 64-bit scalar base.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .configs import config_key, interpreter_enabled, next_power_of_2

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
HEAD_DIMS = tuple(range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, 8))

INTERPRET = interpreter_enabled()


def head_pad(head_dim: int) -> int:
    """Tile width for a head dim: the next power of two."""
    return next_power_of_2(head_dim)


def seq_bucket(seq_len: int) -> int:
    """Autotune key for the token count: next power of two, clamped to [16, 8192]."""
    return min(max(next_power_of_2(seq_len), 16), 8192)


def _fwd(bm, bn, warps, stages, tma=False):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma}, num_warps=warps, num_stages=stages)


def _bwd(fixed, stream, warps, stages, tma=False):
    return triton.Config({"BLOCK_FIXED": fixed, "BLOCK_STREAM": stream, "USE_TMA": tma}, num_warps=warps,
                         num_stages=stages)


def _dkdv(fixed, stream, warps, stages, tma=False, one_loop=False):
    config = _bwd(fixed, stream, warps, stages, tma)
    config.kwargs["ONE_LOOP"] = one_loop
    return config


# The static gates' register bound (perf/static.py, aot.MAX_REGISTERS). A config whose
# compilations landed just past it is capped (ptxas's maxnreg): ptxas then schedules within the
# cap. Capping is not free in general (a cap can also make ptxas spill: seen with 2 stages
# below), so each capped config is one the static model compiles with no stack on triton 3.6 and
# 3.9 for every variant it serves.
MAX_REGISTERS = 232


def _capped(config):
    config.maxnreg = MAX_REGISTERS
    return config


# Per (arch, head-dim bucket 64 / 128 / 256). On sm_90 the streamed tiles (K / V in the forward and
# the dq pass, Q / dO in the dk/dv pass) arrive by TMA (``USE_TMA``; power-of-two head dims, other
# head dims fall back to pointer loads); sm_80 uses cp.async pointer loads. 128-row fixed blocks on
# 8 warps: 16 rows or more a warp (no replicated warps). What the sm_90 compilations give at the
# production shapes (revtriton.aot, perf/results/static-*.md; issue ratio of the steady loop):
#   forward 128 x 128 and 64 x 128: the tutorial-06 anchor's ratio at head dim 64 and 128 (1.03 /
#     0.52), <= 194 registers;
#   dq pass 128 x 64: 0.68 (64) / 0.41 (128), <= 182 registers;
#   dk/dv pass, 64: 128 x 64 on 3 stages, ratio 0.69-0.77; registers depend on the compiler:
#     204-237 with triton 3.9, 234-255 with 3.6 uncapped; capped at 232, 206-225 (3.9) and 232
#     (3.6) with no stack. 2 stages capped spilled 8 bytes under a causal mask on 3.9: dropped;
#   dk/dv pass, 128: two 128 x 128 fp32 accumulators are 128 registers a thread on 8 warps
#     (FlashAttention-3 gives these warps 240 with setmaxnreg, which Triton cannot). In the
#     three-loop form 128 x 32 tiles used all 255 registers (64 bytes of stack with triton 3.6)
#     and 128 x 16 tiles issued too much (ratio 0.93); the one-loop form (ONE_LOOP) runs 128 x 32
#     in 213-219 registers (3.9) / 229-231 (3.6), ratio 0.65 / 0.57, no stack (capped: its packed-
#     rows variant 237 -> 221 on 3.6); sm_80's 32 x 32 255 -> 187 registers;
#   packed rows (SEGMENTS) at head dim 128 hold more per score tile: capped, the forward's sm_90
#     tiles 234-254 -> 210-232 and the dq pass's sm_80 64 x 32 236 -> 228-232; the sm_80
#     forward's 64 x 32 spilled under the cap (8-16 bytes, 2 or 3 stages by compiler), so packed
#     rows take FWD_PACKED_ROWS_CONFIGS there;
#   head dim 256 (Gemma): correct, not tuned (the dk/dv pass spills).
FWD_CONFIGS = {
    (90, 64): [_fwd(128, 128, 8, 3, True), _fwd(128, 128, 8, 2, True), _fwd(64, 128, 4, 3, True)],
    (90, 128): [_capped(_fwd(128, 128, 8, 3, True)), _capped(_fwd(128, 128, 8, 2, True)),
                _capped(_fwd(64, 128, 4, 3, True))],
    (90, 256): [_fwd(64, 64, 4, 2, True), _fwd(64, 32, 4, 2, True)],
    (80, 64): [_fwd(64, 64, 4, 3, False), _fwd(64, 32, 4, 3, False)],
    (80, 128): [_capped(_fwd(64, 32, 4, 3, False)), _capped(_fwd(64, 32, 4, 2, False))],
    (80, 256): [_fwd(64, 32, 4, 2, False)],
}
# The forward's tiles for packed rows where the table's cannot hold them (see above): 218-223
# registers capped on both compilers.
FWD_PACKED_ROWS_CONFIGS = {
    (80, 128): [_capped(_fwd(64, 16, 4, 3, False)), _capped(_fwd(32, 64, 4, 3, False))],
}
# dk/dv pass: BLOCK_FIXED keys a program, BLOCK_STREAM queries a step; dq pass: BLOCK_FIXED queries,
# BLOCK_STREAM keys (the tutorial's BLOCK_N1 / BLOCK_M1 and BLOCK_M2 / BLOCK_N2).
DKDV_CONFIGS = {
    (90, 64): [_capped(_dkdv(128, 64, 8, 3, True))],
    (90, 128): [_capped(_dkdv(128, 32, 8, 2, True, one_loop=True)),
                _capped(_dkdv(128, 32, 8, 3, True, one_loop=True))],
    (90, 256): [_dkdv(64, 32, 4, 2, True)],
    (80, 64): [_dkdv(32, 32, 4, 2)],
    (80, 128): [_dkdv(32, 32, 4, 2, one_loop=True)],
    (80, 256): [_dkdv(32, 16, 4, 1)],
}
DQ_CONFIGS = {
    (90, 64): [_bwd(128, 64, 8, 2, True), _bwd(128, 64, 8, 3, True)],
    (90, 128): [_bwd(128, 64, 8, 2, True), _bwd(128, 32, 8, 2, True)],
    (90, 256): [_bwd(64, 32, 4, 2, True)],
    (80, 64): [_bwd(64, 32, 4, 2), _bwd(32, 32, 4, 2)],
    (80, 128): [_capped(_bwd(64, 32, 4, 2)), _bwd(32, 32, 4, 2)],
    (80, 256): [_bwd(32, 16, 4, 1)],
}
# fp32 operands (a model run without autocast; tl.dot takes them as tf32): the tiles above hold
# 2-byte elements, and at 4 bytes their pipelined K / V stages overflow shared memory (seen on an
# H200: 458784 bytes asked at head dim 80, 232448 there). These fit sm_80's 163 KB at every head
# dim with pointer loads and 2 stages (tests/test_static.py compiles them); fp32 attention is a
# correctness path, not a tuned one.
for _table, _configs in ((FWD_CONFIGS, {64: [_fwd(64, 64, 4, 2)], 128: [_fwd(64, 32, 4, 2)],
                                        256: [_fwd(32, 16, 4, 2)]}),
                         (DKDV_CONFIGS, {64: [_dkdv(64, 32, 4, 2)], 128: [_dkdv(64, 16, 4, 2)],
                                         256: [_dkdv(32, 16, 4, 2)]}),
                         (DQ_CONFIGS, {64: [_bwd(64, 32, 4, 2)], 128: [_bwd(64, 16, 4, 2)],
                                       256: [_bwd(32, 16, 4, 2)]})):
    _table.update({("fp32", bucket): configs for bucket, configs in _configs.items()})
# The interpreter runs programs serially: small tiles, one config (no autotune without a GPU);
# tests/test_tiles.py runs every table shape, both load paths, by pinning it.
FWD_CONFIG_INTERPRETER = _fwd(32, 32, 4, 1, True)
DKDV_CONFIG_INTERPRETER = _dkdv(32, 16, 4, 1, True)
DQ_CONFIG_INTERPRETER = _bwd(16, 32, 4, 1, True)


def _table_key(head_dim, arch, element_size=2):
    """A table's key: (arch, head-dim bucket), or ("fp32", bucket) for 4-byte operands on any arch."""
    bucket = 64 if head_dim is None or head_dim <= 64 else 128 if head_dim <= 128 else 256
    return ("fp32", bucket) if element_size == 4 else (90 if arch >= 90 else 80, bucket)


def _union(*tables):
    seen, out = set(), []
    for configs in (configs for table in tables for configs in table.values()):
        for c in configs:
            if config_key(c) not in seen:
                seen.add(config_key(c))
                out.append(c)
    return out


def fwd_configs(head_dim: int | None = None, arch: int | None = None, element_size: int = 2) -> list:
    """Forward configs (BLOCK_M query rows per program, BLOCK_N keys per step, USE_TMA) for (head
    dim, arch); both None: the union the kernel is decorated with."""
    if INTERPRET:
        return [FWD_CONFIG_INTERPRETER]
    if arch is None:
        return _union(FWD_CONFIGS, FWD_PACKED_ROWS_CONFIGS)
    return FWD_CONFIGS[_table_key(head_dim, arch, element_size)]


def dkdv_configs(head_dim: int | None = None, arch: int | None = None, element_size: int = 2) -> list:
    """dk/dv pass configs (BLOCK_FIXED keys a program owns, BLOCK_STREAM queries a loop step)."""
    if INTERPRET:
        return [DKDV_CONFIG_INTERPRETER]
    return _union(DKDV_CONFIGS) if arch is None else DKDV_CONFIGS[_table_key(head_dim, arch, element_size)]


def dq_configs(head_dim: int | None = None, arch: int | None = None, element_size: int = 2) -> list:
    """dq pass configs (BLOCK_FIXED queries a program owns, BLOCK_STREAM keys a loop step)."""
    if INTERPRET:
        return [DQ_CONFIG_INTERPRETER]
    return _union(DQ_CONFIGS) if arch is None else DQ_CONFIGS[_table_key(head_dim, arch, element_size)]


def device_arch() -> int:
    import torch  # only reached when tuning on a GPU

    return torch.cuda.get_device_capability()[0] * 10


def prune_by_table(lister, packed_rows=None):
    """early_config_prune: keep the configs listed for the running device, the HEAD_DIM and the
    operands' element size (the kernel's first argument is its first operand); with packed rows
    (SEGMENTS) those of ``packed_rows`` ({table key: configs}) where it lists the key."""

    def prune(configs, named_args, **kwargs):
        if len(configs) <= 1:
            return configs
        element_size = next(iter(named_args.values())).element_size()
        head_dim, arch = kwargs["HEAD_DIM"], device_arch()
        listed = lister(head_dim, arch, element_size)
        if packed_rows and kwargs.get("SEGMENTS"):
            listed = packed_rows.get(_table_key(head_dim, arch, element_size), listed)
        wanted = {config_key(c) for c in listed}
        return [c for c in configs if config_key(c) in wanted] or configs[:1]

    return prune


# --------------------------------------------------------------------------------------------
# Tiles of a head


@triton.jit
def contiguous_lanes(HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """(column offset of each lane, lane holds a column): lanes in column order, masked past D."""
    lanes = tl.arange(0, HEAD_PAD)
    return lanes, lanes < HEAD_DIM


@triton.jit
def split_half_lanes(HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """(column offset of each lane, lane holds a column) with each half of the head in its own
    half of the tile: RoPE partners are HEAD_PAD / 2 lanes apart (identity for power-of-two D)."""
    lanes = tl.arange(0, HEAD_PAD)
    if HEAD_DIM == HEAD_PAD:
        columns = lanes
        valid = lanes < HEAD_PAD
    else:
        within = lanes % (HEAD_PAD // 2)
        columns = (lanes // (HEAD_PAD // 2)) * (HEAD_DIM // 2) + within
        valid = within < HEAD_DIM // 2
    return columns, valid


@triton.jit
def load_tile(base, rows, stride_t, columns, row_ok, column_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """[len(rows), HEAD_PAD] tile at base + rows * stride_t + columns; zeros where masked."""
    ptrs = base + (rows[:, None] * stride_t + columns[None, :])
    if MASK_ROWS:
        if EVEN_D:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None] & column_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=column_ok[None, :], other=0.0)
    return tile


@triton.jit
def store_tile(base, rows, stride_t, columns, row_ok, column_ok, value):
    tl.store(base + (rows[:, None] * stride_t + columns[None, :]), value.to(base.dtype.element_ty),
             mask=row_ok[:, None] & column_ok[None, :])


@triton.jit
def head_tiles(base, batch, seq_len, heads, stride_b, stride_t, stride_h, HEAD_DIM: tl.constexpr,
               ROWS: tl.constexpr, HEAD_PAD: tl.constexpr):
    """TMA descriptor of [batch, seq_len, heads, HEAD_DIM] loading [ROWS, HEAD_PAD] tiles of one head
    (``.load([b, row, head, 0])``; rows past seq_len and lanes past HEAD_DIM arrive as zeros)."""
    return tl.make_tensor_descriptor(base, shape=[batch, seq_len, heads, HEAD_DIM],
                                     strides=[stride_b, stride_t, stride_h, 1], block_shape=[1, ROWS, 1, HEAD_PAD])


@triton.jit
def load_head_rows(desc, base, b, head, start, stride_t, rows, row_ok, columns, column_ok, MASKED: tl.constexpr,
                   EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, ROWS: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Rows start .. start + ROWS of one head as a [ROWS, HEAD_PAD] tile: by TMA (``desc``, see
    :func:`head_tiles`: rows past the end and lanes past the head arrive as zeros), or by pointer
    loads from ``base`` (the head's first row; masked as :func:`load_tile` is asked)."""
    if USE_TMA:
        tile = tl.reshape(desc.load([b.to(tl.int32), start, head.to(tl.int32), 0]), (ROWS, HEAD_PAD))
    else:
        tile = load_tile(base + start.to(tl.int64) * stride_t, rows, stride_t, columns, row_ok, column_ok, MASKED,
                         EVEN_D)
    return tile


@triton.jit
def rope_rotate(x, cos, sin, ROWS: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr):
    """Rotate-half RoPE of x [ROWS, HEADS * 2 * HALF] (fp32; each head's halves HALF lanes apart)
    with cos / sin [ROWS, HALF] shared by the heads; pass -sin to undo it.

    Pairs lane d with d + HALF of each head: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    pairs = tl.permute(tl.reshape(x, (ROWS, HEADS, 2, HALF)), (0, 1, 3, 2))
    x1, x2 = tl.split(pairs)
    c = tl.expand_dims(cos, 1)
    s = tl.expand_dims(sin, 1)
    rotated = tl.join(x1 * c - x2 * s, x2 * c + x1 * s)
    return tl.reshape(tl.permute(rotated, (0, 1, 3, 2)), (ROWS, HEADS * 2 * HALF))


@triton.jit
def load_rope_tables(COS, SIN, rows, row_ok, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """cos, sin [len(rows), HEAD_PAD / 2] of the tables [T, HEAD_DIM / 2]; zeros past the edge."""
    half = tl.arange(0, HEAD_PAD // 2)
    mask = row_ok[:, None] & (half < HEAD_DIM // 2)[None, :]
    offsets = rows[:, None] * (HEAD_DIM // 2) + half[None, :]
    return tl.load(COS + offsets, mask=mask, other=0.0), tl.load(SIN + offsets, mask=mask, other=0.0)


# Padded / packed rows: a key's code is its sequence number, or -(position + 1) for padding; a
# query sees the keys whose code lies in its [lo, hi] (ops.attention.sequence_mask): its own
# sequence (lo = hi = its number), every real key (a padding query: [1, max]), or only itself (a
# padding query with no real key before it: lo = hi = -(position + 1)). Two compares per score.


@triton.jit
def key_codes(SEG, b, offs, ok, stride_segb):
    seg = tl.load(SEG + b * stride_segb + offs, mask=ok, other=0)
    return tl.where(seg != 0, seg, -(offs + 1))


@triton.jit
def query_bounds(SEG, SELF_UNTIL, b, offs, ok, stride_segb):
    """(lo, hi) of the key codes the query rows ``offs`` of batch ``b`` see."""
    seg = tl.load(SEG + b * stride_segb + offs, mask=ok, other=0)
    alone = (seg == 0) & (offs < tl.load(SELF_UNTIL + b))
    lo = tl.where(seg != 0, seg, tl.where(alone, -(offs + 1), 1))
    hi = tl.where(seg != 0, seg, tl.where(alone, -(offs + 1), 2147483647))
    return lo, hi


@triton.jit
def block_span(SPANS, b, offs, ok, seq_len, WHICH: tl.constexpr):
    """[first, end) over the tokens ``offs`` of batch ``b`` of SPANS [B, 6, T]: WHICH 0, the keys
    these queries may see; WHICH 2, the queries that may see these keys (the launcher's superset
    of the mask, ops.fused_attention.segment_spans). Blocks outside it are masked for every row:
    skipping them changes no bit (their p is 0 everywhere)."""
    base = SPANS + b * 6 * seq_len + WHICH * seq_len
    first = tl.min(tl.load(base + offs, mask=ok, other=seq_len), 0)
    end = tl.max(tl.load(base + seq_len + offs, mask=ok, other=0), 0)
    return first, end


@triton.jit
def unmasked_span(SPANS, b, offs, ok, seq_len, lo, hi, BLOCK: tl.constexpr):
    """[free_lo, free_hi) with lo <= free_lo <= free_hi <= max(lo, hi): the whole blocks (of BLOCK
    tokens, inside [lo, hi)) of the run that all tokens ``offs`` of batch ``b`` share (SPANS rows 4,
    5), or an empty range. Every score between those tokens and that run is unmasked (one code on
    both sides), so these blocks take the unmasked loop; tokens past the sequence end do not narrow it."""
    base = SPANS + b * 6 * seq_len + 4 * seq_len
    run_first = tl.max(tl.load(base + offs, mask=ok, other=0), 0)
    run_end = tl.min(tl.load(base + seq_len + offs, mask=ok, other=seq_len), 0)
    hi = tl.maximum(hi, lo)
    free_lo = tl.minimum(tl.maximum(tl.cdiv(run_first, BLOCK) * BLOCK, lo), hi)
    free_hi = tl.minimum(tl.maximum((run_end // BLOCK) * BLOCK, free_lo), hi)
    return free_lo, free_hi


@triton.jit
def key_blocks(pid_m, offs_m, row_ok, b, seq_len, SEG, SELF_UNTIL, SPANS, stride_segb, CAUSAL: tl.constexpr,
               SEGMENTS: tl.constexpr, RUNS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_KEYS: tl.constexpr):
    """The key loops of a program owning query rows (forward, dq pass): (free_lo, free_hi, start, hi,
    lo_q, hi_q). Blocks [free_lo, free_hi) need no mask (entirely below the diagonal / inside the
    sequence) and run first; the others in [start, hi) do (the diagonal, or the ragged tail) and run
    after them in one masked loop; causal blocks above are skipped. Without SEGMENTS free_lo = 0 and
    start = free_hi. With SEGMENTS only the blocks these rows' sequences span run (another sequence
    may share one); with RUNS too the unmasked ones are those inside the run all the rows share (none
    when the rows straddle two sequences or padding), which the masked loop skips, else there are
    none; lo_q / hi_q are the key codes each row sees (its own index without SEGMENTS)."""
    if CAUSAL:
        split = (pid_m * BLOCK_ROWS // BLOCK_KEYS) * BLOCK_KEYS  # (BLOCK_KEYS may exceed BLOCK_ROWS)
        hi = tl.minimum((pid_m + 1) * BLOCK_ROWS, seq_len)
    else:
        split = (seq_len // BLOCK_KEYS) * BLOCK_KEYS
        hi = seq_len
    start = split
    free_lo = 0
    free_hi = split
    if SEGMENTS:
        first, end = block_span(SPANS, b, offs_m, row_ok, seq_len, 0)
        start = (first // BLOCK_KEYS) * BLOCK_KEYS
        hi = tl.minimum(hi, end)
        free_lo = start
        free_hi = start
        if RUNS:
            free_lo, free_hi = unmasked_span(SPANS, b, offs_m, row_ok, seq_len, start, tl.minimum(split, hi),
                                             BLOCK_KEYS)
        lo_q, hi_q = query_bounds(SEG, SELF_UNTIL, b, offs_m, row_ok, stride_segb)
    else:
        lo_q = offs_m
        hi_q = offs_m
    return free_lo, free_hi, start, hi, lo_q, hi_q


# --------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_steps(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, b, kvh, stride_kt, stride_vt, lo, hi,
               offs_m, offs_n, lanes, lane_ok, seq_len, qk_scale, SEG, stride_segb, lo_q, hi_q,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, USE_TMA: tl.constexpr,
               EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Online-softmax steps over key blocks [lo, hi); MASKED: apply the causal and sequence masks
    (and with SEGMENTS the padded / packed rows' mask: the queries see key codes in [lo_q, hi_q])."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_head_rows(k_desc, k_base, b, kvh, start_n, stride_kt, offs_n, cols < seq_len, lanes, lane_ok, MASKED,
                           EVEN_D, USE_TMA, BLOCK_N, HEAD_PAD)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            valid = cols[None, :] < seq_len
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            if SEGMENTS:
                code = key_codes(SEG, b, cols, cols < seq_len, stride_segb)
                valid = valid & (code[None, :] >= lo_q[:, None]) & (code[None, :] <= hi_q[:, None])
            s = tl.where(valid, s, float("-inf"))
        # Without SEGMENTS every row sees key 0 in its first step, so m_new is finite and alpha never
        # NaN; with them a row may see no key of a block (or of any block yet): its max is taken as 0.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if SEGMENTS:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_head_rows(v_desc, v_base, b, kvh, start_n, stride_vt, offs_n, cols < seq_len, lanes, lane_ok, MASKED,
                           EVEN_D, USE_TMA, BLOCK_N, HEAD_PAD)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=fwd_configs(), key=["HEAD_DIM", "CAUSAL", "SEGMENTS", "seq_bucket"],
                 prune_configs_by={"early_config_prune": prune_by_table(fwd_configs, FWD_PACKED_ROWS_CONFIGS)},
                 cache_results=True)
@triton.jit
def attention_fwd_kernel(Q, K, V, O, LSE, SEG, SELF_UNTIL, SPANS,
                         stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                         stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_segb,
                         batch, heads, kv_heads, seq_len, seq_bucket, sm_scale,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                         SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M) * B * H,): program -> (query block, batch x head), heaviest causal
    blocks first. SEGMENTS: padded / packed rows, SEG [B, T] int32 segment ids (0: padding) and
    SELF_UNTIL [B] (a padding query before it sees itself), every key block masked."""
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_PAD
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(seq_len, BLOCK_M)
    pid_m = tiles_m - 1 - pid % tiles_m
    pid_bh = pid // tiles_m
    b = pid_bh // heads
    h = pid_bh % heads
    kvh = h // (heads // kv_heads)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    lanes, lane_ok = contiguous_lanes(HEAD_DIM, HEAD_PAD)
    row_ok = offs_m < seq_len
    b64 = b.to(tl.int64)

    m0 = (pid_m * BLOCK_M).to(tl.int64)  # 64-bit block start: T x token stride may pass 2^31
    rows = tl.arange(0, BLOCK_M)
    q = load_tile(Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + m0 * stride_qt, rows, stride_qt, lanes, row_ok,
                  lane_ok, True, EVEN_D)
    k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh
    k_desc = None
    v_desc = None
    if USE_TMA:
        k_desc = head_tiles(K, batch, seq_len, kv_heads, stride_kb, stride_kt, stride_kh, HEAD_DIM, BLOCK_N, HEAD_PAD)
        v_desc = head_tiles(V, batch, seq_len, kv_heads, stride_vb, stride_vt, stride_vh, HEAD_DIM, BLOCK_N, HEAD_PAD)
    qk_scale = sm_scale * 1.4426950408889634  # scores in log2 units: exp2 instead of exp

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    # (SEGMENTS: every block masked. An unmasked loop over the run the rows share, as the dq pass has,
    # took the head dim 128 kernel past 232 registers with spills whichever way its loops were laid out.)
    free_lo, free_hi, start, hi, lo_q, hi_q = key_blocks(pid_m, offs_m, row_ok, b64, seq_len, SEG, SELF_UNTIL, SPANS,
                                                         stride_segb, CAUSAL, SEGMENTS, False, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, b, kvh, stride_kt, stride_vt,
                               free_lo, free_hi, offs_m, offs_n, lanes, lane_ok, seq_len, qk_scale, SEG, stride_segb,
                               lo_q, hi_q, False, CAUSAL, SEGMENTS, USE_TMA, EVEN_D, DOT_PRECISION, BLOCK_N, HEAD_PAD)
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, b, kvh, stride_kt, stride_vt,
                               start, hi, offs_m, offs_n, lanes, lane_ok, seq_len, qk_scale, SEG, stride_segb, lo_q,
                               hi_q, True, CAUSAL, SEGMENTS, USE_TMA, EVEN_D, DOT_PRECISION, BLOCK_N, HEAD_PAD)

    acc = acc / l_i[:, None]
    store_tile(O + b64 * stride_ob + h.to(tl.int64) * stride_oh + m0 * stride_ot, rows, stride_ot, lanes, row_ok,
               lane_ok, acc)
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural log of sum_j exp(sm_scale * q.k_j)
    tl.store(LSE + pid_bh.to(tl.int64) * seq_len + offs_m, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _dkdv_steps(dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, lse_base, delta_base, stride_qt, stride_dot,
                lo, hi, offs_n, offs_s, columns, column_ok, seq_len, qk_scale, SEG, SELF_UNTIL, stride_segb, code_k,
                MASKED: tl.constexpr, FOLD_ROW_TERMS: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr,
                EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_STREAM: tl.constexpr,
                HEAD_PAD: tl.constexpr):
    """dk, dv contributions of the query blocks [lo, hi) of one query head. MASKED: the causal
    mask and the sequence end (rows past it load q = dO = 0, lse = delta = 0: they add zero).
    Scores are kept transposed ([keys, queries]) so P^T and dS^T feed the dV / dK products as
    they are (k and v stay in shared memory as the A operands).

    FOLD_ROW_TERMS: S^T's product starts from -lse / sm_scale (-inf where masked) and dP^T's from
    -delta, so the row terms and the mask ride in the dots' accumulators instead of a pass over
    each product after it (fewer live registers; used by the one-loop form, see ONE_LOOP)."""
    zero_scores = tl.zeros([offs_n.shape[0], BLOCK_STREAM], dtype=tl.float32)
    for start_m in range(lo, hi, BLOCK_STREAM):
        start_m = tl.multiple_of(start_m, BLOCK_STREAM)
        offs_m = start_m + offs_s
        row_ok = offs_m < seq_len
        q = load_head_rows(q_desc, q_base, b, h, start_m, stride_qt, offs_s, row_ok, columns, column_ok, MASKED,
                           EVEN_D, USE_TMA, BLOCK_STREAM, HEAD_PAD)
        do = load_head_rows(do_desc, do_base, b, h, start_m, stride_dot, offs_s, row_ok, columns, column_ok, MASKED,
                            EVEN_D, USE_TMA, BLOCK_STREAM, HEAD_PAD)
        if MASKED:
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        if FOLD_ROW_TERMS:
            s_t = zero_scores - lse[None, :] * (1.4426950408889634 / qk_scale)  # qk_scale / log2(e) = sm_scale
            if MASKED:
                if CAUSAL:
                    s_t = tl.where(offs_m[None, :] >= offs_n[:, None], s_t, float("-inf"))
                if SEGMENTS:
                    lo_q, hi_q = query_bounds(SEG, SELF_UNTIL, b, offs_m, row_ok, stride_segb)
                    allowed = (code_k[:, None] >= lo_q[None, :]) & (code_k[:, None] <= hi_q[None, :])
                    s_t = tl.where(allowed & row_ok[None, :], s_t, float("-inf"))
            s_t = tl.dot(k, tl.trans(q), s_t, input_precision=DOT_PRECISION)  # [keys, queries]
            p_t = tl.exp2(s_t * qk_scale)
        else:
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [keys, queries]
            p_t = tl.exp2(s_t * qk_scale - lse[None, :] * 1.4426950408889634)
            if MASKED:
                if CAUSAL:
                    p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
                if SEGMENTS:
                    lo_q, hi_q = query_bounds(SEG, SELF_UNTIL, b, offs_m, row_ok, stride_segb)
                    allowed = (code_k[:, None] >= lo_q[None, :]) & (code_k[:, None] <= hi_q[None, :])
                    p_t = tl.where(allowed & row_ok[None, :], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        if FOLD_ROW_TERMS:
            ds_t = p_t * tl.dot(v, tl.trans(do), zero_scores - delta[None, :], input_precision=DOT_PRECISION)
        else:
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dq_steps(dq, q, do, lse, delta, k_base, v_base, k_desc, v_desc, b, kvh, stride_kt, stride_vt, lo, hi, offs_m,
              offs_s, columns, column_ok, seq_len, qk_scale, SEG, stride_segb, lo_q, hi_q, skip_lo, skip_hi,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, EVEN_D: tl.constexpr,
              USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_STREAM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """dq contributions of the key blocks [lo, hi); MASKED: apply the causal and sequence masks (with
    SEGMENTS skipping the blocks [skip_lo, skip_hi) the unmasked loop ran)."""
    lse2 = lse * 1.4426950408889634
    gap = 0
    if SEGMENTS and MASKED:
        gap = skip_hi - skip_lo
    for start_n in range(lo, hi - gap, BLOCK_STREAM):
        if SEGMENTS and MASKED:
            start_n += (start_n >= skip_lo).to(tl.int32) * gap
        start_n = tl.multiple_of(start_n, BLOCK_STREAM)
        offs_n = start_n + offs_s
        col_ok = offs_n < seq_len
        k = load_head_rows(k_desc, k_base, b, kvh, start_n, stride_kt, offs_s, col_ok, columns, column_ok, MASKED,
                           EVEN_D, USE_TMA, BLOCK_STREAM, HEAD_PAD)
        v = load_head_rows(v_desc, v_base, b, kvh, start_n, stride_vt, offs_s, col_ok, columns, column_ok, MASKED,
                           EVEN_D, USE_TMA, BLOCK_STREAM, HEAD_PAD)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            # (an out-of-range key would add 0 * exp2(-lse), which is NaN when exp2 overflows)
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            if SEGMENTS:
                code = key_codes(SEG, b, offs_n, col_ok, stride_segb)
                valid = valid & (code[None, :] >= lo_q[:, None]) & (code[None, :] <= hi_q[:, None])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.autotune(configs=dq_configs(), key=["HEAD_DIM", "CAUSAL", "ROPE", "SEGMENTS", "seq_bucket"],
                 prune_configs_by={"early_config_prune": prune_by_table(dq_configs)}, cache_results=True)
@triton.jit
def attention_bwd_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, COS, SIN, SEG, SELF_UNTIL, SPANS,
                            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                            stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
                            stride_dob, stride_dot, stride_doh, stride_dqb, stride_dqt, stride_dqh, stride_segb,
                            stride_ropeb, batch, heads, kv_heads, seq_len, seq_bucket, sm_scale,
                            HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr,
                            SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_FIXED: tl.constexpr,
                            BLOCK_STREAM: tl.constexpr, USE_TMA: tl.constexpr):
    """Grid (cdiv(T, BLOCK_FIXED) * B * H,): program -> (query block, batch x head), longest causal
    blocks first. Computes its rows' delta = rowsum(dO * O) (fp32), stores it for the dk/dv pass,
    and dq = sum over key blocks of (P * (dP - delta)) K * scale."""
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_PAD
    pid = tl.program_id(0)
    tiles = tl.cdiv(seq_len, BLOCK_FIXED)
    pid_m = tiles - 1 - pid % tiles
    pid_bh = pid // tiles
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    kvh = h // (heads // kv_heads)
    columns, column_ok = split_half_lanes(HEAD_DIM, HEAD_PAD)
    offs_m = pid_m * BLOCK_FIXED + tl.arange(0, BLOCK_FIXED)
    row_ok = offs_m < seq_len
    offs_s = tl.arange(0, BLOCK_STREAM)
    m0 = (pid_m * BLOCK_FIXED).to(tl.int64)  # 64-bit block start: T x token stride may pass 2^31
    rows = tl.arange(0, BLOCK_FIXED)
    qk_scale = sm_scale * 1.4426950408889634
    row_base = pid_bh.to(tl.int64) * seq_len
    q = load_tile(Q + b * stride_qb + h * stride_qh + m0 * stride_qt, rows, stride_qt, columns, row_ok, column_ok,
                  True, EVEN_D)
    do = load_tile(DO + b * stride_dob + h * stride_doh + m0 * stride_dot, rows, stride_dot, columns, row_ok,
                   column_ok, True, EVEN_D)
    o = load_tile(O + b * stride_ob + h * stride_oh + m0 * stride_ot, rows, stride_ot, columns, row_ok, column_ok,
                  True, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + row_base + offs_m, delta, mask=row_ok)
    lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    free_lo, free_hi, start, hi, lo_q, hi_q = key_blocks(pid_m, offs_m, row_ok, b, seq_len, SEG, SELF_UNTIL, SPANS,
                                                         stride_segb, CAUSAL, SEGMENTS, True, BLOCK_FIXED, BLOCK_STREAM)
    STREAM_TMA: tl.constexpr = USE_TMA and EVEN_D
    k_desc = None
    v_desc = None
    if STREAM_TMA:  # k / v tiles by TMA: no address math in the loop
        k_desc = head_tiles(K, batch, seq_len, kv_heads, stride_kb, stride_kt, stride_kh, HEAD_DIM, BLOCK_STREAM,
                            HEAD_PAD)
        v_desc = head_tiles(V, batch, seq_len, kv_heads, stride_vb, stride_vt, stride_vh, HEAD_DIM, BLOCK_STREAM,
                            HEAD_PAD)
    dq = tl.zeros([BLOCK_FIXED, HEAD_PAD], dtype=tl.float32)
    dq = _dq_steps(dq, q, do, lse, delta, k_base, v_base, k_desc, v_desc, b, kvh, stride_kt, stride_vt, free_lo,
                   free_hi, offs_m, offs_s, columns, column_ok, seq_len, qk_scale, SEG, stride_segb, lo_q, hi_q, free_lo,
                   free_hi, False, CAUSAL, SEGMENTS, EVEN_D, STREAM_TMA, DOT_PRECISION, BLOCK_STREAM, HEAD_PAD)
    dq = _dq_steps(dq, q, do, lse, delta, k_base, v_base, k_desc, v_desc, b, kvh, stride_kt, stride_vt, start, hi,
                   offs_m, offs_s, columns, column_ok, seq_len, qk_scale, SEG, stride_segb, lo_q, hi_q, free_lo,
                   free_hi, True, CAUSAL, SEGMENTS, EVEN_D, STREAM_TMA, DOT_PRECISION, BLOCK_STREAM, HEAD_PAD)
    dq = dq * sm_scale
    if ROPE:  # tables [T, D/2] shared by the batch (stride_ropeb 0) or one per batch row (positions)
        cos, sin = load_rope_tables(COS + b * stride_ropeb, SIN + b * stride_ropeb, offs_m, row_ok, HEAD_DIM, HEAD_PAD)
        dq = rope_rotate(dq, cos, -sin, BLOCK_FIXED, 1, HEAD_PAD // 2)
    store_tile(DQ + b * stride_dqb + h * stride_dqh + m0 * stride_dqt, rows, stride_dqt, columns, row_ok, column_ok,
               dq)


@triton.autotune(configs=dkdv_configs(), key=["HEAD_DIM", "CAUSAL", "ROPE", "SEGMENTS", "seq_bucket"],
                 prune_configs_by={"early_config_prune": prune_by_table(dkdv_configs)}, cache_results=True)
@triton.jit
def attention_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, COS, SIN, SEG, SELF_UNTIL, SPANS,
                              stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                              stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                              stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh, stride_segb,
                              stride_ropeb, batch, heads, kv_heads, seq_len, seq_bucket, sm_scale,
                              HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                              ROPE: tl.constexpr, SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              BLOCK_FIXED: tl.constexpr, BLOCK_STREAM: tl.constexpr, USE_TMA: tl.constexpr,
                              ONE_LOOP: tl.constexpr):
    """Grid (cdiv(T, BLOCK_FIXED) * B * KV,): program -> (key block, batch x kv head): dk, dv of the
    block summed over the query heads of its group in registers (GQA without atomics). Runs after
    the dq pass, which wrote delta.

    ONE_LOOP (a config switch): every query block in one masked loop, the row terms and masks
    folded into the dots (``_dkdv_steps``); else three loops (blocks crossing the diagonal masked,
    full blocks unmasked, the sequence's last block masked), three copies of the loop body. At
    head dim 128 two 128 x 128 fp32 accumulators take half the registers and the three copies
    need 255 (with stack on triton 3.6), the one loop 213-231 (sm_90); at head dim 64 the
    unmasked loop issues fewer instructions, so it keeps three. With SEGMENTS the three-loop form
    runs the query blocks inside the keys' shared run unmasked; the one-loop form masks every block
    (split into three folded loops, or an unmasked one and a masked one skipping its blocks, it
    spilled on triton 3.6: 255 registers and a stack, sm_90)."""
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_PAD
    pid = tl.program_id(0)
    tiles = tl.cdiv(seq_len, BLOCK_FIXED)
    pid_n = pid % tiles  # under a causal mask early key blocks are the long ones: they go first
    pid_bkv = pid // tiles
    b = (pid_bkv // kv_heads).to(tl.int64)
    kvh = (pid_bkv % kv_heads).to(tl.int64)
    group = heads // kv_heads
    columns, column_ok = split_half_lanes(HEAD_DIM, HEAD_PAD)
    offs_n = pid_n * BLOCK_FIXED + tl.arange(0, BLOCK_FIXED)
    key_ok = offs_n < seq_len
    offs_s = tl.arange(0, BLOCK_STREAM)
    n0 = (pid_n * BLOCK_FIXED).to(tl.int64)
    rows = tl.arange(0, BLOCK_FIXED)
    qk_scale = sm_scale * 1.4426950408889634
    k = load_tile(K + b * stride_kb + kvh * stride_kh + n0 * stride_kt, rows, stride_kt, columns, key_ok, column_ok,
                  True, EVEN_D)
    v = load_tile(V + b * stride_vb + kvh * stride_vh + n0 * stride_vt, rows, stride_vt, columns, key_ok, column_ok,
                  True, EVEN_D)
    dk = tl.zeros([BLOCK_FIXED, HEAD_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_FIXED, HEAD_PAD], dtype=tl.float32)
    full_end = (seq_len // BLOCK_STREAM) * BLOCK_STREAM  # query blocks before it need no row mask
    if CAUSAL:
        # Earlier queries see none of these keys; the stream blocks up to the block's last key
        # cross the diagonal (BLOCK_STREAM may exceed BLOCK_FIXED: aligned to it).
        lo = (pid_n * BLOCK_FIXED // BLOCK_STREAM) * BLOCK_STREAM
        diagonal_end = lo + tl.cdiv((pid_n + 1) * BLOCK_FIXED - lo, BLOCK_STREAM) * BLOCK_STREAM
    else:
        lo = 0
        diagonal_end = 0
    full_end = tl.maximum(full_end, diagonal_end)
    stream_end = seq_len
    if SEGMENTS:  # only the query blocks that may see these keys; unmasked: those inside the keys' shared run
        first, end = block_span(SPANS, b, offs_n, key_ok, seq_len, 2)
        lo = tl.maximum((first // BLOCK_STREAM) * BLOCK_STREAM, lo)
        stream_end = tl.minimum(end, seq_len)
        if not ONE_LOOP:  # (the one-loop form masks every block.) Past the diagonal, whole query
            # blocks inside the sequence, none past the span's end:
            free_from = tl.minimum(tl.maximum(diagonal_end, lo), stream_end)
            free_until = tl.minimum((seq_len // BLOCK_STREAM) * BLOCK_STREAM, stream_end)
            diagonal_end, full_end = unmasked_span(SPANS, b, offs_n, key_ok, seq_len, free_from, free_until,
                                                   BLOCK_STREAM)
        code_k = key_codes(SEG, b, offs_n, key_ok, stride_segb)
    else:
        code_k = offs_n
    STREAM_TMA: tl.constexpr = USE_TMA and EVEN_D
    q_desc = None
    do_desc = None
    if STREAM_TMA:  # q / dO tiles by TMA: no address math in the loop
        q_desc = head_tiles(Q, batch, seq_len, heads, stride_qb, stride_qt, stride_qh, HEAD_DIM, BLOCK_STREAM, HEAD_PAD)
        do_desc = head_tiles(DO, batch, seq_len, heads, stride_dob, stride_dot, stride_doh, HEAD_DIM, BLOCK_STREAM,
                             HEAD_PAD)
    for g in range(0, group):
        h = kvh * group + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * heads + h) * seq_len
        if ONE_LOOP:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, LSE + row_base,
                                 DELTA + row_base, stride_qt, stride_dot,
                                 lo, stream_end, offs_n, offs_s, columns, column_ok, seq_len, qk_scale,
                                 SEG, SELF_UNTIL, stride_segb, code_k, True, True, CAUSAL, SEGMENTS, EVEN_D,
                                 STREAM_TMA, DOT_PRECISION, BLOCK_STREAM, HEAD_PAD)
        else:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, LSE + row_base,
                                 DELTA + row_base, stride_qt, stride_dot,
                                 lo, diagonal_end, offs_n, offs_s, columns, column_ok, seq_len, qk_scale,
                                 SEG, SELF_UNTIL, stride_segb, code_k, True, False, CAUSAL, SEGMENTS, EVEN_D,
                                 STREAM_TMA, DOT_PRECISION, BLOCK_STREAM, HEAD_PAD)
            dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, LSE + row_base,
                                 DELTA + row_base, stride_qt, stride_dot,
                                 diagonal_end, full_end, offs_n, offs_s, columns, column_ok, seq_len, qk_scale,
                                 SEG, SELF_UNTIL, stride_segb, code_k, False, False, CAUSAL, SEGMENTS, EVEN_D,
                                 STREAM_TMA, DOT_PRECISION, BLOCK_STREAM, HEAD_PAD)
            dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, LSE + row_base,
                                 DELTA + row_base, stride_qt, stride_dot,
                                 full_end, stream_end, offs_n, offs_s, columns, column_ok, seq_len, qk_scale,
                                 SEG, SELF_UNTIL, stride_segb, code_k, True, False, CAUSAL, SEGMENTS, EVEN_D,
                                 STREAM_TMA, DOT_PRECISION, BLOCK_STREAM, HEAD_PAD)
    # dv leaves first: its registers are free for the RoPE tables dk's rotation loads
    store_tile(DV + b * stride_dvb + kvh * stride_dvh + n0 * stride_dvt, rows, stride_dvt, columns, key_ok,
               column_ok, dv)
    dk = dk * sm_scale
    if ROPE:  # (tables loaded where used: kept across the loops they would hold registers)
        cos, sin = load_rope_tables(COS + b * stride_ropeb, SIN + b * stride_ropeb, offs_n, key_ok, HEAD_DIM, HEAD_PAD)
        dk = rope_rotate(dk, cos, -sin, BLOCK_FIXED, 1, HEAD_PAD // 2)
    store_tile(DK + b * stride_dkb + kvh * stride_dkh + n0 * stride_dkt, rows, stride_dkt, columns, key_ok,
               column_ok, dk)
