"""Launchers of the fused GEMM and norm kernels (kernels/gemm.py, kernels/norm.py), with references.

Shared by the fused norm+MLP half (ops/fused_mlp.py) and the fused norm+attention half.
Every launcher checks its input (TypeError / ValueError with the reason), allocates, and
launches through ``dispatch.launch`` (so ``count_launches`` sees it). Matrices are 2-D
``[rows, cols]``; rows are tokens (flatten ``[..., d]`` with ``reshape(-1, d)`` first). A weight
is an nn.Linear weight ``[out, in]``. Accumulation and statistics are fp32, one cast at the store.
``dot_dtype`` is the GEMM operand dtype (default: the weight's dtype; under autocast pass the
autocast dtype and cast the weights to it); fp32 operands use IEEE fp32 (no TF32), like torch.

Forward (one launch each)
    row_stats(x, *, norm="layer", eps=1e-6) -> (mean, rstd)
        fp32 [M] each; RMSNorm: mean is zeros, rstd = 1/sqrt(mean(x^2) + eps).
    linear(a, weight, bias=None, *, activation=None, weight_up=None,
           norm=None, stats=None, norm_weight=None, norm_bias=None,
           save_preact=False, dot_dtype=None, out_dtype=None) -> (out, preact or None)
        out = act(norm(a) @ weight.T + bias). ``norm`` in (None, "layer", "rms") applies the
        norm to A in the prologue with ``stats=(mean, rstd)`` from row_stats and gamma/beta
        (``norm_weight``/``norm_bias``, may be None). ``activation`` in (None, "gelu_tanh",
        "gelu", "relu", "swiglu"); "swiglu" needs ``weight_up``: out = silu(a W^T) * (a U^T).
        ``save_preact`` also returns the pre-activation (SwiGLU: [gate | up], 2*out columns).
        out dtype: ``out_dtype`` or dot_dtype.
    linear_couple(a, weight, bias, res, sign, *, frac_bits=None, row_scale=None,
                  dot_dtype=None) -> stream
        h = (a @ weight.T + bias) * row_scale[:, None]; float mode (frac_bits None):
        stream = res + sign * h in res's dtype; exact mode: res int32,
        stream = res + sign * round_half_even(h * 2^frac_bits) (saturated, int32 add).
        Norm prologue also available: ``norm=..., stats=..., norm_weight=..., norm_bias=...``.
Backward
    linear_act_bwd(grad, weight, preact, *, activation, alpha=1.0, row_scale=None,
                   dot_dtype=None) -> d_preact
        ((alpha * row_scale[:, None] * grad) @ weight) * act'(preact), in dot_dtype;
        ``weight`` is the [out, in] weight whose output gradient is ``grad``; "swiglu": preact
        is [gate | up] and the result [d gate | d up].
    linear_input_grad(grad, weight, *, weight2=None, alpha=1.0, row_scale=None,
                      dot_dtype=None, out_dtype=torch.float32) -> grad @ weight
        with ``weight2``: grad[:, :H] @ weight + grad[:, H:] @ weight2 (grad has 2H columns).
    linear_weight_grad(grad, inp, *, grad_scale=None, alpha=1.0, inp_activation=None,
                       norm=None, stats=None, norm_weight=None, norm_bias=None,
                       bias_grad=False, dot_dtype=None, out_dtype=torch.float32) -> (dW, db or None)
        dW = (alpha * grad_scale[:, None] * grad).T @ f(inp), f = the norm prologue (inp is x)
        or an activation of a stored pre-activation (inp_activation, "swiglu": inp = [gate | up]);
        db = column sums of the scaled grad (same pass, no atomics).
    norm_bwd(dn, x, stats, norm_weight, *, norm, has_bias, dres=None, out_dtype=None)
        -> (dx, dgamma or None, dbeta or None)
        dx = norm backward of dn (+ dres, the residual-gradient add); dgamma/dbeta from
        per-program partial sums reduced in a second pass (two launches, deterministic).

References: ``*_reference`` beside each launcher, same arguments, pure torch.

Kernels: one JIT GEMM (kernels/gemm.py) autotuned through two wrappers with their own config
lists (``fused_gemm_kernel``; ``fused_gemm_dual_kernel`` for SwiGLU's dual accumulator and its
gradient), keyed on N, K and the variant flags, never on M. Whether the pre-activation is saved
is a runtime flag (not specialised by the JIT), so a no-grad forward and its with-grad recompute
run the same compiled kernel with the same config and agree bitwise. The static model
(revtriton/aot.py, perf/static.py) compiles these launches ahead of time at production shapes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import dispatch
from .mlp import activation_reference
from .streams import check_frac_bits, quantize_reference

from revtriton.kernels import gemm as gemm_kernels  # kernels/ (revtriton/__init__.py maps it in a checkout)
from revtriton.kernels import norm as norm_kernels
from revtriton.kernels.configs import norm_num_warps

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
ACTIVATION_CODES = {None: gemm_kernels.ACT_NONE, "gelu_tanh": gemm_kernels.ACT_GELU_TANH,
                    "gelu": gemm_kernels.ACT_GELU, "relu": gemm_kernels.ACT_RELU, "swiglu": gemm_kernels.ACT_SWIGLU}
NORM_CODES = {None: gemm_kernels.NORM_NONE, "layer": gemm_kernels.NORM_LAYER, "rms": gemm_kernels.NORM_RMS}
MAX_NORM_DIM = 16384  # a row kernel keeps a whole row in registers


# ---------------------------------------------------------------- checks

def _check_matrix(t, name, *, dtypes=FLOAT_DTYPES, rows=None, cols=None, unit_col_stride=False):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype {t.dtype} not supported (expected one of {dtypes})")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, expected {rows}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} has {t.shape[1]} columns, expected {cols}")
    if unit_col_stride and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dim, got strides {t.stride()}")
    if t.numel() and t.shape[0] > 1 and t.stride(0) == 0 or (t.numel() and t.shape[1] > 1 and t.stride(1) == 0):
        raise ValueError(f"{name} is a broadcast (stride-0) view: materialize it first, strides {t.stride()}")


def _check_vector(t, name, length, *, dtypes=FLOAT_DTYPES):
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor of length {length}, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.shape[0] != length:
        raise ValueError(f"{name} has length {t.shape[0]}, expected {length}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype {t.dtype} not supported (expected one of {dtypes})")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_same_device(*named):
    devices = {t.device for _, t in named if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError("tensors on different devices: " + ", ".join(
            f"{n}={t.device}" for n, t in named if isinstance(t, torch.Tensor)))


def _dot_dtype(weight, dot_dtype):
    dot_dtype = weight.dtype if dot_dtype is None else dot_dtype
    if dot_dtype not in FLOAT_DTYPES:
        raise TypeError(f"dot_dtype {dot_dtype} not supported (expected one of {FLOAT_DTYPES})")
    if weight.dtype != dot_dtype:
        raise TypeError(f"weight dtype {weight.dtype} != GEMM operand dtype {dot_dtype}: cast the weight first")
    return dot_dtype


def _check_norm(norm, stats, norm_weight, norm_bias, rows, cols, stats_name="stats"):
    if norm not in NORM_CODES:
        raise ValueError(f"norm must be one of {tuple(NORM_CODES)}, got {norm!r}")
    if norm is None:
        if stats is not None or norm_weight is not None or norm_bias is not None:
            raise ValueError("stats / norm_weight / norm_bias given without norm=")
        return
    if stats is None or len(stats) != 2:
        raise ValueError(f"norm={norm!r} needs {stats_name}=(mean, rstd) from row_stats")
    for name, s in zip(("mean", "rstd"), stats):
        _check_vector(s, name, rows, dtypes=(torch.float32,))
    _check_vector(norm_weight, "norm_weight", cols)
    _check_vector(norm_bias, "norm_bias", cols)
    if norm == "rms" and norm_bias is not None:
        raise ValueError("RMSNorm has no bias")


def _check_row_scale(row_scale, rows):
    _check_vector(row_scale, "row_scale", rows)


# ---------------------------------------------------------------- the GEMM launch

def _launch_gemm(a, b, b_strides, c, M, N, K, *, dot_dtype, b2=None, mean=None, rstd=None, gamma=None, beta=None,
                 k_scale=None, bias=None, row_scale=None, aux=None, store_aux=False, res=None, bias_grad=None,
                 alpha=1.0, sign=1, frac_bits=0, a_norm=None, b_norm=None, b_act=None, dual_b=False,
                 second_k=False, act=None, act_bwd=None, residual=0):
    """One launch of kernels.gemm.fused_gemm_kernel. ``b`` is read as a [K, N] matrix with ``b_strides``."""
    dummy = c  # unused pointers: any tensor; a fixed choice per variant keeps the tuning key stable
    stride_bk, stride_bn = b_strides

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    dual = dual_b or act_bwd == "swiglu"
    dispatch.launch(
        gemm_kernels.fused_gemm_dual_kernel if dual else gemm_kernels.fused_gemm_kernel, grid,
        a, b, dummy if b2 is None else b2, c, M, N, K,
        a.stride(0), a.stride(1), stride_bk, stride_bn, c.stride(0), c.stride(1),
        dummy if mean is None else mean, dummy if rstd is None else rstd,
        dummy if gamma is None else gamma, dummy if beta is None else beta,
        dummy if k_scale is None else k_scale,
        dummy if bias is None else bias, dummy if row_scale is None else row_scale,
        dummy if aux is None else aux, 0 if aux is None else aux.stride(0),
        dummy if res is None else res, 0 if res is None else res.stride(0),
        dummy if bias_grad is None else bias_grad,
        float(alpha), int(sign), float(2.0 ** frac_bits), int(bool(store_aux)),
        A_NORM=NORM_CODES[a_norm], B_NORM=NORM_CODES[b_norm], HAS_GAMMA=gamma is not None, HAS_BETA=beta is not None,
        A_SCALE_K=k_scale is not None, B_ACT=ACTIVATION_CODES[b_act], DUAL_B=dual_b, SECOND_K=second_k,
        A_SUM=bias_grad is not None, HAS_BIAS=bias is not None, ACT=ACTIVATION_CODES[act],
        ACT_BWD=ACTIVATION_CODES[act_bwd], HAS_ROW_SCALE=row_scale is not None, RESIDUAL=residual,
        DOT_DTYPE=TL_DTYPES[dot_dtype], INPUT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
    )
    return c


def _weight_as_b(weight):
    """An nn.Linear weight [N, K] read as B = weight.T [K, N]."""
    return weight, (weight.stride(1), weight.stride(0))


# ---------------------------------------------------------------- row statistics

def row_stats_reference(x, *, norm="layer", eps=1e-6):
    xf = x.float()
    if norm == "layer":
        mean = xf.mean(-1)
        var = (xf - mean[..., None]).pow(2).mean(-1)
    else:
        mean = torch.zeros(xf.shape[:-1], dtype=torch.float32, device=x.device)
        var = xf.pow(2).mean(-1)
    return mean, torch.rsqrt(var + eps)


def row_stats(x, *, norm="layer", eps=1e-6):
    """fp32 (mean, rstd) per row of x [M, D] (one launch)."""
    _check_matrix(x, "x", unit_col_stride=True)
    if norm not in ("layer", "rms"):
        raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
    M, D = x.shape
    if D > MAX_NORM_DIM:
        raise ValueError(f"row kernels hold a row in registers: dim {D} > {MAX_NORM_DIM}")
    mean = torch.zeros(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return mean, rstd
    block_n = triton.next_power_of_2(D)
    dispatch.launch(norm_kernels.row_stats_kernel, (M,), x, mean, rstd, M, D, x.stride(0), float(eps),
                    IS_RMS=norm == "rms", BLOCK_N=block_n, num_warps=norm_num_warps(block_n))
    return mean, rstd


# ---------------------------------------------------------------- forward GEMMs

def _normalize_with_stats(a, stats, norm_weight, norm_bias, norm, dtype):
    mean, rstd = stats
    y = a.float()
    if norm == "layer":
        y = y - mean[:, None]
    y = y * rstd[:, None]
    if norm_weight is not None:
        y = y * norm_weight.float()
    if norm_bias is not None:
        y = y + norm_bias.float()
    return y.to(dtype)


def _activation(h, activation):
    return h if activation is None else activation_reference(h, activation)


def linear_reference(a, weight, bias=None, *, activation=None, weight_up=None, norm=None, stats=None,
                     norm_weight=None, norm_bias=None, save_preact=False, dot_dtype=None, out_dtype=None):
    dot_dtype = weight.dtype if dot_dtype is None else dot_dtype
    out_dtype = dot_dtype if out_dtype is None else out_dtype
    x = a.to(dot_dtype) if norm is None else _normalize_with_stats(a, stats, norm_weight, norm_bias, norm, dot_dtype)
    z = (x.float() @ weight.float().t() + (0 if bias is None else bias.float())).to(dot_dtype)
    if activation == "swiglu":
        up = (x.float() @ weight_up.float().t()).to(dot_dtype)
        out = (F.silu(z.float()).to(dot_dtype).float() * up.float()).to(out_dtype)
        return out, (torch.cat([z, up], dim=1) if save_preact else None)
    return _activation(z.float(), activation).to(out_dtype), (z if save_preact else None)


def _check_forward_gemm(a, weight, bias, norm, stats, norm_weight, norm_bias, dot_dtype):
    """Checks shared by the forward GEMM launchers; returns (dot_dtype, M, K, N)."""
    _check_matrix(weight, "weight")
    dot_dtype = _dot_dtype(weight, dot_dtype)
    _check_matrix(a, "a", cols=weight.shape[1])
    if norm is None and a.dtype != dot_dtype:
        raise TypeError(f"a dtype {a.dtype} != GEMM operand dtype {dot_dtype} (only a norm prologue casts)")
    M, K = a.shape
    N = weight.shape[0]
    _check_norm(norm, stats, norm_weight, norm_bias, M, K)
    _check_vector(bias, "bias", N)
    return dot_dtype, M, K, N


def linear(a, weight, bias=None, *, activation=None, weight_up=None, norm=None, stats=None, norm_weight=None,
           norm_bias=None, save_preact=False, dot_dtype=None, out_dtype=None):
    """act(norm(a) @ weight.T + bias) in one launch; see the module doc."""
    dot_dtype, M, K, N = _check_forward_gemm(a, weight, bias, norm, stats, norm_weight, norm_bias, dot_dtype)
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {tuple(ACTIVATION_CODES)}, got {activation!r}")
    if (activation == "swiglu") != (weight_up is not None):
        raise ValueError("activation='swiglu' and weight_up go together")
    if weight_up is not None:
        _check_matrix(weight_up, "weight_up", rows=N, cols=K)
        if weight_up.dtype != weight.dtype or weight_up.stride() != weight.stride():
            raise TypeError("weight_up must have the dtype and strides of weight")
        if bias is not None:
            raise ValueError("the SwiGLU GEMM takes no bias")
    _check_same_device(("a", a), ("weight", weight), ("weight_up", weight_up), ("bias", bias))
    out_dtype = dot_dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not supported")
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    preact = None
    if save_preact:
        preact = torch.empty(M, 2 * N if weight_up is not None else N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out, preact
    mean, rstd = stats if norm is not None else (None, None)
    b, b_strides = _weight_as_b(weight)
    # The aux pointer is always `out`-typed, saved or not: forward and recompute share one tuning key.
    _launch_gemm(a, b, b_strides, out, M, N, K, dot_dtype=dot_dtype, b2=weight_up, mean=mean, rstd=rstd,
                 gamma=norm_weight, beta=norm_bias, bias=bias, aux=preact if save_preact else out,
                 store_aux=save_preact, a_norm=norm, dual_b=weight_up is not None, act=activation)
    return out, preact


def linear_couple_reference(a, weight, bias, res, sign, *, frac_bits=None, row_scale=None, norm=None, stats=None,
                            norm_weight=None, norm_bias=None, dot_dtype=None):
    dot_dtype = weight.dtype if dot_dtype is None else dot_dtype
    x = a.to(dot_dtype) if norm is None else _normalize_with_stats(a, stats, norm_weight, norm_bias, norm, dot_dtype)
    h = x.float() @ weight.float().t() + (0 if bias is None else bias.float())
    if row_scale is not None:
        h = h * row_scale.float()[:, None]
    if frac_bits is None:
        return (res.float() + sign * h).to(res.dtype)
    q = quantize_reference(h, frac_bits)
    return res + q if sign > 0 else res - q


def linear_couple(a, weight, bias, res, sign, *, frac_bits=None, row_scale=None, norm=None, stats=None,
                  norm_weight=None, norm_bias=None, dot_dtype=None):
    """res + sign * (norm(a) @ weight.T + bias) * row_scale, float or exact, in one launch."""
    dot_dtype, M, K, N = _check_forward_gemm(a, weight, bias, norm, stats, norm_weight, norm_bias, dot_dtype)
    _check_row_scale(row_scale, M)
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    if frac_bits is None:
        _check_matrix(res, "res", rows=M, cols=N, unit_col_stride=True)
        residual = gemm_kernels.RES_FLOAT
    else:
        check_frac_bits(frac_bits)
        _check_matrix(res, "res", dtypes=(torch.int32,), rows=M, cols=N, unit_col_stride=True)
        residual = gemm_kernels.RES_EXACT
    _check_same_device(("a", a), ("weight", weight), ("bias", bias), ("res", res), ("row_scale", row_scale))
    out = torch.empty(M, N, dtype=res.dtype, device=res.device)
    if M == 0 or N == 0:
        return out
    mean, rstd = stats if norm is not None else (None, None)
    b, b_strides = _weight_as_b(weight)
    _launch_gemm(a, b, b_strides, out, M, N, K, dot_dtype=dot_dtype, mean=mean, rstd=rstd, gamma=norm_weight,
                 beta=norm_bias, bias=bias, row_scale=row_scale, res=res, sign=sign,
                 frac_bits=0 if frac_bits is None else frac_bits, a_norm=norm, residual=residual)
    return out


# ---------------------------------------------------------------- backward GEMMs

def _activation_grad_reference(z, activation):
    z = z.detach().float().requires_grad_(True)
    with torch.enable_grad():
        y = _activation(z, activation)
        (g,) = torch.autograd.grad(y.sum(), z)
    return g


def linear_act_bwd_reference(grad, weight, preact, *, activation, alpha=1.0, row_scale=None, dot_dtype=None):
    dot_dtype = weight.dtype if dot_dtype is None else dot_dtype
    g = grad.to(dot_dtype).float() @ weight.float() * alpha
    if row_scale is not None:
        g = g * row_scale.float()[:, None]
    if activation == "swiglu":
        n = weight.shape[1]
        zg, zu = preact[:, :n].float(), preact[:, n:].float()
        sig = torch.sigmoid(zg)
        return torch.cat([g * zu * sig * (1 + zg * (1 - sig)), g * F.silu(zg)], 1).to(dot_dtype)
    return (g * _activation_grad_reference(preact, activation)).to(dot_dtype)


def linear_act_bwd(grad, weight, preact, *, activation, alpha=1.0, row_scale=None, dot_dtype=None):
    """((alpha * row_scale * grad) @ weight) * act'(preact) in one launch (the dH GEMM)."""
    _check_matrix(weight, "weight")
    dot_dtype = _dot_dtype(weight, dot_dtype)
    N_out, H = weight.shape
    _check_matrix(grad, "grad", cols=N_out)
    M = grad.shape[0]
    if activation not in ("gelu_tanh", "gelu", "relu", "swiglu"):
        raise ValueError(f"activation must be gelu_tanh, gelu, relu or swiglu, got {activation!r}")
    width = 2 * H if activation == "swiglu" else H
    _check_matrix(preact, "preact", dtypes=(dot_dtype,), rows=M, cols=width, unit_col_stride=True)
    _check_row_scale(row_scale, M)
    _check_same_device(("grad", grad), ("weight", weight), ("preact", preact), ("row_scale", row_scale))
    out = torch.empty(M, width, dtype=dot_dtype, device=grad.device)
    if M == 0 or H == 0:
        return out
    # B = weight [N_out, H] read as [K = N_out, N = H]: no transpose.
    _launch_gemm(grad, weight, (weight.stride(0), weight.stride(1)), out, M, H, N_out, dot_dtype=dot_dtype,
                 row_scale=row_scale, aux=preact, alpha=alpha, act_bwd=activation)
    return out


def linear_input_grad_reference(grad, weight, *, weight2=None, alpha=1.0, row_scale=None, dot_dtype=None,
                                out_dtype=torch.float32):
    dot_dtype = weight.dtype if dot_dtype is None else dot_dtype
    g = grad.to(dot_dtype).float()
    if weight2 is None:
        out = g @ weight.float()
    else:
        h = weight.shape[0]
        out = g[:, :h] @ weight.float() + g[:, h:] @ weight2.float()
    out = out * alpha
    if row_scale is not None:
        out = out * row_scale.float()[:, None]
    return out.to(out_dtype)


def linear_input_grad(grad, weight, *, weight2=None, alpha=1.0, row_scale=None, dot_dtype=None,
                      out_dtype=torch.float32):
    """grad @ weight (+ grad[:, H:] @ weight2), one launch; weight is [H, D] (the layer's [out, in])."""
    _check_matrix(weight, "weight")
    dot_dtype = _dot_dtype(weight, dot_dtype)
    H, D = weight.shape
    _check_matrix(grad, "grad", cols=2 * H if weight2 is not None else H)
    if weight2 is not None:
        _check_matrix(weight2, "weight2", rows=H, cols=D)
        if weight2.dtype != weight.dtype or weight2.stride() != weight.stride():
            raise TypeError("weight2 must have the dtype and strides of weight")
    M = grad.shape[0]
    _check_row_scale(row_scale, M)
    _check_same_device(("grad", grad), ("weight", weight), ("weight2", weight2))
    out = torch.empty(M, D, dtype=out_dtype, device=grad.device)
    if M == 0 or D == 0:
        return out
    if H == 0:
        return out.zero_()
    _launch_gemm(grad, weight, (weight.stride(0), weight.stride(1)), out, M, D, H, dot_dtype=dot_dtype, b2=weight2,
                 row_scale=row_scale, alpha=alpha, second_k=weight2 is not None)
    return out


def linear_weight_grad_reference(grad, inp, *, grad_scale=None, alpha=1.0, inp_activation=None, norm=None,
                                 stats=None, norm_weight=None, norm_bias=None, bias_grad=False, dot_dtype=None,
                                 out_dtype=torch.float32):
    dot_dtype = grad.dtype if dot_dtype is None else dot_dtype
    g = grad.float() * alpha
    if grad_scale is not None:
        g = g * grad_scale.float()[:, None]
    if norm is not None:
        x = _normalize_with_stats(inp, stats, norm_weight, norm_bias, norm, dot_dtype)
    elif inp_activation == "swiglu":
        n = inp.shape[1] // 2
        x = (F.silu(inp[:, :n].float()).to(dot_dtype).float() * inp[:, n:].float()).to(dot_dtype)
    else:
        x = _activation(inp.float(), inp_activation).to(dot_dtype)
    dw = (g.to(dot_dtype).float().t() @ x.float()).to(out_dtype)
    return dw, (g.sum(0).to(out_dtype) if bias_grad else None)


def linear_weight_grad(grad, inp, *, grad_scale=None, alpha=1.0, inp_activation=None, norm=None, stats=None,
                       norm_weight=None, norm_bias=None, bias_grad=False, dot_dtype=None, out_dtype=torch.float32):
    """dW = (alpha * grad_scale * grad).T @ f(inp) [and the bias gradient], one launch."""
    _check_matrix(grad, "grad")
    M, N_out = grad.shape
    dot_dtype = grad.dtype if dot_dtype is None else dot_dtype
    if dot_dtype not in FLOAT_DTYPES:
        raise TypeError(f"dot_dtype {dot_dtype} not supported")
    _check_matrix(inp, "inp", rows=M)
    width = inp.shape[1]
    if inp_activation not in ACTIVATION_CODES:
        raise ValueError(f"inp_activation must be one of {tuple(ACTIVATION_CODES)}, got {inp_activation!r}")
    if inp_activation is not None and norm is not None:
        raise ValueError("inp_activation and norm are exclusive")
    if inp_activation == "swiglu":
        if width % 2:
            raise ValueError(f"a SwiGLU pre-activation has an even number of columns, got {width}")
        width //= 2
    if norm is None and inp.dtype != dot_dtype:
        raise TypeError(f"inp dtype {inp.dtype} != GEMM operand dtype {dot_dtype} (only a norm prologue casts)")
    _check_norm(norm, stats, norm_weight, norm_bias, M, width)
    _check_vector(grad_scale, "grad_scale", M)
    _check_same_device(("grad", grad), ("inp", inp), ("grad_scale", grad_scale))
    dw = torch.empty(N_out, width, dtype=out_dtype, device=grad.device)
    db = torch.zeros(N_out, dtype=torch.float32, device=grad.device) if bias_grad else None
    if N_out == 0 or width == 0:
        return dw, db
    if M == 0:
        return dw.zero_(), db
    mean, rstd = stats if norm is not None else (None, None)
    # A = grad.T [N_out, M], B = f(inp) [M, width]: K runs over tokens.
    a = grad.t()
    b2 = inp[:, width:] if inp_activation == "swiglu" else None
    _launch_gemm(a, inp, (inp.stride(0), inp.stride(1)), dw, N_out, width, M, dot_dtype=dot_dtype, b2=b2,
                 mean=mean, rstd=rstd, gamma=norm_weight, beta=norm_bias, k_scale=grad_scale, bias_grad=db,
                 alpha=alpha, b_norm=norm, b_act=inp_activation)
    return dw, (None if db is None else db.to(out_dtype))


# ---------------------------------------------------------------- norm backward

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


def norm_partial_programs(rows: int) -> int:
    """Programs of the norm backward: a function of the row count only (fixed summation order).

    The interpreter runs programs one after the other, so it gets few long ones."""
    return max(1, min(rows, 8 if dispatch.interpreter_enabled() else 512))


def norm_bwd(dn, x, stats, norm_weight, *, norm, has_bias, dres=None, out_dtype=None):
    """(dx, dgamma, dbeta) of y = norm(x) * gamma + beta given dn = dL/dy; two launches."""
    if norm not in ("layer", "rms"):
        raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
    _check_matrix(x, "x", unit_col_stride=True)
    M, D = x.shape
    _check_matrix(dn, "dn", rows=M, cols=D, unit_col_stride=True)
    if dres is not None:
        _check_matrix(dres, "dres", rows=M, cols=D, unit_col_stride=True)
    _check_norm(norm, stats, norm_weight, None, M, D)
    if has_bias and norm == "rms":
        raise ValueError("RMSNorm has no bias")
    if D > MAX_NORM_DIM:
        raise ValueError(f"row kernels hold a row in registers: dim {D} > {MAX_NORM_DIM}")
    _check_same_device(("dn", dn), ("x", x), ("norm_weight", norm_weight), ("dres", dres))
    out_dtype = x.dtype if out_dtype is None else out_dtype
    dx = torch.empty(M, D, dtype=out_dtype, device=x.device)
    param_dtype = norm_weight.dtype if norm_weight is not None else torch.float32
    dgamma = torch.zeros(D, dtype=param_dtype, device=x.device) if norm_weight is not None else None
    dbeta = torch.zeros(D, dtype=param_dtype, device=x.device) if has_bias else None
    if M == 0 or D == 0:
        return dx, dgamma, dbeta
    programs = norm_partial_programs(M)
    rows_per_program = math.ceil(M / programs)
    programs = math.ceil(M / rows_per_program)
    part_dgamma = torch.empty(programs, D, dtype=torch.float32, device=x.device) if dgamma is not None else None
    part_dbeta = torch.empty(programs, D, dtype=torch.float32, device=x.device) if has_bias else None
    block_n = triton.next_power_of_2(D)
    mean, rstd = stats
    dispatch.launch(norm_kernels.norm_bwd_kernel, (programs,), dn, x, mean, rstd,
                    norm_weight if norm_weight is not None else x, dres if dres is not None else dn, dx,
                    part_dgamma if part_dgamma is not None else dx, part_dbeta if part_dbeta is not None else dx,
                    M, D, rows_per_program, dn.stride(0), x.stride(0), dres.stride(0) if dres is not None else 0,
                    dx.stride(0), IS_RMS=norm == "rms", HAS_GAMMA=norm_weight is not None, HAS_BETA=has_bias,
                    HAS_DRES=dres is not None, BLOCK_N=block_n, num_warps=norm_num_warps(block_n))
    if dgamma is not None or dbeta is not None:
        first, second = (part_dgamma, part_dbeta) if part_dgamma is not None else (part_dbeta, None)
        out_first, out_second = (dgamma, dbeta) if dgamma is not None else (dbeta, None)
        block = min(block_n, 1024)
        dispatch.launch(norm_kernels.sum_partials_kernel, (triton.cdiv(D, block),), first,
                        second if second is not None else first, out_first,
                        out_second if out_second is not None else out_first, programs, D,
                        HAS_B=second is not None, BLOCK_N=block, num_warps=norm_num_warps(block))
    return dx, dgamma, dbeta
