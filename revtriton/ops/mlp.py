"""norm + MLP coupling half: pure-torch references and the dispatching couple.

``norm_mlp_couple`` / ``swiglu_mlp_couple`` go through the one dispatch point
(``dispatch.run_op``), which picks one of the candidates registered below (``ops.backend``):
``triton`` (the fused kernels of ops/fused_mlp.py) or ``torch`` (the reference: cuBLAS GEMMs via
F.linear, the exact epilogue in torch ops). On CPU: the reference, or Triton under
``force_triton`` with the interpreter.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend
from .dispatch import run_op, use_triton
from .streams import couple_output

ACTIVATIONS = ("gelu_tanh", "gelu", "relu")
NORMS = ("layer", "rms")


def normalize_reference(x, weight, bias, *, norm: str, eps: float):
    """LayerNorm or RMSNorm over the last dim, statistics in fp32 (fp64 for fp64 input), result in x's dtype."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    xf = x.double() if x.dtype == torch.float64 else x.float()  # stats in fp32 at least
    if norm == "layer":
        xf = xf - xf.mean(-1, keepdim=True)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype) if weight is None else (y * weight.to(xf.dtype)).to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def activation_reference(h, activation: str):
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "gelu":
        return F.gelu(h)
    if activation == "relu":
        return F.relu(h)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _scale_rows(h, row_scale):
    # row_scale: one factor per token row (drop-path's mask / keep probability), shape h.shape[:-1].
    return h if row_scale is None else h * row_scale.unsqueeze(-1).to(h.dtype)


def norm_mlp_reference(x, norm_weight, norm_bias, w1, b1, w2, b2, *, norm="layer", activation="gelu_tanh",
                       eps=1e-6, row_scale=None):
    """H(x) = fc2(act(fc1(norm(x)))) (optionally times a per-row scale)."""
    n = normalize_reference(x, norm_weight, norm_bias, norm=norm, eps=eps)
    h = activation_reference(F.linear(n, w1, b1), activation)
    return _scale_rows(F.linear(h, w2, b2), row_scale)


def swiglu_mlp_reference(x, norm_weight, w_gate, w_up, w_down, *, eps=1e-6, row_scale=None):
    """H(x) = down(silu(gate(n)) * up(n)) with n = rmsnorm(x) (LLaMA's MLP)."""
    n = normalize_reference(x, norm_weight, None, norm="rms", eps=eps)
    return _scale_rows(F.linear(F.silu(F.linear(n, w_gate)) * F.linear(n, w_up), w_down), row_scale)


def norm_mlp_couple(res, x, sign, frac_bits, norm_weight, norm_bias, w1, b1, w2, b2, *, norm="layer",
                    activation="gelu_tanh", eps=1e-6, row_scale=None):
    """``res + sign * norm_mlp(x)`` as ``(stream, port)`` (see revtriton.halves.base)."""
    return run_op("norm_mlp", res, x, sign, frac_bits, norm_weight, norm_bias, w1, b1, w2, b2, norm=norm,
                  activation=activation, eps=eps, row_scale=row_scale)


def swiglu_mlp_couple(res, x, sign, frac_bits, norm_weight, w_gate, w_up, w_down, *, eps=1e-6, row_scale=None):
    """``res + sign * swiglu_mlp(x)`` as ``(stream, port)``."""
    return run_op("swiglu_mlp", res, x, sign, frac_bits, norm_weight, w_gate, w_up, w_down, eps=eps,
                  row_scale=row_scale)


# ---------------------------------------------------------------- the candidates (ops.backend)

def triton_runs_on(args, options) -> bool:
    """The fused kernels run on CUDA tensors, and on CPU tensors under force_triton (interpreter)."""
    return use_triton(args[1])


def triton_dtypes(args, options) -> bool:
    return args[1].dtype in (torch.float16, torch.bfloat16, torch.float32)


def _norm_mlp_triton(res, x, sign, frac_bits, *weights, **options):
    from .fused_mlp import fused_norm_mlp_couple

    return fused_norm_mlp_couple(res, x, sign, frac_bits, *weights, **options)


def _norm_mlp_torch(res, x, sign, frac_bits, *weights, **options):
    return couple_output(res, norm_mlp_reference(x, *weights, **options), sign, frac_bits)


def _swiglu_mlp_triton(res, x, sign, frac_bits, *weights, **options):
    from .fused_mlp import fused_swiglu_mlp_couple

    return fused_swiglu_mlp_couple(res, x, sign, frac_bits, *weights, **options)


def _swiglu_mlp_torch(res, x, sign, frac_bits, *weights, **options):
    return couple_output(res, swiglu_mlp_reference(x, *weights, **options), sign, frac_bits)


for _op, _triton, _torch in (("norm_mlp", _norm_mlp_triton, _norm_mlp_torch),
                             ("swiglu_mlp", _swiglu_mlp_triton, _swiglu_mlp_torch)):
    backend.register_op(_op, backend.couple_key)
    backend.register_candidate(_op, "triton", _triton, available=triton_runs_on, supports=triton_dtypes)
    backend.register_candidate(_op, "torch", _torch)
