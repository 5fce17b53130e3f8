"""Row kernels of the fused halves: normalise once, scale and cast gradients, norm backward,
deterministic reductions of partial sums.

A row is one token's feature vector of length N (the model dim). Every row kernel keeps a whole
row in registers (BLOCK_N = next power of two >= N), reads and writes through row strides and
computes in fp32. Partial sums (bias gradients, dgamma / dbeta, split-K GEMM partials) are
written one row per program and reduced by sum_partials_kernel in a fixed order: no atomics.
"""
import triton
import triton.language as tl


@triton.jit
def normalize_kernel(x_ptr, out_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, M, N, stride_xm, stride_om, eps,
                     IS_RMS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """out = (x - mean) * rstd * gamma + beta in out's dtype (the GEMM operand), and fp32 mean / rstd.

    RMSNorm: mean = 0, rstd = 1/sqrt(mean(x^2) + eps). The GEMMs that follow read out raw: the
    norm runs once per row, not once per column tile of the next GEMM.
    """
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    row_ptr = x_ptr + row.to(tl.int64) * stride_xm
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        mean = 0.0
        var = tl.sum(x * x, axis=0) / N
    else:
        # Shifted by the row's first element: x - x0 is exact for a large-mean row (both values
        # within a factor of two), so neither the sum nor the centring loses the small spread to
        # the mean's rounding (a row of 3000 + noise would lose about 1e-4 of it in fp32).
        x0 = tl.load(row_ptr).to(tl.float32)
        shifted = tl.where(mask, x - x0, 0.0)
        mean_shift = tl.sum(shifted, axis=0) / N
        x = tl.where(mask, shifted - mean_shift, 0.0)
        var = tl.sum(x * x, axis=0) / N
        mean = x0 + mean_shift
    rstd = 1.0 / tl.sqrt(var + eps)
    y = x * rstd
    if HAS_GAMMA:
        y = y * tl.load(gamma_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BETA:
        y = y + tl.load(beta_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def scale_rows_kernel(g_ptr, out_ptr, row_scale_ptr, part_ptr, M, N, rows_per_program, stride_gm, stride_om, alpha,
                      HAS_ROW_SCALE: tl.constexpr, STORE: tl.constexpr, COL_SUM: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """out = (alpha * row_scale[m] * g) in out's dtype (the GEMM operand of a backward pass) and,
    with COL_SUM, per-program partial column sums of the fp32 scaled rows (a bias gradient).

    Program p handles rows [p * rows_per_program, (p + 1) * rows_per_program) in order.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    col_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = pid * rows_per_program + i
        if row < M:
            row64 = row.to(tl.int64)
            g = tl.load(g_ptr + row64 * stride_gm + cols, mask=mask, other=0.0).to(tl.float32) * alpha
            if HAS_ROW_SCALE:
                g = g * tl.load(row_scale_ptr + row).to(tl.float32)
            if STORE:
                tl.store(out_ptr + row64 * stride_om + cols, g.to(out_ptr.dtype.element_ty), mask=mask)
            col_sum += g
    if COL_SUM:
        tl.store(part_ptr + pid.to(tl.int64) * N + cols, col_sum, mask=mask)


@triton.jit
def norm_bwd_kernel(dn_ptr, x_ptr, mean_ptr, rstd_ptr, gamma_ptr, dres_ptr, dx_ptr, part_ptr,
                    M, N, rows_per_program, stride_dnm, stride_xm, stride_dresm, stride_dxm,
                    IS_RMS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
                    HAS_DRES: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx = norm'(x)^T dn (+ dres); per-program partial sums of dn * xhat (dgamma) and dn (dbeta).

    Program p handles rows [p * rows_per_program, (p + 1) * rows_per_program) in order and writes
    its partial sums to row p of the partial buffer [P, (HAS_GAMMA + HAS_BETA) * N] (dgamma first,
    then dbeta): no atomics, a fixed summation order.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if HAS_GAMMA:
        gamma = tl.load(gamma_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        gamma = tl.where(mask, 1.0, 0.0)
    dgamma = tl.zeros([BLOCK_N], dtype=tl.float32)
    dbeta = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        if row < M:
            row64 = row.to(tl.int64)
            x = tl.load(x_ptr + row64 * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
            dn = tl.load(dn_ptr + row64 * stride_dnm + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            if IS_RMS:
                xhat = x * rstd
            else:
                xhat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
            wdn = dn * gamma
            c1 = tl.sum(xhat * wdn, axis=0) / N
            if IS_RMS:
                dx = (wdn - xhat * c1) * rstd
            else:
                c2 = tl.sum(wdn, axis=0) / N
                dx = (wdn - (xhat * c1 + c2)) * rstd
            if HAS_DRES:
                dx += tl.load(dres_ptr + row64 * stride_dresm + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row64 * stride_dxm + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dgamma += dn * xhat
            dbeta += dn
    part_row = part_ptr + pid.to(tl.int64) * N * (HAS_GAMMA + HAS_BETA)
    if HAS_GAMMA:
        tl.store(part_row + cols, dgamma, mask=mask)
        part_row += N
    if HAS_BETA:
        tl.store(part_row + cols, dbeta, mask=mask)


@triton.jit
def _sum_rows(part_ptr, out_ptr, P, N, col0, BLOCK_N: tl.constexpr):
    """out[c] = sum_p part[p, c] for p = 0..P-1 in order, c in [col0, col0 + BLOCK_N)."""
    if col0 < N:  # a program past this job's columns skips it
        cols = col0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        row_ptr = part_ptr + cols  # advanced a row at a time: 64-bit pointer arithmetic, no int32 p * N
        for _ in range(0, P):
            acc += tl.load(row_ptr, mask=mask, other=0.0)
            row_ptr += N
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_partials_kernel(part0_ptr, out0_ptr, P0, N0, part1_ptr, out1_ptr, P1, N1, part2_ptr, out2_ptr, P2, N2,
                        part3_ptr, out3_ptr, P3, N3, JOBS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Up to four independent reductions out_j[n] = sum_p part_j[p, n] in one launch (deterministic).

    One half's backward collects its partial sums (bias gradients, dgamma / dbeta, split-K weight
    gradients) and reduces them together: one launch instead of one per buffer.
    """
    col0 = tl.program_id(0).to(tl.int64) * BLOCK_N
    _sum_rows(part0_ptr, out0_ptr, P0, N0, col0, BLOCK_N)
    if JOBS >= 2:
        _sum_rows(part1_ptr, out1_ptr, P1, N1, col0, BLOCK_N)
    if JOBS >= 3:
        _sum_rows(part2_ptr, out2_ptr, P2, N2, col0, BLOCK_N)
    if JOBS >= 4:
        _sum_rows(part3_ptr, out3_ptr, P3, N3, col0, BLOCK_N)
