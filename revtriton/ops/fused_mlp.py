"""The fused norm+MLP coupling half: autograd Functions over the kernels of ops/gemm.py.

Forward couple (3 launches): normalize (the norm once per row, written in the GEMM operand
dtype) -> GEMM1 (raw operands; bias + activation, or SwiGLU gate * up, in the epilogue) ->
GEMM2 (bias, row scale, residual +/- float or exact epilogue). With grad enabled GEMM1 also
stores its pre-activation (a runtime flag of the same compiled kernel, so the forward and the
recompute share a config and agree bitwise) and the normalized rows and activations are kept.

Backward (7 launches): the output gradient scaled and cast once (bias-gradient partials in
the same pass); dH GEMM with the activation derivative (and the other bias gradient's partials)
in its epilogue; the two weight gradients as raw GEMMs over the kept normalized rows and
activations (split-K when the output cannot fill the GPU); the input-gradient GEMM; the norm
backward with per-program dgamma/dbeta partials; one launch reducing every partial sum. No
atomics anywhere.

Semantics are those of the references in ops/mlp.py (norm_mlp_reference, swiglu_mlp_reference)
and of the couple protocol (ops/streams.py): float mode returns ``(stream, stream or None)``,
exact mode ``(int32 stream, gradient port or None)``. A scaled coupling (``scale``, a
streams.ResidualScale) is applied in GEMM2's epilogue and returns a port in float mode too, whose
gradient goes to ``sign * H(x)`` unscaled (streams.function_outputs).
"""
from __future__ import annotations

import torch

from . import gemm, norm_rows
from .launches import LaunchPlan, PlanCache, plan_key
from .reference import ACTIVATIONS, NORMS
from .streams import (ResidualScale, check_frac_bits, check_residual_scale, couple_result, function_outputs,
                      port_gradient, residual_gradient)


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


def _flat_row_scale(row_scale, x):
    if row_scale is None:
        return None
    if row_scale.shape != x.shape[:-1]:
        raise ValueError(f"row_scale shape {tuple(row_scale.shape)} must be the input's leading shape "
                         f"{tuple(x.shape[:-1])}")
    return row_scale.detach().reshape(-1).to(torch.float32).contiguous()


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# Launch plans by call signature: a repeated call skips the checks and the launch arguments'
# arithmetic of the couple and of its launchers (launches.LaunchPlan).
_plans = PlanCache()


# ---------------------------------------------------------------- LayerNorm / RMSNorm + MLP

def _norm_mlp_forward(plan, res, x, sign, frac_bits, norm_weight, norm_bias, w1, b1, w2, b2, norm, activation,
                      eps, row_scale, dot_dtype, save, scale):
    """The three launches; ``res`` and ``x`` [..., dim] go to them as they are when contiguous, else
    as [M, dim] rows (gemm.row_operand); the stream comes back in ``res``'s shape."""
    dim = x.shape[-1]
    res2, x2 = gemm.row_operand(res, dim), gemm.row_operand(x, dim)
    n, mean, rstd = plan.launch(0, lambda: norm_rows.NormalizeLaunch(
        gemm.as_rows(x2, dim), norm=norm, eps=eps, norm_weight=norm_weight, norm_bias=norm_bias,
        out_dtype=dot_dtype))(x2, norm_weight, norm_bias)
    w1, w2 = gemm.as_operand(w1, dot_dtype), gemm.as_operand(w2, dot_dtype)
    a1, z1 = plan.launch(1, lambda: gemm.LinearLaunch(n, w1, b1, activation=activation, save_preact=save))(n, w1, b1)
    stream = plan.launch(2, lambda: gemm.LinearCoupleLaunch(
        a1, w2, b2, gemm.as_rows(res2, dim), sign, frac_bits=frac_bits, row_scale=row_scale, scale=scale,
        out_shape=res.shape))(a1, w2, b2, res2, row_scale, scale)
    return stream, (n, mean, rstd, a1, z1)


def _backward_plan(ctx, grads, frac_bits, dim):
    """(the output gradient as rows, the backward's launches): kept in the forward's plan per
    gradient layout and per set of inputs that need a gradient (what the launches depend on
    beyond the forward's signature)."""
    g = gemm.as_rows(port_gradient(grads, frac_bits, ctx.res_scale), dim)
    return g, ctx.plan.launch(("backward", ctx.needs_input_grad, g.stride(), g.dtype), LaunchPlan)


def _scaled_grad(back, g, sign, row_scale, dot_dtype, bias_dtype):
    """The output gradient times sign and row_scale in the operand dtype (one launch), and the
    Partials of its column sums when the last layer has a bias to differentiate."""
    return back.launch(0, lambda: gemm.ScaleRowsLaunch(g, alpha=sign, row_scale=row_scale, out_dtype=dot_dtype,
                                                       col_sums=bias_dtype is not None, sums_dtype=bias_dtype))(
        g, row_scale)


class FusedNormMLPCouple(torch.autograd.Function):
    @staticmethod
    def forward(ctx, res, x, norm_weight, norm_bias, w1, b1, w2, b2, row_scale, sign, frac_bits, norm, activation,
                eps, dot_dtype, scale, plan):
        dim = x.shape[-1]
        x2 = gemm.as_rows(x, dim)  # (rows: the backward's launches read them)
        stream, (n, mean, rstd, a1, z1) = _norm_mlp_forward(plan, res, x2, sign, frac_bits, norm_weight, norm_bias,
                                                            w1, b1, w2, b2, norm, activation, eps, row_scale,
                                                            dot_dtype, True, scale)
        ctx.save_for_backward(x2, mean, rstd, n, a1, z1, norm_weight, norm_bias, w1, w2, row_scale)
        ctx.plan = plan  # the backward's launches are kept in it too
        ctx.options = (sign, frac_bits, norm, activation, dot_dtype)
        ctx.res_scale = None if scale is None else scale.value  # not the dropped bits
        ctx.bias_dtypes = (None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
        ctx.x_shape = x.shape
        return function_outputs(ctx, stream, frac_bits, scaled=scale is not None)

    @staticmethod
    def backward(ctx, *grads):
        """Seven launches: scale g, dH (activation derivative and db1 partials in the epilogue),
        dW2, dW1, dN, the norm backward (dgamma / dbeta partials), one reduction of all partials."""
        x2, mean, rstd, n, a1, z1, norm_weight, norm_bias, w1, w2, row_scale = ctx.saved_tensors
        sign, frac_bits, norm, activation, dot_dtype = ctx.options
        need = ctx.needs_input_grad
        b1_dtype, b2_dtype = ctx.bias_dtypes
        dim = x2.shape[1]
        grad_res = residual_gradient(grads, frac_bits, sign, ctx.res_scale) if need[0] else None
        g, back = _backward_plan(ctx, grads, frac_bits, dim)
        gs, db2 = _scaled_grad(back, g, sign, row_scale, dot_dtype, b2_dtype if need[7] else None)
        w1_dtype, w2_dtype = w1.dtype, w2.dtype
        w1, w2 = gemm.as_operand(w1, dot_dtype), gemm.as_operand(w2, dot_dtype)
        dz1, db1 = back.launch(1, lambda: gemm.LinearActBwdLaunch(
            gs, w2, z1, activation=activation, col_sums=b1_dtype is not None and need[5], sums_dtype=b1_dtype))(
            gs, w2, z1)
        pending = []
        dw2 = dw1 = dx = norm_part = None
        if need[6]:
            dw2 = back.launch(2, lambda: gemm.LinearWeightGradLaunch(gs, a1, out_dtype=w2_dtype))(gs, a1, pending)
        if need[4]:
            dw1 = back.launch(3, lambda: gemm.LinearWeightGradLaunch(dz1, n, out_dtype=w1_dtype))(dz1, n, pending)
        if need[1] or need[2] or need[3]:
            dn = back.launch(4, lambda: gemm.LinearInputGradLaunch(dz1, w1))(dz1, w1)
            dx, norm_part = back.launch(5, lambda: norm_rows.NormBwdLaunch(
                dn, x2, (mean, rstd), norm_weight, norm=norm, has_bias=norm_bias is not None))(
                dn, x2, (mean, rstd), norm_weight)
            dx = dx.view(ctx.x_shape)
        gemm.reduce_partials(db2, db1, norm_part, *pending)
        dgamma, dbeta = norm_rows.norm_param_grads(norm_part, norm_weight, norm_bias is not None)
        if dbeta is not None and dbeta.dtype != norm_bias.dtype:
            dbeta = dbeta.to(norm_bias.dtype)
        return (grad_res, dx, dgamma, dbeta, dw1, None if db1 is None else db1.out, dw2,
                None if db2 is None else db2.out, None, None, None, None, None, None, None, None, None)


def fused_norm_mlp_couple(res, x, sign, frac_bits, norm_weight, norm_bias, w1, b1, w2, b2, *, norm="layer",
                          activation="gelu_tanh", eps=1e-6, row_scale=None, scale: ResidualScale | None = None,
                          call_key=None):
    """``res + sign * fc2(act(fc1(norm(x))))`` (times row_scale) as ``(stream, port)``, fused; a
    ``scale``: ``scale * res + H(x)`` forward, ``(res - H(x)) / scale`` inverse (streams.couple_output).
    ``call_key``: this call's signature when the dispatch has it (``dispatch.run_op``), so the
    launch plan's key is not worked out twice."""
    params = (norm_weight, norm_bias, w1, b1, w2, b2)
    needs_grad = _needs_grad(res, x, *params)
    key = (call_key, needs_grad) if call_key is not None else plan_key(
        "norm_mlp", scale, res, x, needs_grad, sign, frac_bits, *params, norm, activation, eps, row_scale)
    plan = _plans.get(key)
    if plan is None:  # the checks (a later call of this signature would pass them too)
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
        scale = check_residual_scale(scale, sign, frac_bits, res)
        plan = LaunchPlan(_dot_dtype(x, [("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)]))
    dot_dtype = plan.options
    rs = _flat_row_scale(row_scale, x)
    if needs_grad:
        out = FusedNormMLPCouple.apply(res, x, *params, rs, sign, frac_bits, norm, activation, eps, dot_dtype, scale,
                                       plan)
        _plans.keep(key, plan)
        return couple_result(out, frac_bits, scaled=scale is not None)
    with torch.no_grad():
        stream, _ = _norm_mlp_forward(plan, res, x, sign, frac_bits, *params, norm, activation, eps, rs, dot_dtype,
                                      False, scale)
    _plans.keep(key, plan)
    return stream, None


def _kept_plan(args, options, call_key, option_names) -> tuple:
    """(whether the call needs grad, the plan its signature's call kept): what the bound runners of
    the MLP couples close over; plan None where nothing is to be bound (no plan kept, a row scale, or
    options other than the couple's own)."""
    if call_key is None or options.get("row_scale") is not None or set(options) != option_names:
        return False, None
    needs_grad = _needs_grad(*args[:2], *args[4:])
    return needs_grad, _plans.get((call_key, needs_grad))


def bind_norm_mlp_couple(args, options, call_key):
    """A runner ``(res, x, *weights)`` of later calls of this call's signature (ops.dispatch.bind_op):
    the plan this signature's call kept, the options fixed; no checks (the signature passed them),
    no key, no plan lookup. None without a kept plan or with a row scale (each call's)."""
    res, x, sign, frac_bits, *params = args
    needs_grad, plan = _kept_plan(args, options, call_key, {"norm", "activation", "eps", "row_scale"})
    if plan is None:
        return None
    norm, activation, eps = options["norm"], options["activation"], options["eps"]
    dot_dtype = plan.options
    if needs_grad:
        def run(res, x, *params):
            out = FusedNormMLPCouple.apply(res, x, *params, None, sign, frac_bits, norm, activation, eps, dot_dtype,
                                           None, plan)
            return couple_result(out, frac_bits, scaled=False)
    else:
        def run(res, x, *params):  # nothing requires grad: no graph is recorded, grad mode or not
            stream, _ = _norm_mlp_forward(plan, res, x, sign, frac_bits, *params, norm, activation, eps, None,
                                          dot_dtype, False, None)
            return stream, None
    return run


# ---------------------------------------------------------------- RMSNorm + SwiGLU

def _swiglu_forward(plan, res, x, sign, frac_bits, norm_weight, w_gate, w_up, w_down, eps, row_scale, dot_dtype,
                    save, scale):
    """As :func:`_norm_mlp_forward` (``res`` and ``x`` as they are when contiguous, the stream in
    ``res``'s shape)."""
    dim = x.shape[-1]
    res2, x2 = gemm.row_operand(res, dim), gemm.row_operand(x, dim)
    n, mean, rstd = plan.launch(0, lambda: norm_rows.NormalizeLaunch(
        gemm.as_rows(x2, dim), norm="rms", eps=eps, norm_weight=norm_weight, out_dtype=dot_dtype))(x2, norm_weight)
    w_gate, w_up, w_down = (gemm.as_operand(w_gate, dot_dtype), gemm.as_operand(w_up, dot_dtype),
                             gemm.as_operand(w_down, dot_dtype))
    a1, z = plan.launch(1, lambda: gemm.LinearLaunch(n, w_gate, None, activation="swiglu", weight_up=w_up,
                                                     save_preact=save))(n, w_gate, None, w_up)
    stream = plan.launch(2, lambda: gemm.LinearCoupleLaunch(
        a1, w_down, None, gemm.as_rows(res2, dim), sign, frac_bits=frac_bits, row_scale=row_scale, scale=scale,
        out_shape=res.shape))(a1, w_down, None, res2, row_scale, scale)
    return stream, (n, mean, rstd, a1, z)


class FusedSwiGLUCouple(torch.autograd.Function):
    @staticmethod
    def forward(ctx, res, x, norm_weight, w_gate, w_up, w_down, row_scale, sign, frac_bits, eps, dot_dtype, scale,
                plan):
        dim = x.shape[-1]
        x2 = gemm.as_rows(x, dim)  # (rows: the backward's launches read them)
        stream, (n, mean, rstd, a1, z) = _swiglu_forward(plan, res, x2, sign, frac_bits, norm_weight, w_gate, w_up,
                                                         w_down, eps, row_scale, dot_dtype, True, scale)
        ctx.save_for_backward(x2, mean, rstd, n, a1, z, norm_weight, w_gate, w_up, w_down, row_scale)
        ctx.plan = plan  # the backward's launches are kept in it too
        ctx.options = (sign, frac_bits, dot_dtype)
        ctx.res_scale = None if scale is None else scale.value  # not the dropped bits
        ctx.x_shape = x.shape
        return function_outputs(ctx, stream, frac_bits, scaled=scale is not None)

    @staticmethod
    def backward(ctx, *grads):
        """Seven launches: scale g, d[gate | up], dW_down, d[W_gate | W_up] in one GEMM, dN (two
        K segments), the RMSNorm backward, one reduction (dgamma and any split-K partials)."""
        x2, mean, rstd, n, a1, z, norm_weight, w_gate, w_up, w_down, row_scale = ctx.saved_tensors
        sign, frac_bits, dot_dtype = ctx.options
        dim, hidden = x2.shape[1], w_gate.shape[0]
        need = ctx.needs_input_grad
        grad_res = residual_gradient(grads, frac_bits, sign, ctx.res_scale) if need[0] else None
        g, back = _backward_plan(ctx, grads, frac_bits, dim)
        gs, _ = _scaled_grad(back, g, sign, row_scale, dot_dtype, None)
        weight_dtypes = (w_gate.dtype, w_down.dtype)
        w_gate, w_up, w_down = (gemm.as_operand(w_gate, dot_dtype), gemm.as_operand(w_up, dot_dtype),
                                gemm.as_operand(w_down, dot_dtype))
        dz, _ = back.launch(1, lambda: gemm.LinearActBwdLaunch(gs, w_down, z, activation="swiglu"))(gs, w_down, z)
        pending = []
        d_down = d_gate = d_up = dx = norm_part = None
        if need[5]:
            d_down = back.launch(2, lambda: gemm.LinearWeightGradLaunch(gs, a1, out_dtype=weight_dtypes[1]))(
                gs, a1, pending)
        if need[3] or need[4]:
            # [d gate | d up].T @ rmsnorm(x): both weight gradients in one pass.
            d_gate_up = back.launch(3, lambda: gemm.LinearWeightGradLaunch(dz, n, out_dtype=weight_dtypes[0]))(
                dz, n, pending)
            d_gate, d_up = d_gate_up[:hidden], d_gate_up[hidden:]
        if need[1] or need[2]:
            dn = back.launch(4, lambda: gemm.LinearInputGradLaunch(dz, w_gate, weight2=w_up))(dz, w_gate, w_up)
            dx, norm_part = back.launch(5, lambda: norm_rows.NormBwdLaunch(
                dn, x2, (mean, rstd), norm_weight, norm="rms", has_bias=False))(dn, x2, (mean, rstd), norm_weight)
            dx = dx.view(ctx.x_shape)
        gemm.reduce_partials(norm_part, *pending)
        dgamma, _ = norm_rows.norm_param_grads(norm_part, norm_weight, False)
        return grad_res, dx, dgamma, d_gate, d_up, d_down, None, None, None, None, None, None, None


def fused_swiglu_mlp_couple(res, x, sign, frac_bits, norm_weight, w_gate, w_up, w_down, *, eps=1e-6,
                            row_scale=None, scale: ResidualScale | None = None, call_key=None):
    """``res + sign * down(silu(gate(n)) * up(n))``, n = rmsnorm(x), as ``(stream, port)``, fused
    (a ``scale`` and ``call_key`` as in :func:`fused_norm_mlp_couple`)."""
    params = (norm_weight, w_gate, w_up, w_down)
    needs_grad = _needs_grad(res, x, *params)
    key = (call_key, needs_grad) if call_key is not None else plan_key(
        "swiglu_mlp", scale, res, x, needs_grad, sign, frac_bits, *params, eps, row_scale)
    plan = _plans.get(key)
    if plan is None:  # the checks (a later call of this signature would pass them too)
        dim = w_gate.shape[1]
        _check_common(res, x, sign, frac_bits, dim)
        if w_up.shape != w_gate.shape:
            raise ValueError(f"w_up shape {tuple(w_up.shape)} != w_gate shape {tuple(w_gate.shape)}")
        if w_down.shape != (dim, w_gate.shape[0]):
            raise ValueError(f"w_down shape {tuple(w_down.shape)} must be {(dim, w_gate.shape[0])}")
        scale = check_residual_scale(scale, sign, frac_bits, res)
        plan = LaunchPlan(_dot_dtype(x, [("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)]))
    dot_dtype = plan.options
    rs = _flat_row_scale(row_scale, x)
    if needs_grad:
        out = FusedSwiGLUCouple.apply(res, x, *params, rs, sign, frac_bits, eps, dot_dtype, scale, plan)
        _plans.keep(key, plan)
        return couple_result(out, frac_bits, scaled=scale is not None)
    with torch.no_grad():
        stream, _ = _swiglu_forward(plan, res, x, sign, frac_bits, *params, eps, rs, dot_dtype, False, scale)
    _plans.keep(key, plan)
    return stream, None


def bind_swiglu_mlp_couple(args, options, call_key):
    """:func:`bind_norm_mlp_couple` for :func:`fused_swiglu_mlp_couple`."""
    res, x, sign, frac_bits, *params = args
    needs_grad, plan = _kept_plan(args, options, call_key, {"eps", "row_scale"})
    if plan is None:
        return None
    eps, dot_dtype = options["eps"], plan.options
    if needs_grad:
        def run(res, x, *params):
            out = FusedSwiGLUCouple.apply(res, x, *params, None, sign, frac_bits, eps, dot_dtype, None, plan)
            return couple_result(out, frac_bits, scaled=False)
    else:
        def run(res, x, *params):  # nothing requires grad: no graph is recorded, grad mode or not
            stream, _ = _swiglu_forward(plan, res, x, sign, frac_bits, *params, eps, None, dot_dtype, False, None)
            return stream, None
    return run
