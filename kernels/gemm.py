"""The GEMM kernel of the fused halves: C = epilogue(A @ B), raw operands, named epilogues.

A is [M, K], B is [K, N] (an nn.Linear weight W [N, K] is passed as B with swapped strides),
both in the GEMM operand dtype and read through strides; the main loop only loads and multiplies
(the tutorial-03 shape: no per-tile transform of an operand, so wgmma reads both operands from
shared memory and the loads pipeline). Whatever used to be a prologue happens once elsewhere:
the norm in kernels/norm.py's normalize pass, the gradient scale and cast in its scale pass, and
activations of stored pre-activations are stored activations.

Tiles arrive by TMA (tensor descriptors built on the device) with the sm_90 configs
(``USE_TMA``) when the launcher found every operand descriptor-ready (``TMA_READY``: 16-bit,
one unit stride, 16-byte aligned base and stride; ``A_K_MAJOR`` / ``B_K_MAJOR`` say which stride
is the unit one, B seen as [N, K]); by masked pointer loads otherwise (cp.async on sm_80). Both
paths feed the same dots in the same order.

Tile walk: one program per output tile, or with a ``PERSISTENT`` config one program per SM walking
the tiles in the same grouped order (the launcher sizes the grid from the config).

Operand switches:
  DUAL_B      a second accumulator acc2 = A @ B2 (SwiGLU gate and up in one pass)
  SECOND_K    C += A[:, K:2K] @ B2 (the input gradient of SwiGLU's gate and up)
  SPLIT_K     program_id(1) takes K range [k0, k0 + k_per_split); C is then an fp32 partial
              buffer [SPLIT_K, M, N] that kernels/norm.py's sum_partials reduces in a fixed order
Epilogue, fp32, one cast at the store (the shape of cuBLASLt's epilogue enum):
  HAS_BIAS    + bias[n]
  store_aux   (runtime flag) store the pre-activation to aux (SwiGLU: [gate | up], 2N columns)
  ACT         1 gelu_tanh, 2 gelu (erf), 3 relu, 4 SwiGLU silu(acc) * acc2
  ACT_BWD     acc *= act'(aux); 4: SwiGLU gradient, C gets [d gate | d up] (2N columns)
  COL_SUM     per-tile column sums of the stored C into partial row pid_m (bias gradients)
  alpha       scalar factor (a sign); HAS_ROW_SCALE: * row_scale[m]
  RESIDUAL    1 float: res + sign * acc;  2 exact: res + sign * round_half_even(acc * 2^k),
              saturated at +-(2^31 - 128), NaN -> +saturation, int32 add (wraps like the reference)
  RES_SCALED  a scaled coupling (ops.streams.ResidualScale), sign +1 forward / -1 inverse:
              float  res * res_scale + acc  /  (res - acc) / res_scale
              exact  (res >> res_shift) + q  /  ((res - q) << res_shift) | the dropped low bits,
              read from the bit planes at low_bits_ptr (kernels/couple.py restore_low_bits).
              A runtime branch on sign: the forward and the rebuild still run one compiled kernel.

No atomics: every output element (or partial) is computed by one program in a fixed order, so
a shape with a pinned config gives bitwise the same result on every call.
"""
import triton
import triton.language as tl

from .configs import gemm_configs, prune_for_device
from .couple import quantize, restore_low_bits

ACT_NONE, ACT_GELU_TANH, ACT_GELU, ACT_RELU, ACT_SWIGLU = 0, 1, 2, 3, 4
RES_NONE, RES_FLOAT, RES_EXACT = 0, 1, 2

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_TANH_C = tl.constexpr(0.044715)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
COL_SUM_ROWS = tl.constexpr(64)  # rows of C per column-sum partial row; every config's BLOCK_M is a multiple

# Everything that changes the compiled kernel is part of the tuning key, with M and K as
# power-of-two buckets: a config tuned at a few hundred tokens is not reused at 8192, and a
# weight gradient (K = tokens) does not retune for every batch size.
# How the tiles arrive (TMA_READY: the operands' alignment) is left out: exact streams need the
# forward and the rebuild of a shape to run one config, whatever their buffers' alignment.
GEMM_TUNE_KEY = ["M_BUCKET", "N", "K_BUCKET", "DUAL_B", "SECOND_K", "SPLIT_K", "HAS_BIAS", "ACT", "ACT_BWD", "COL_SUM",
                 "HAS_ROW_SCALE", "RESIDUAL", "RES_SCALED"]


@triton.jit
def gelu_tanh(x):
    # 0.5 x (1 + tanh(u)) == x * sigmoid(2u): no libdevice tanh (fails under the interpreter).
    u = SQRT_2_OVER_PI * (x + GELU_TANH_C * x * x * x)
    return x * tl.sigmoid(2.0 * u)


@triton.jit
def gelu_tanh_grad(x):
    u = SQRT_2_OVER_PI * (x + GELU_TANH_C * x * x * x)
    s = tl.sigmoid(2.0 * u)
    du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_C * x * x)
    return s + x * 2.0 * s * (1.0 - s) * du


@triton.jit
def gelu_erf(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * INV_SQRT_2))


@triton.jit
def gelu_erf_grad(x):
    return 0.5 * (1.0 + tl.math.erf(x * INV_SQRT_2)) + x * INV_SQRT_2PI * tl.exp(-0.5 * x * x)


@triton.jit
def silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def silu_grad(x):
    s = tl.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@triton.jit
def apply_activation(x, ACT: tl.constexpr):
    if ACT == 1:
        x = gelu_tanh(x)
    elif ACT == 2:
        x = gelu_erf(x)
    elif ACT == 3:
        x = tl.maximum(x, 0.0)
    return x


@triton.jit
def activation_grad(x, ACT: tl.constexpr):
    if ACT == 1:
        g = gelu_tanh_grad(x)
    elif ACT == 2:
        g = gelu_erf_grad(x)
    else:
        g = tl.where(x > 0.0, 1.0, 0.0)
    return g


@triton.jit
def scaled_float_add(res, h, sign, res_scale):
    """The float epilogue of a scaled coupling: ``res * scale + h`` forward (sign > 0), ``(res - h) /
    scale`` inverse (ops.streams.couple_output with a ResidualScale), in fp32."""
    if sign > 0:
        out = res * res_scale + h
    else:
        out = (res - h) / res_scale
    return out


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) in grouped order: GROUP_M row tiles share B's column tiles in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def operand_tiles(base, rows, depth, stride_row, stride_depth, K_MAJOR: tl.constexpr, ROWS: tl.constexpr,
                  DEPTH: tl.constexpr):
    """TMA descriptor of a GEMM operand seen as [rows, depth] (depth runs over the GEMM's K), laid
    out K-major (unit stride along depth) or not (unit stride along rows: described transposed);
    tiles past rows or depth arrive as zeros."""
    if K_MAJOR:
        desc = tl.make_tensor_descriptor(base, shape=[rows, depth], strides=[stride_row, 1],
                                         block_shape=[ROWS, DEPTH])
    else:
        desc = tl.make_tensor_descriptor(base, shape=[depth, rows], strides=[stride_depth, 1],
                                         block_shape=[DEPTH, ROWS])
    return desc


@triton.jit
def load_operand_tile(desc, row0, k0, K_MAJOR: tl.constexpr):
    """The [ROWS, DEPTH] tile at (row0, k0) of an :func:`operand_tiles` descriptor (wgmma reads a
    transposed 16-bit tile from shared memory as it is)."""
    if K_MAJOR:
        tile = desc.load([row0, k0])
    else:
        tile = desc.load([k0, row0]).T
    return tile


@triton.jit
def gemm_tile(
        tile_id, a_ptr, b_ptr, b2_ptr, c_ptr, a_desc, b_desc, b2_desc, a2_desc,
        M, N, K, k_start, span,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        bias_ptr, row_scale_ptr, aux_ptr, stride_auxm, res_ptr, stride_resm, col_sum_ptr,
        alpha, sign, frac_scale, res_scale, res_shift, low_bits_ptr, low_bits_plane, store_aux,
        DUAL_B: tl.constexpr, SECOND_K: tl.constexpr, SPLIT_K: tl.constexpr, TMA: tl.constexpr,
        A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr,
        HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ACT_BWD: tl.constexpr, COL_SUM: tl.constexpr,
        HAS_ROW_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, RES_SCALED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One output tile (grouped order index ``tile_id``): the main loop over this program's K range,
    then the epilogue."""
    pid_m, pid_n = grouped_tile(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    # 64-bit scalar bases + 32-bit offset tiles (64-bit pointer tiles cost two registers an
    # element). Rows and columns past the edge are masked, not clamped: clamped offsets lose
    # the contiguity the compiler needs to load an M- or N-major operand (weight gradients read
    # grad^T) with asynchronous vector copies.
    row0 = (pid_m * BLOCK_M).to(tl.int64)
    col0 = (pid_n * BLOCK_N).to(tl.int64)
    local_m = tl.arange(0, BLOCK_M)
    local_n = tl.arange(0, BLOCK_N)
    a_base = a_ptr + row0 * stride_am
    b_base = b_ptr + col0 * stride_bn
    b2_base = b2_ptr + col0 * stride_bn
    if SPLIT_K > 1:
        a_base += k_start.to(tl.int64) * stride_ak
        b_base += k_start.to(tl.int64) * stride_bk
        b2_base += k_start.to(tl.int64) * stride_bk
    a_ptrs = a_base + (local_m[:, None] * stride_am + rk[None, :] * stride_ak)
    b_ptrs = b_base + (rk[:, None] * stride_bk + local_n[None, :] * stride_bn)
    b2_ptrs = b2_base + (rk[:, None] * stride_bk + local_n[None, :] * stride_bn)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DUAL_B:
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(span, BLOCK_K)):
        if TMA:
            k0 = k_start + k * BLOCK_K
            a = load_operand_tile(a_desc, pid_m * BLOCK_M, k0, A_K_MAJOR)
            b = load_operand_tile(b_desc, pid_n * BLOCK_N, k0, B_K_MAJOR).T
        else:
            k_left = span - k * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if DUAL_B:
            if TMA:
                b2 = load_operand_tile(b2_desc, pid_n * BLOCK_N, k0, B_K_MAJOR).T
            else:
                b2 = tl.load(b2_ptrs, mask=(rk[:, None] < k_left) & mask_n[None, :], other=0.0)
            acc2 = tl.dot(a, b2, acc2, input_precision=INPUT_PRECISION)
        if not TMA:
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            b2_ptrs += BLOCK_K * stride_bk
    if SECOND_K:
        # Second K segment: A's columns K..2K-1 against B2.
        a_ptrs = a_ptr + row0 * stride_am + K.to(tl.int64) * stride_ak + (
            local_m[:, None] * stride_am + rk[None, :] * stride_ak)
        b2_ptrs = b2_base + (rk[:, None] * stride_bk + local_n[None, :] * stride_bn)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if TMA:
                a = load_operand_tile(a2_desc, pid_m * BLOCK_M, k * BLOCK_K, A_K_MAJOR)
                b2 = load_operand_tile(b2_desc, pid_n * BLOCK_N, k * BLOCK_K, B_K_MAJOR).T
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
                b2 = tl.load(b2_ptrs, mask=(rk[:, None] < k_left) & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b2, acc, input_precision=INPUT_PRECISION)
            if not TMA:
                a_ptrs += BLOCK_K * stride_ak
                b2_ptrs += BLOCK_K * stride_bk

    # ---- epilogue ----
    mask_c = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        c_base = c_ptr + tl.program_id(1).to(tl.int64) * M * N
    else:
        c_base = c_ptr
    c_ptrs = (c_base + row0 * stride_cm + col0 * stride_cn) + (local_m[:, None] * stride_cm +
                                                               local_n[None, :] * stride_cn)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    aux_ptrs = (aux_ptr + row0 * stride_auxm + col0) + (local_m[:, None] * stride_auxm + local_n[None, :])
    if store_aux != 0:
        tl.store(aux_ptrs, acc.to(aux_ptr.dtype.element_ty), mask=mask_c)
        if DUAL_B:
            tl.store(aux_ptrs + N, acc2.to(aux_ptr.dtype.element_ty), mask=mask_c)
    if ACT == 4:
        # Round like the unfused ops do (gate, silu(gate), up), multiply in fp32.
        out_ty = c_ptr.dtype.element_ty
        gate = silu(acc.to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
        acc = gate * acc2.to(out_ty).to(tl.float32)
    elif ACT != 0:
        acc = apply_activation(acc.to(c_ptr.dtype.element_ty).to(tl.float32), ACT)
    if HAS_ROW_SCALE:  # one pass over the tile: alpha folded into the row vector
        acc = acc * (alpha * tl.load(row_scale_ptr + rm, mask=mask_m, other=0.0).to(tl.float32))[:, None]
    else:
        acc = acc * alpha
    if ACT_BWD == 4:
        # One stored tile at a time keeps fewer tiles live (this epilogue spilled otherwise).
        z_gate = tl.load(aux_ptrs, mask=mask_c, other=0.0).to(tl.float32)
        tl.store(c_ptrs + N * stride_cn, (acc * silu(z_gate)).to(c_ptr.dtype.element_ty), mask=mask_c)
        acc = acc * silu_grad(z_gate)
        acc = acc * tl.load(aux_ptrs + N, mask=mask_c, other=0.0).to(tl.float32)
    elif ACT_BWD != 0:
        acc = acc * activation_grad(tl.load(aux_ptrs, mask=mask_c, other=0.0).to(tl.float32), ACT_BWD)
    res_ptrs = (res_ptr + row0 * stride_resm + col0) + (local_m[:, None] * stride_resm + local_n[None, :])
    if RESIDUAL == 1:
        res = tl.load(res_ptrs, mask=mask_c, other=0.0).to(tl.float32)
        if RES_SCALED:
            out = scaled_float_add(res, acc, sign, res_scale)
        else:
            out = res + sign * acc
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask_c)
    elif RESIDUAL == 2:
        res = tl.load(res_ptrs, mask=mask_c, other=0)
        q = quantize(acc, frac_scale)
        if not RES_SCALED:
            out = res + sign * q
        elif sign > 0:  # a runtime branch: the scaled forward and rebuild are one compiled kernel
            out = (res >> res_shift) + q
        else:  # the dropped bits are indexed by the element's place in the [M, N] stream, not by res's strides
            out = restore_low_bits((res - q) << res_shift, low_bits_ptr, row0 * N + col0, N, M - row0, N - col0,
                                   low_bits_plane, res_shift, BLOCK_M, BLOCK_N)
        tl.store(c_ptrs, out, mask=mask_c)
    else:
        stored = acc.to(c_ptr.dtype.element_ty)
        tl.store(c_ptrs, stored, mask=mask_c)
        if COL_SUM:
            # The bias gradient of what was stored (as the weight gradient sees it), one partial
            # row per row tile: reduced later in a fixed order, no atomics.
            # Partial rows are COL_SUM_ROWS rows of C each, whatever BLOCK_M the tuner picked: a
            # taller tile writes its sum and zeros the partial rows it covers beyond the first.
            partial = tl.sum(tl.where(mask_m[:, None], stored.to(tl.float32), 0.0), axis=0)
            first = pid_m.to(tl.int64) * (BLOCK_M // COL_SUM_ROWS)
            tl.store(col_sum_ptr + first * N + rn, partial, mask=mask_n)
            for extra in tl.static_range(1, BLOCK_M // COL_SUM_ROWS):
                tl.store(col_sum_ptr + (first + extra) * N + rn, tl.zeros_like(partial), mask=mask_n)


# sign and store_aux are runtime flags, not specialised: the JIT would turn a value of 1 into a
# constant, so the forward (sign +1, no aux) and the rebuild (sign -1, aux) would compile different
# kernels; exact streams need the rebuild to run the forward's code. So are the scale's shift and
# bit-plane length (a shift of 1 would compile a kernel of its own). M_BUCKET / K_BUCKET only key
# the tuning.
@triton.jit(do_not_specialize=["sign", "res_shift", "low_bits_plane", "store_aux", "M_BUCKET", "K_BUCKET"])
def fused_gemm_kernel(
        a_ptr, b_ptr, b2_ptr, c_ptr,
        M, N, K, k_per_split,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        bias_ptr, row_scale_ptr, aux_ptr, stride_auxm, res_ptr, stride_resm, col_sum_ptr,
        alpha, sign, frac_scale, res_scale, res_shift, low_bits_ptr, low_bits_plane, store_aux, M_BUCKET, K_BUCKET,
        DUAL_B: tl.constexpr, SECOND_K: tl.constexpr, SPLIT_K: tl.constexpr,
        TMA_READY: tl.constexpr, A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr, ALIGNED_8: tl.constexpr,
        HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ACT_BWD: tl.constexpr, COL_SUM: tl.constexpr,
        HAS_ROW_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, RES_SCALED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr):
    if ALIGNED_8:
        # The sizes and the row strides of the operands, the output and the epilogue's tiles are
        # multiples of 8 elements, some not of 16 (the launcher sets ALIGNED_8 only then, with
        # descriptor-ready operands: 16-byte aligned rows). Said to the compiler (x // 8 * 8 is x
        # here, and visibly a multiple of 8), the epilogue stores and loads in vectors (element by
        # element, an fp32 / int32 output took 250-255 registers on sm_90 with triton 3.6: 198 now)
        # and the pointer path (sm_80) copies tiles asynchronously in 16-byte vectors, masks at the
        # edges included; the JIT specialises only multiples of 16 (e.g. width 1000).
        N = N // 8 * 8
        stride_cm = stride_cm // 8 * 8
        stride_resm = stride_resm // 8 * 8
        stride_auxm = stride_auxm // 8 * 8
    if ALIGNED_8 and not USE_TMA:
        M = M // 8 * 8
        K = K // 8 * 8
        if A_K_MAJOR:
            stride_am = stride_am // 8 * 8
        else:
            stride_ak = stride_ak // 8 * 8
        if B_K_MAJOR:
            stride_bn = stride_bn // 8 * 8
        else:
            stride_bk = stride_bk // 8 * 8
    # The K range of this program (a split-K program's own slice), and the TMA descriptors (sm_90
    # configs, when the launcher found every operand descriptor-ready: the copy engine brings the
    # tiles, no address math or masks in the loop; masked pointer loads otherwise, as on sm_80).
    if SPLIT_K > 1:
        k_start = tl.program_id(1) * k_per_split
        span = tl.minimum(K - k_start, k_per_split)
    else:
        k_start = 0
        span = K
    TMA: tl.constexpr = USE_TMA and TMA_READY
    a_desc = None
    b_desc = None
    b2_desc = None
    a2_desc = None
    if TMA:  # a split's descriptors end at its last K column: TMA zero-fills past it
        k_end = k_start + span
        a_desc = operand_tiles(a_ptr, M, k_end, stride_am, stride_ak, A_K_MAJOR, BLOCK_M, BLOCK_K)
        b_desc = operand_tiles(b_ptr, N, k_end, stride_bn, stride_bk, B_K_MAJOR, BLOCK_N, BLOCK_K)
        if DUAL_B or SECOND_K:
            b2_desc = operand_tiles(b2_ptr, N, k_end, stride_bn, stride_bk, B_K_MAJOR, BLOCK_N, BLOCK_K)
        if SECOND_K:  # A's columns K..2K-1 (the launcher checked that they start 16-byte aligned)
            a2_desc = operand_tiles(a_ptr + K.to(tl.int64) * stride_ak, M, K, stride_am, stride_ak, A_K_MAJOR,
                                    BLOCK_M, BLOCK_K)
    # One program per output tile, or (PERSISTENT) one per SM walking the tiles in grouped order
    # (tutorial 09): the descriptors are built once per SM instead of once per tile. The tile loop
    # keeps its body's invariants inside (hoisted out of it, they stayed live across every tile:
    # the forward's bias + GELU at 128 x 128 took 172 registers against 134 on triton 3.9).
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), disable_licm=True):
            gemm_tile(tile_id, a_ptr, b_ptr, b2_ptr, c_ptr, a_desc, b_desc, b2_desc, a2_desc, M, N, K, k_start, span,
                      stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                      bias_ptr, row_scale_ptr, aux_ptr, stride_auxm, res_ptr, stride_resm, col_sum_ptr,
                      alpha, sign, frac_scale, res_scale, res_shift, low_bits_ptr, low_bits_plane, store_aux,
                      DUAL_B, SECOND_K, SPLIT_K, TMA, A_K_MAJOR, B_K_MAJOR, HAS_BIAS, ACT, ACT_BWD, COL_SUM,
                      HAS_ROW_SCALE, RESIDUAL, RES_SCALED, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        gemm_tile(tl.program_id(0), a_ptr, b_ptr, b2_ptr, c_ptr, a_desc, b_desc, b2_desc, a2_desc, M, N, K,
                  k_start, span, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  bias_ptr, row_scale_ptr, aux_ptr, stride_auxm, res_ptr, stride_resm, col_sum_ptr,
                  alpha, sign, frac_scale, res_scale, res_shift, low_bits_ptr, low_bits_plane, store_aux,
                  DUAL_B, SECOND_K, SPLIT_K, TMA, A_K_MAJOR, B_K_MAJOR, HAS_BIAS, ACT, ACT_BWD, COL_SUM,
                  HAS_ROW_SCALE, RESIDUAL, RES_SCALED, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


# The JIT function wrapped three times: the dual-accumulator variant (two fp32 tiles) and the
# heavy-epilogue gradients (SwiGLU's two pre-activation tiles, exact GELU's erf) get config
# lists of their own that neither spill nor leave the main loop issue-bound.
fused_gemm_jit = fused_gemm_kernel
fused_gemm_kernel = triton.autotune(configs=gemm_configs("regular"), key=GEMM_TUNE_KEY,
                                    prune_configs_by={"early_config_prune": prune_for_device},
                                    cache_results=True)(fused_gemm_jit)
fused_gemm_dual_kernel = triton.autotune(configs=gemm_configs("dual"), key=GEMM_TUNE_KEY,
                                         prune_configs_by={"early_config_prune": prune_for_device},
                                         cache_results=True)(fused_gemm_jit)
fused_gemm_act_grad_kernel = triton.autotune(configs=gemm_configs("act_grad"), key=GEMM_TUNE_KEY,
                                                prune_configs_by={"early_config_prune": prune_for_device},
                                                cache_results=True)(fused_gemm_jit)
