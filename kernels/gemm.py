"""One fused GEMM kernel for the norm+MLP and norm+attention halves: C = epilogue(prologue(A) @ prologue(B)).

A is [M, K], B is [K, N] (an nn.Linear weight W [N, K] is passed as B with swapped strides),
both read through strides. Compile-time switches (all default off) select what is fused:

prologue of A (rows of A are tokens):
  A_NORM      1 LayerNorm / 2 RMSNorm along K: (a - mean[m]) * rstd[m] * gamma[k] + beta[k]
  A_SCALE_K   a *= k_scale[k]  (a per-token scale when K runs over tokens: weight gradients)
  A_SUM       also sum A over K per row (bias gradients), stored by the pid_n == 0 programs
prologue of B (B is [tokens, N] in weight-gradient GEMMs):
  B_NORM      1 LayerNorm / 2 RMSNorm: (b - mean[k]) * rstd[k] * gamma[n] + beta[n]
  B_ACT       b = act(b); 4 (SwiGLU) = silu(b) * b2
second operand:
  DUAL_B      a second accumulator acc2 = A @ B2 (SwiGLU gate and up in one pass)
  SECOND_K    C += A[:, K:2K] @ B2 (the input gradient of SwiGLU's gate and up)
epilogue (fp32, one cast at the store):
  HAS_BIAS    + bias[n]
  store_aux   (runtime flag) store the pre-activation to aux (SwiGLU: [gate | up], 2N columns)
  ACT         1 gelu_tanh, 2 gelu (erf), 3 relu, 4 SwiGLU silu(acc) * acc2
  ACT_BWD     acc *= act'(aux); 4: SwiGLU gradient, C gets [d gate | d up] (2N columns)
  alpha       scalar factor (a sign); HAS_ROW_SCALE: * row_scale[m]
  RESIDUAL    1 float: res + sign * acc;  2 exact: res + sign * round_half_even(acc * 2^k),
              saturated at +-(2^31 - 128), NaN -> +saturation, int32 add (wraps like the reference)

No split-K and no atomics: every output element is computed by one program in a fixed order,
so a shape with a pinned config gives bitwise the same result on every call.
"""
import triton
import triton.language as tl

from .configs import gemm_configs, prune_for_device

ACT_NONE, ACT_GELU_TANH, ACT_GELU, ACT_RELU, ACT_SWIGLU = 0, 1, 2, 3, 4
NORM_NONE, NORM_LAYER, NORM_RMS = 0, 1, 2
RES_NONE, RES_FLOAT, RES_EXACT = 0, 1, 2

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_TANH_C = tl.constexpr(0.044715)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
SATURATION = tl.constexpr(2147483520.0)  # 2**31 - 128, the largest float32 below 2**31

# Everything that changes the compiled kernel is part of the tuning key; the token count M is not.
GEMM_TUNE_KEY = ["N", "K", "A_NORM", "B_NORM", "A_SCALE_K", "B_ACT", "DUAL_B", "SECOND_K", "A_SUM", "HAS_BIAS",
                 "ACT", "ACT_BWD", "HAS_ROW_SCALE", "RESIDUAL"]


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
def round_half_even(v):
    """Round to the nearest integer, ties to even, in exact fp32 steps (no libdevice rint)."""
    r = tl.floor(v)
    diff = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (diff > 0.5) | ((diff == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def quantize(h, frac_scale):
    """round(h * 2^k) as int32: ties to even, saturated, NaN -> +saturation (ops.streams.quantize_reference)."""
    v = round_half_even(h * frac_scale)
    v = tl.where(v != v, SATURATION, v)
    v = tl.minimum(tl.maximum(v, -SATURATION), SATURATION)
    return v.to(tl.int32)


# sign and store_aux are runtime flags, not specialised: the JIT would turn a value of 1 into a
# constant, so the forward (sign +1, no aux) and the rebuild (sign -1, aux) would compile different
# kernels; exact streams need the rebuild to run the forward's code.
@triton.jit(do_not_specialize=["sign", "store_aux"])
def fused_gemm_kernel(
        a_ptr, b_ptr, b2_ptr, c_ptr,
        M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, k_scale_ptr,
        bias_ptr, row_scale_ptr, aux_ptr, stride_auxm, res_ptr, stride_resm, bias_grad_ptr,
        alpha, sign, frac_scale, store_aux,
        A_NORM: tl.constexpr, B_NORM: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
        A_SCALE_K: tl.constexpr, B_ACT: tl.constexpr, DUAL_B: tl.constexpr, SECOND_K: tl.constexpr,
        A_SUM: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ACT_BWD: tl.constexpr,
        HAS_ROW_SCALE: tl.constexpr, RESIDUAL: tl.constexpr,
        DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering of the output tiles (L2 reuse of B across GROUP_M row blocks).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    # Scalar 64-bit base pointers + 32-bit offset tiles: 64-bit pointer tiles cost two registers an
    # element and made the epilogue spill.
    local_m = tl.arange(0, BLOCK_M)
    local_n = tl.arange(0, BLOCK_N)
    row0 = (pid_m * BLOCK_M).to(tl.int64)
    col0 = (pid_n * BLOCK_N).to(tl.int64)

    if A_NORM != 0:
        rstd_a = tl.load(rstd_ptr + rm, mask=mask_m, other=0.0)
        if A_NORM == 1:
            mean_a = tl.load(mean_ptr + rm, mask=mask_m, other=0.0)
    if B_NORM != 0:
        if HAS_GAMMA:
            gamma_b = tl.load(gamma_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_BETA:
            beta_b = tl.load(beta_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DUAL_B:
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if A_SUM:
        a_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)

    a_offs = local_m[:, None] * stride_am + rk[None, :] * stride_ak
    b_offs = rk[:, None] * stride_bk + local_n[None, :] * stride_bn
    a_base = a_ptr + row0 * stride_am
    b_base = b_ptr + col0 * stride_bn
    b2_base = b2_ptr + col0 * stride_bn
    for segment in tl.static_range(2 if SECOND_K else 1):
        if segment == 1:
            # Second K segment: A's columns K..2K-1 against B2.
            a_base = a_ptr + row0 * stride_am + K.to(tl.int64) * stride_ak
            b_base = b2_ptr + col0 * stride_bn
        for k_block in range(0, tl.cdiv(K, BLOCK_K)):
            kk = k_block * BLOCK_K + rk
            mask_k = kk < K
            a = tl.load(a_base + a_offs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if A_NORM != 0:
                a = a.to(tl.float32)
                if A_NORM == 1:
                    a = a - mean_a[:, None]
                a = a * rstd_a[:, None]
                if HAS_GAMMA:
                    a = a * tl.load(gamma_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)[None, :]
                if HAS_BETA:
                    a = a + tl.load(beta_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            if A_SCALE_K:
                a = a.to(tl.float32) * tl.load(k_scale_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            if A_SUM:
                a_sum += tl.sum(a.to(tl.float32), axis=1)
            a = a.to(DOT_DTYPE)
            b = tl.load(b_base + b_offs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if B_NORM != 0:
                b = b.to(tl.float32)
                if B_NORM == 1:
                    b = b - tl.load(mean_ptr + kk, mask=mask_k, other=0.0)[:, None]
                b = b * tl.load(rstd_ptr + kk, mask=mask_k, other=0.0)[:, None]
                if HAS_GAMMA:
                    b = b * gamma_b[None, :]
                if HAS_BETA:
                    b = b + beta_b[None, :]
            if B_ACT == 4:
                b_up = tl.load(b2_base + b_offs, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
                b = silu(b.to(DOT_DTYPE).to(tl.float32)).to(DOT_DTYPE).to(tl.float32) * b_up
            elif B_ACT != 0:
                b = apply_activation(b.to(tl.float32), B_ACT)
            acc = tl.dot(a, b.to(DOT_DTYPE), acc, input_precision=INPUT_PRECISION)
            if DUAL_B:
                b2 = tl.load(b2_base + b_offs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                acc2 = tl.dot(a, b2.to(DOT_DTYPE), acc2, input_precision=INPUT_PRECISION)
            a_base += BLOCK_K * stride_ak
            b_base += BLOCK_K * stride_bk
            b2_base += BLOCK_K * stride_bk

    # ---- epilogue ----
    mask_c = mask_m[:, None] & mask_n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    aux_ptrs = (aux_ptr + row0 * stride_auxm + col0) + (local_m[:, None] * stride_auxm + local_n[None, :])
    if store_aux != 0:
        tl.store(aux_ptrs, acc.to(aux_ptr.dtype.element_ty), mask=mask_c)
        if DUAL_B:
            tl.store(aux_ptrs + N, acc2.to(aux_ptr.dtype.element_ty), mask=mask_c)
    if ACT == 4:
        # Round like the unfused ops do (gate, silu(gate), up), multiply in fp32; the weight-gradient
        # prologue (B_ACT == 4) rebuilds exactly this operand from the stored pre-activations.
        out_ty = c_ptr.dtype.element_ty
        gate = silu(acc.to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
        acc = gate * acc2.to(out_ty).to(tl.float32)
    elif ACT != 0:
        acc = apply_activation(acc.to(c_ptr.dtype.element_ty).to(tl.float32), ACT)
    acc = acc * alpha
    if HAS_ROW_SCALE:
        acc = acc * tl.load(row_scale_ptr + rm, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    c_ptrs = (c_ptr + row0 * stride_cm + col0 * stride_cn) + (local_m[:, None] * stride_cm + local_n[None, :] * stride_cn)
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
        tl.store(c_ptrs, (res + sign * acc).to(c_ptr.dtype.element_ty), mask=mask_c)
    elif RESIDUAL == 2:
        res = tl.load(res_ptrs, mask=mask_c, other=0)
        tl.store(c_ptrs, res + sign * quantize(acc, frac_scale), mask=mask_c)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)
    if A_SUM:
        if pid_n == 0:
            tl.store(bias_grad_ptr + rm, a_sum * alpha, mask=mask_m)


# The JIT function wrapped twice: the dual-accumulator / SwiGLU-gradient variants (two fp32 tiles
# live in the epilogue) get a config list of their own that does not spill.
fused_gemm_jit = fused_gemm_kernel
fused_gemm_kernel = triton.autotune(configs=gemm_configs("regular"), key=GEMM_TUNE_KEY,
                                    prune_configs_by={"early_config_prune": prune_for_device},
                                    cache_results=True)(fused_gemm_jit)
fused_gemm_dual_kernel = triton.autotune(configs=gemm_configs("dual"), key=GEMM_TUNE_KEY,
                                         prune_configs_by={"early_config_prune": prune_for_device},
                                         cache_results=True)(fused_gemm_jit)
