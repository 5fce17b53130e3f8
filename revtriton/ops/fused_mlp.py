"""The fused norm+MLP coupling half: autograd Functions over the kernels of ops/gemm.py.

Forward couple (3 launches): row stats -> GEMM1 (norm prologue; bias + activation, or SwiGLU
gate * up, in the epilogue) -> GEMM2 (bias, row scale, residual +/- float or exact epilogue).
With grad enabled GEMM1 also stores its pre-activation for backward (a runtime flag of the
same compiled kernel, so the forward and the recompute share a config and agree bitwise).

Backward (6 launches): dH GEMM with the activation derivative in its epilogue; the two weight
gradients (bias gradients summed in the same passes, the activation / norm re-applied in the
B prologue instead of stored); the input-gradient GEMM; the norm backward with per-program
dgamma/dbeta partial sums and a second reducing pass. No atomics anywhere.

Semantics are those of the references in ops/mlp.py (norm_mlp_reference, swiglu_mlp_reference)
and of the couple protocol (ops/streams.py): float mode returns ``(stream, stream or None)``,
exact mode ``(int32 stream, gradient port or None)``.
"""
from __future__ import annotations

import torch

from . import gemm
from .mlp import ACTIVATIONS, NORMS
from .streams import check_frac_bits, couple_result, function_outputs


# ---------------------------------------------------------------- input handling

def _dot_dtype(x: torch.Tensor, weights) -> torch.dtype:
    """GEMM operand dtype: the autocast dtype when autocast is on, else x's dtype (weights must match)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    for name, w in weights:
        if w is not None and w.dtype != x.dtype:
            raise TypeError(f"{name} dtype {w.dtype} does not match the input dtype {x.dtype} (outside autocast)")
    return x.dtype


def _check_common(res, x, sign, frac_bits, dim):
    if not isinstance(x, torch.Tensor) or not isinstance(res, torch.Tensor):
        raise TypeError("res and x must be tensors")
    if x.dim() < 1 or x.shape[-1] != dim:
        raise ValueError(f"input last dim {x.shape[-1] if x.dim() else None} does not match the half's dim {dim}")
    if res.shape != x.shape:
        raise ValueError(f"stream shape {tuple(res.shape)} does not match the input shape {tuple(x.shape)}")
    if x.dtype not in gemm.FLOAT_DTYPES:
        raise TypeError(f"input dtype {x.dtype} not supported (expected one of {gemm.FLOAT_DTYPES})")
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    if frac_bits is None:
        if res.dtype not in gemm.FLOAT_DTYPES:
            raise TypeError(f"a float residual stream must be fp16/bf16/fp32, got {res.dtype}")
    else:
        check_frac_bits(frac_bits)
        if res.dtype != torch.int32:
            raise TypeError(f"an exact residual stream must be int32, got {res.dtype}")
    if res.device != x.device:
        raise ValueError(f"res on {res.device} but x on {x.device}")


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., dim] -> [M, dim] with unit column stride (a view when possible)."""
    t = t.reshape(-1, dim)
    return t if t.stride(1) == 1 or dim == 1 else t.contiguous()


def _flat_row_scale(row_scale, x):
    if row_scale is None:
        return None
    if row_scale.shape != x.shape[:-1]:
        raise ValueError(f"row_scale shape {tuple(row_scale.shape)} must be the input's leading shape "
                         f"{tuple(x.shape[:-1])}")
    return row_scale.detach().reshape(-1).to(torch.float32).contiguous()


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# ---------------------------------------------------------------- LayerNorm / RMSNorm + MLP

def _norm_mlp_forward(res2, x2, sign, frac_bits, norm_weight, norm_bias, w1, b1, w2, b2, norm, activation, eps,
                      row_scale, dot_dtype, save):
    stats = gemm.row_stats(x2, norm=norm, eps=eps)
    a1, z1 = gemm.linear(x2, w1.to(dot_dtype), b1, activation=activation, norm=norm, stats=stats,
                         norm_weight=norm_weight, norm_bias=norm_bias, save_preact=save, dot_dtype=dot_dtype)
    stream = gemm.linear_couple(a1, w2.to(dot_dtype), b2, res2, sign, frac_bits=frac_bits, row_scale=row_scale,
                                dot_dtype=dot_dtype)
    return stream, stats, z1


class FusedNormMLPCouple(torch.autograd.Function):
    @staticmethod
    def forward(ctx, res, x, norm_weight, norm_bias, w1, b1, w2, b2, row_scale, sign, frac_bits, norm, activation,
                eps, dot_dtype):
        dim = x.shape[-1]
        x2 = _rows(x, dim)
        stream, (mean, rstd), z1 = _norm_mlp_forward(_rows(res, dim), x2, sign, frac_bits, norm_weight, norm_bias, w1,
                                                     b1, w2, b2, norm, activation, eps, row_scale, dot_dtype, True)
        ctx.save_for_backward(x2, mean, rstd, z1, norm_weight, norm_bias, w1, w2, row_scale)
        ctx.options = (sign, frac_bits, norm, activation, dot_dtype, b1 is not None, b2 is not None)
        ctx.x_shape = x.shape
        return function_outputs(ctx, stream.view(res.shape), frac_bits)

    @staticmethod
    def backward(ctx, *grads):
        x2, mean, rstd, z1, norm_weight, norm_bias, w1, w2, row_scale = ctx.saved_tensors
        sign, frac_bits, norm, activation, dot_dtype, has_b1, has_b2 = ctx.options
        g = grads[0] if frac_bits is None else grads[1]
        dim = x2.shape[1]
        grad_res = g if (frac_bits is None and ctx.needs_input_grad[0]) else None
        g2 = g.reshape(-1, dim).contiguous()
        w1c, w2c = w1.to(dot_dtype), w2.to(dot_dtype)
        need = ctx.needs_input_grad
        dz1 = gemm.linear_act_bwd(g2, w2c, z1, activation=activation, alpha=sign, row_scale=row_scale,
                                  dot_dtype=dot_dtype)
        dw2 = db2 = dw1 = db1 = dx = dgamma = dbeta = None
        if need[6] or need[7]:
            dw2, db2 = gemm.linear_weight_grad(g2, z1, grad_scale=row_scale, alpha=sign, inp_activation=activation,
                                               bias_grad=has_b2, dot_dtype=dot_dtype, out_dtype=w2.dtype)
        if need[4] or need[5]:
            dw1, db1 = gemm.linear_weight_grad(dz1, x2, norm=norm, stats=(mean, rstd), norm_weight=norm_weight,
                                               norm_bias=norm_bias, bias_grad=has_b1, dot_dtype=dot_dtype,
                                               out_dtype=w1.dtype)
        if need[1] or need[2] or need[3]:
            dn = gemm.linear_input_grad(dz1, w1c, dot_dtype=dot_dtype)
            dx, dgamma, dbeta = gemm.norm_bwd(dn, x2, (mean, rstd), norm_weight, norm=norm,
                                              has_bias=norm_bias is not None)
            dx = dx.view(ctx.x_shape)
        return (grad_res, dx, dgamma, dbeta, dw1, db1 if has_b1 else None, dw2, db2 if has_b2 else None,
                None, None, None, None, None, None, None)


def fused_norm_mlp_couple(res, x, sign, frac_bits, norm_weight, norm_bias, w1, b1, w2, b2, *, norm="layer",
                          activation="gelu_tanh", eps=1e-6, row_scale=None):
    """``res + sign * fc2(act(fc1(norm(x))))`` (times row_scale) as ``(stream, port)``, fused."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if norm == "rms" and norm_bias is not None:
        raise ValueError("RMSNorm has no bias")
    dim = w1.shape[1]
    _check_common(res, x, sign, frac_bits, dim)
    if w2.shape != (dim, w1.shape[0]):
        raise ValueError(f"w2 shape {tuple(w2.shape)} must be {(dim, w1.shape[0])} for w1 {tuple(w1.shape)}")
    dot_dtype = _dot_dtype(x, [("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)])
    rs = _flat_row_scale(row_scale, x)
    params = (norm_weight, norm_bias, w1, b1, w2, b2)
    if _needs_grad(res, x, *params):
        out = FusedNormMLPCouple.apply(res, x, *params, rs, sign, frac_bits, norm, activation, eps, dot_dtype)
        return couple_result(out, frac_bits)
    with torch.no_grad():
        stream, _, _ = _norm_mlp_forward(_rows(res, dim), _rows(x, dim), sign, frac_bits, *params, norm, activation,
                                         eps, rs, dot_dtype, False)
    return stream.view(res.shape), None


# ---------------------------------------------------------------- RMSNorm + SwiGLU

def _swiglu_forward(res2, x2, sign, frac_bits, norm_weight, w_gate, w_up, w_down, eps, row_scale, dot_dtype, save):
    stats = gemm.row_stats(x2, norm="rms", eps=eps)
    a1, z = gemm.linear(x2, w_gate.to(dot_dtype), None, activation="swiglu", weight_up=w_up.to(dot_dtype),
                        norm="rms", stats=stats, norm_weight=norm_weight, save_preact=save, dot_dtype=dot_dtype)
    stream = gemm.linear_couple(a1, w_down.to(dot_dtype), None, res2, sign, frac_bits=frac_bits, row_scale=row_scale,
                                dot_dtype=dot_dtype)
    return stream, stats, z


class FusedSwiGLUCouple(torch.autograd.Function):
    @staticmethod
    def forward(ctx, res, x, norm_weight, w_gate, w_up, w_down, row_scale, sign, frac_bits, eps, dot_dtype):
        dim = x.shape[-1]
        x2 = _rows(x, dim)
        stream, (mean, rstd), z = _swiglu_forward(_rows(res, dim), x2, sign, frac_bits, norm_weight, w_gate, w_up,
                                                  w_down, eps, row_scale, dot_dtype, True)
        ctx.save_for_backward(x2, mean, rstd, z, norm_weight, w_gate, w_up, w_down, row_scale)
        ctx.options = (sign, frac_bits, dot_dtype)
        ctx.x_shape = x.shape
        return function_outputs(ctx, stream.view(res.shape), frac_bits)

    @staticmethod
    def backward(ctx, *grads):
        x2, mean, rstd, z, norm_weight, w_gate, w_up, w_down, row_scale = ctx.saved_tensors
        sign, frac_bits, dot_dtype = ctx.options
        g = grads[0] if frac_bits is None else grads[1]
        dim, hidden = x2.shape[1], w_gate.shape[0]
        grad_res = g if (frac_bits is None and ctx.needs_input_grad[0]) else None
        g2 = g.reshape(-1, dim).contiguous()
        need = ctx.needs_input_grad
        dz = gemm.linear_act_bwd(g2, w_down.to(dot_dtype), z, activation="swiglu", alpha=sign, row_scale=row_scale,
                                 dot_dtype=dot_dtype)
        d_down = d_gate = d_up = dx = dgamma = None
        if need[5]:
            d_down, _ = gemm.linear_weight_grad(g2, z, grad_scale=row_scale, alpha=sign, inp_activation="swiglu",
                                                dot_dtype=dot_dtype, out_dtype=w_down.dtype)
        if need[3] or need[4]:
            # [d gate | d up].T @ rmsnorm(x): both weight gradients in one pass.
            d_gate_up, _ = gemm.linear_weight_grad(dz, x2, norm="rms", stats=(mean, rstd), norm_weight=norm_weight,
                                                   dot_dtype=dot_dtype, out_dtype=w_gate.dtype)
            d_gate, d_up = d_gate_up[:hidden], d_gate_up[hidden:]
        if need[1] or need[2]:
            dn = gemm.linear_input_grad(dz, w_gate.to(dot_dtype), weight2=w_up.to(dot_dtype), dot_dtype=dot_dtype)
            dx, dgamma, _ = gemm.norm_bwd(dn, x2, (mean, rstd), norm_weight, norm="rms", has_bias=False)
            dx = dx.view(ctx.x_shape)
        return grad_res, dx, dgamma, d_gate, d_up, d_down, None, None, None, None, None


def fused_swiglu_mlp_couple(res, x, sign, frac_bits, norm_weight, w_gate, w_up, w_down, *, eps=1e-6,
                            row_scale=None):
    """``res + sign * down(silu(gate(n)) * up(n))``, n = rmsnorm(x), as ``(stream, port)``, fused."""
    dim = w_gate.shape[1]
    _check_common(res, x, sign, frac_bits, dim)
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up shape {tuple(w_up.shape)} != w_gate shape {tuple(w_gate.shape)}")
    if w_down.shape != (dim, w_gate.shape[0]):
        raise ValueError(f"w_down shape {tuple(w_down.shape)} must be {(dim, w_gate.shape[0])}")
    dot_dtype = _dot_dtype(x, [("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)])
    rs = _flat_row_scale(row_scale, x)
    params = (norm_weight, w_gate, w_up, w_down)
    if _needs_grad(res, x, *params):
        out = FusedSwiGLUCouple.apply(res, x, *params, rs, sign, frac_bits, eps, dot_dtype)
        return couple_result(out, frac_bits)
    with torch.no_grad():
        stream, _, _ = _swiglu_forward(_rows(res, dim), _rows(x, dim), sign, frac_bits, *params, eps, rs, dot_dtype,
                                       False)
    return stream.view(res.shape), None
