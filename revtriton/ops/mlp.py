"""norm + MLP coupling half: the dispatching couple (references: ops/reference.py).

``norm_mlp_couple`` / ``swiglu_mlp_couple`` go through the one dispatch point
(``dispatch.run_op``), which picks one of the candidates registered below (``ops.backend``):
``triton`` (the fused kernels of ops/fused_mlp.py) or ``torch`` (the reference: cuBLAS GEMMs via
F.linear, the exact epilogue in torch ops). On CPU: the reference, or Triton under
``force_triton`` with the interpreter.
"""
from __future__ import annotations

from . import backend
from .dispatch import kept_import, run_op, scale_option, triton_dtypes, triton_runs_on
from .reference import (ACTIVATIONS, NORMS, activation_reference, norm_mlp_reference,  # noqa: F401 (re-exported)
                        normalize_reference, swiglu_mlp_reference)
from .streams import ResidualScale, library_couple_output

def norm_mlp_couple(res, x, sign, frac_bits, norm_weight, norm_bias, w1, b1, w2, b2, *, norm="layer",
                    activation="gelu_tanh", eps=1e-6, row_scale=None, scale: ResidualScale | None = None):
    """``res + sign * norm_mlp(x)`` as ``(stream, port)`` (see revtriton.halves.base); a ``scale``
    makes it a scaled coupling (streams.couple_output), applied in the couple epilogue."""
    return run_op("norm_mlp", res, x, sign, frac_bits, norm_weight, norm_bias, w1, b1, w2, b2, norm=norm,
                  activation=activation, eps=eps, row_scale=row_scale, **scale_option(scale))


def swiglu_mlp_couple(res, x, sign, frac_bits, norm_weight, w_gate, w_up, w_down, *, eps=1e-6, row_scale=None,
                      scale: ResidualScale | None = None):
    """``res + sign * swiglu_mlp(x)`` as ``(stream, port)`` (a ``scale`` as in norm_mlp_couple)."""
    return run_op("swiglu_mlp", res, x, sign, frac_bits, norm_weight, w_gate, w_up, w_down, eps=eps,
                  row_scale=row_scale, **scale_option(scale))


# ---------------------------------------------------------------- the candidates (ops.backend)

_fused = kept_import("fused_mlp")  # its module, imported at the first fused call


def _norm_mlp_triton(res, x, sign, frac_bits, *weights, **options):
    return _fused().fused_norm_mlp_couple(res, x, sign, frac_bits, *weights, **options)


def _norm_mlp_torch(res, x, sign, frac_bits, *weights, scale=None, **options):
    return library_couple_output(res, norm_mlp_reference(x, *weights, **options), sign, frac_bits, scale)


def _swiglu_mlp_triton(res, x, sign, frac_bits, *weights, **options):
    return _fused().fused_swiglu_mlp_couple(res, x, sign, frac_bits, *weights, **options)


def _swiglu_mlp_torch(res, x, sign, frac_bits, *weights, scale=None, **options):
    return library_couple_output(res, swiglu_mlp_reference(x, *weights, **options), sign, frac_bits, scale)


def _norm_mlp_triton_bind(args, options, call_key):
    return _fused().bind_norm_mlp_couple(args, options, call_key)


def _swiglu_mlp_triton_bind(args, options, call_key):
    return _fused().bind_swiglu_mlp_couple(args, options, call_key)


for _op, _triton, _bind, _torch in (("norm_mlp", _norm_mlp_triton, _norm_mlp_triton_bind, _norm_mlp_torch),
                                    ("swiglu_mlp", _swiglu_mlp_triton, _swiglu_mlp_triton_bind, _swiglu_mlp_torch)):
    backend.register_op(_op, backend.couple_key)
    backend.register_candidate(_op, "triton", _triton, available=triton_runs_on, supports=triton_dtypes, planned=True,
                               bind=_bind)
    backend.register_candidate(_op, "torch", _torch)
