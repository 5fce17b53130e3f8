"""Row kernels of the fused norm halves: statistics, norm backward, deterministic column sums.

A row is one token's feature vector of length N (the model dim). Every kernel keeps a whole
row in registers (BLOCK_N = next power of two >= N), reads and writes through row strides and
computes in fp32.
"""
import triton
import triton.language as tl


@triton.jit
def row_stats_kernel(x_ptr, mean_ptr, rstd_ptr, M, N, stride_xm, eps,
                     IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """mean and 1/sqrt(var + eps) per row (LayerNorm), or 1/sqrt(mean(x^2) + eps) (RMSNorm, mean = 0)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        mean = 0.0
        var = tl.sum(x * x, axis=0) / N
    else:
        mean = tl.sum(x, axis=0) / N
        centered = tl.where(mask, x - mean, 0.0)
        var = tl.sum(centered * centered, axis=0) / N
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, 1.0 / tl.sqrt(var + eps))


@triton.jit
def norm_bwd_kernel(dn_ptr, x_ptr, mean_ptr, rstd_ptr, gamma_ptr, dres_ptr, dx_ptr,
                    part_dgamma_ptr, part_dbeta_ptr,
                    M, N, rows_per_program, stride_dnm, stride_xm, stride_dresm, stride_dxm,
                    IS_RMS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
                    HAS_DRES: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx = norm'(x)^T dn (+ dres); per-program partial sums of dn * xhat (dgamma) and dn (dbeta).

    Program p handles rows [p * rows_per_program, (p + 1) * rows_per_program) in order and writes
    its partial sums to row p of the partial buffers: no atomics, a fixed summation order.
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
    if HAS_GAMMA:
        tl.store(part_dgamma_ptr + pid * N + cols, dgamma, mask=mask)
    if HAS_BETA:
        tl.store(part_dbeta_ptr + pid * N + cols, dbeta, mask=mask)


@triton.jit
def sum_partials_kernel(part_a_ptr, part_b_ptr, out_a_ptr, out_b_ptr, P, N,
                        HAS_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] = sum_p part[p, n], in order p = 0..P-1 (deterministic); optionally a second buffer."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc_a = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p in range(0, P):
        acc_a += tl.load(part_a_ptr + p * N + cols, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(part_b_ptr + p * N + cols, mask=mask, other=0.0)
    tl.store(out_a_ptr + cols, acc_a.to(out_a_ptr.dtype.element_ty), mask=mask)
    if HAS_B:
        tl.store(out_b_ptr + cols, acc_b.to(out_b_ptr.dtype.element_ty), mask=mask)
