"""Launchers of the norm's row kernels (kernels/norm.py), with references: the norm once per row
in the forward (:func:`normalize`) and its backward (:func:`norm_bwd_partials`, :func:`norm_bwd`).

The fused halves (ops/fused_mlp.py, ops/fused_attention.py) normalize a block's input once and
hand the rows to the GEMMs of ops/gemm.py, whose checks, partial sums and reduction these share.

    normalize(x, *, norm="layer", eps=1e-6, norm_weight=None, norm_bias=None, out_dtype=None)
        -> (n, mean, rstd); n = norm(x) * gamma + beta in out_dtype (one launch).
    norm_bwd_partials(dn, x, stats, norm_weight, *, norm, has_bias, dres=None, out_dtype=None)
        -> (dx, Partials of [dgamma | dbeta] or None)
    norm_bwd(...) -> (dx, dgamma, dbeta): norm_bwd_partials + gemm.reduce_partials.
"""
from __future__ import annotations

import math

import torch

from . import dispatch
from .gemm import (FLOAT_DTYPES, MAX_NORM_DIM, NORMS, Partials, _check_matrix, _check_same_device, _check_vector,
                   reduce_partials, row_partial_programs)
from .launches import unused_pointer

from revtriton.kernels import norm as norm_kernels  # kernels/ (revtriton/__init__.py maps it in a checkout)
from revtriton.kernels.configs import next_power_of_2, norm_num_warps

# ---------------------------------------------------------------- forward: normalize (once per row)

def _stats_precision(x):
    return x.double() if x.dtype == torch.float64 else x.float()  # fp32 at least; an fp64 oracle stays fp64


def row_stats_reference(x, *, norm="layer", eps=1e-6):
    xf = _stats_precision(x)
    if norm == "layer":
        mean = xf.mean(-1)
        var = (xf - mean[..., None]).pow(2).mean(-1)
    else:
        mean = torch.zeros(xf.shape[:-1], dtype=xf.dtype, device=x.device)
        var = xf.pow(2).mean(-1)
    return mean, torch.rsqrt(var + eps)


def normalize_with_stats(x, stats, norm_weight, norm_bias, norm, dtype):
    """norm(x) * gamma + beta from given (mean, rstd), in fp32, cast once to dtype."""
    mean, rstd = stats
    y = _stats_precision(x)
    if norm == "layer":
        y = y - mean[:, None]
    y = y * rstd[:, None]
    if norm_weight is not None:
        y = y * norm_weight.to(y.dtype)
    if norm_bias is not None:
        y = y + norm_bias.to(y.dtype)
    return y.to(dtype)


def normalize_and_stats_reference(x, *, norm="layer", eps=1e-6, norm_weight=None, norm_bias=None, out_dtype=None):
    """What the ``normalize`` launcher returns: the normalized rows and their (mean, rstd), the stats
    at the kernels' precision (the norm alone: :func:`revtriton.ops.reference.normalize_reference`)."""
    stats = row_stats_reference(x, norm=norm, eps=eps)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return (normalize_with_stats(x, stats, norm_weight, norm_bias, norm, out_dtype),) + stats


class NormalizeLaunch:
    """:func:`normalize` for one signature: its checks at construction (on the first call's
    tensors), then called with each call's ``(x, norm_weight, norm_bias)`` of that signature."""

    launcher = "normalize"  # the public launcher it is (aot.recording_launches names launches by it)
    __slots__ = ("rows", "dim", "out_dtype", "device", "args", "meta")

    def __init__(self, x, *, norm="layer", eps=1e-6, norm_weight=None, norm_bias=None, out_dtype=None):
        _check_matrix(x, "x", unit_col_stride=True)
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        M, D = x.shape
        _check_vector(norm_weight, "norm_weight", D)
        _check_vector(norm_bias, "norm_bias", D)
        if norm == "rms" and norm_bias is not None:
            raise ValueError("RMSNorm has no bias")
        if D > MAX_NORM_DIM:
            raise ValueError(f"row kernels hold a row in registers: dim {D} > {MAX_NORM_DIM}")
        _check_same_device(("x", x), ("norm_weight", norm_weight), ("norm_bias", norm_bias))
        out_dtype = x.dtype if out_dtype is None else out_dtype
        if out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"out_dtype {out_dtype} not supported")
        self.rows, self.dim, self.out_dtype, self.device = M, D, out_dtype, x.device
        block_n = next_power_of_2(D)
        self.args = (M, D, x.stride(0), D, float(eps))  # n is a fresh [M, D]: row stride D
        self.meta = dict(IS_RMS=norm == "rms", HAS_GAMMA=norm_weight is not None, HAS_BETA=norm_bias is not None,
                         BLOCK_N=block_n, num_warps=norm_num_warps(block_n))

    def __call__(self, x, norm_weight=None, norm_bias=None):
        M, D = self.rows, self.dim
        n = torch.empty(M, D, dtype=self.out_dtype, device=self.device)
        mean = torch.empty(M, dtype=torch.float32, device=self.device)  # the kernel writes 0 for RMSNorm
        rstd = torch.empty(M, dtype=torch.float32, device=self.device)
        if M == 0 or D == 0:
            return n, mean.zero_(), rstd
        unused = unused_pointer(x)
        dispatch.launch(norm_kernels.normalize_kernel, (M,), x, n, mean, rstd,
                        unused if norm_weight is None else norm_weight, unused if norm_bias is None else norm_bias,
                        *self.args, **self.meta)
        return n, mean, rstd


def normalize(x, *, norm="layer", eps=1e-6, norm_weight=None, norm_bias=None, out_dtype=None):
    """(n, mean, rstd): n = norm(x) * gamma + beta in out_dtype (default x's), fp32 stats; one launch."""
    launch = NormalizeLaunch(x, norm=norm, eps=eps, norm_weight=norm_weight, norm_bias=norm_bias, out_dtype=out_dtype)
    return launch(x, norm_weight, norm_bias)


def _check_stats(stats, norm_weight, rows, cols):
    if stats is None or len(stats) != 2:
        raise ValueError("stats must be (mean, rstd) from normalize")
    for name, s in zip(("mean", "rstd"), stats):
        _check_vector(s, name, rows, dtypes=(torch.float32,))
    _check_vector(norm_weight, "norm_weight", cols)

# ---------------------------------------------------------------- backward

def norm_bwd_reference(dn, x, stats, norm_weight, *, norm, has_bias, dres=None, out_dtype=None):
    mean, rstd = stats
    xf, dnf = x.float(), dn.float()
    xhat = (xf - mean[:, None]) * rstd[:, None] if norm == "layer" else xf * rstd[:, None]
    wdn = dnf * (norm_weight.float() if norm_weight is not None else 1.0)
    c1 = (xhat * wdn).mean(-1, keepdim=True)
    if norm == "layer":
        dx = (wdn - (xhat * c1 + wdn.mean(-1, keepdim=True))) * rstd[:, None]
    else:
        dx = (wdn - xhat * c1) * rstd[:, None]
    if dres is not None:
        dx = dx + dres.float()
    dx = dx.to(x.dtype if out_dtype is None else out_dtype)
    dgamma = (dnf * xhat).sum(0) if norm_weight is not None else None
    dbeta = dnf.sum(0) if has_bias else None
    return dx, dgamma, dbeta


class NormBwdLaunch:
    """:func:`norm_bwd_partials` for one signature: its checks at construction, then called with
    each call's ``(dn, x, stats, norm_weight, dres)``."""

    launcher = "norm_bwd_partials"  # (aot.recording_launches names launches by it)
    __slots__ = ("rows", "dim", "out_dtype", "param_dtype", "params", "device", "programs", "args", "meta")

    def __init__(self, dn, x, stats, norm_weight, *, norm, has_bias, dres=None, out_dtype=None):
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        _check_matrix(x, "x", unit_col_stride=True)
        M, D = x.shape
        _check_matrix(dn, "dn", rows=M, cols=D, unit_col_stride=True)
        if dres is not None:
            _check_matrix(dres, "dres", rows=M, cols=D, unit_col_stride=True)
        _check_stats(stats, norm_weight, M, D)
        if has_bias and norm == "rms":
            raise ValueError("RMSNorm has no bias")
        if D > MAX_NORM_DIM:
            raise ValueError(f"row kernels hold a row in registers: dim {D} > {MAX_NORM_DIM}")
        _check_same_device(("dn", dn), ("x", x), ("norm_weight", norm_weight), ("dres", dres))
        self.rows, self.dim, self.device = M, D, x.device
        self.out_dtype = x.dtype if out_dtype is None else out_dtype
        self.params = int(norm_weight is not None) + int(has_bias)
        self.param_dtype = norm_weight.dtype if norm_weight is not None else torch.float32
        programs = row_partial_programs(M)
        rows_per_program = math.ceil(M / programs) if M else 0
        self.programs = math.ceil(M / rows_per_program) if M else 0
        block_n = next_power_of_2(D)
        self.args = (M, D, rows_per_program, dn.stride(0), x.stride(0), dres.stride(0) if dres is not None else 0,
                     D)  # dx: a fresh [M, D]
        self.meta = dict(IS_RMS=norm == "rms", HAS_GAMMA=norm_weight is not None, HAS_BETA=has_bias,
                         HAS_DRES=dres is not None, BLOCK_N=block_n, num_warps=norm_num_warps(block_n))

    def __call__(self, dn, x, stats, norm_weight, dres=None):
        M, D = self.rows, self.dim
        dx = torch.empty(M, D, dtype=self.out_dtype, device=self.device)
        partials = None
        if self.params:
            result = torch.empty(self.params * D, dtype=self.param_dtype, device=self.device)
            if M == 0:
                result.zero_()
            else:
                partials = Partials(torch.empty(self.programs, self.params * D, dtype=torch.float32,
                                                device=self.device), result)
        if M == 0 or D == 0:
            return dx, partials
        mean, rstd = stats
        dispatch.launch(norm_kernels.norm_bwd_kernel, (self.programs,), dn, x, mean, rstd,
                        norm_weight if norm_weight is not None else unused_pointer(x),
                        dres if dres is not None else unused_pointer(dn), dx,
                        partials.part if partials is not None else unused_pointer(dx), *self.args, **self.meta)
        return dx, partials


def norm_bwd_partials(dn, x, stats, norm_weight, *, norm, has_bias, dres=None, out_dtype=None):
    """(dx, Partials of [dgamma | dbeta] or None): the row kernel of the norm backward, one launch.

    The reduction's result is one buffer in the norm weight's dtype: dgamma is its first D
    elements (when there is a gamma), dbeta the next D (when there is a beta)."""
    launch = NormBwdLaunch(dn, x, stats, norm_weight, norm=norm, has_bias=has_bias, dres=dres, out_dtype=out_dtype)
    return launch(dn, x, stats, norm_weight, dres)


def norm_param_grads(partials, norm_weight, has_bias):
    """(dgamma or None, dbeta or None) views of a reduced norm_bwd_partials result."""
    if partials is None:
        return None, None
    flat = partials.out
    D = flat.numel() // (int(norm_weight is not None) + int(has_bias))
    dgamma = flat[:D] if norm_weight is not None else None
    dbeta = flat[D:] if norm_weight is not None and has_bias else (flat if has_bias else None)
    return dgamma, dbeta


def norm_bwd(dn, x, stats, norm_weight, *, norm, has_bias, dres=None, out_dtype=None):
    """(dx, dgamma, dbeta) of y = norm(x) * gamma + beta given dn = dL/dy; two launches."""
    dx, partials = norm_bwd_partials(dn, x, stats, norm_weight, norm=norm, has_bias=has_bias, dres=dres,
                                     out_dtype=out_dtype)
    reduce_partials(partials)
    return (dx,) + norm_param_grads(partials, norm_weight, has_bias)
