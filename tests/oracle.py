"""An exact-mode oracle written from the README alone: it imports nothing from revtriton.

What it implements (README, "Exact streams" and "Limits and rules"):

* a stream is an integer X, its value X * 2**-k; here X is held in int64 and any |X| >= 2**29
  is reported as an overflow (the streams hold |value| < 2**(29 - k));
* a half's float output h is put on the grid as round(h * 2**k), ties to even (its own rounding,
  in float64 where h * 2**k is exact for fp16 / bf16 / fp32 / fp64 outputs);
* halves see the stream's value in the dtype the stack is given (bf16, fp16, fp32 or fp64);
* the streams' gradients are carried in fp32 (fp64 for an fp64 model) and pass straight
  through the rounding;
* duplicate streams: both streams start as the input, the output is their mean.

Gradients come from plain autograd of this rounded model with every activation stored. The
straight-through step is ``exact + (carrier - carrier.detach())``: its value is ``exact``
bitwise and its gradient is the identity. A half's input gradient is summed inside the half
before the stream's own gradient joins it (an identity node in between), the summation order a
reversible backward has; with that the gradients are bitwise the engine's.
"""
from __future__ import annotations

import torch

LIMIT_BITS = 29


class OracleOverflow(Exception):
    """The rounded model leaves the int32 streams' range: ``where`` = (layer, "input" | "F" | "G")."""

    def __init__(self, where):
        super().__init__(where)
        self.where = where


def round_half_even(v: torch.Tensor) -> torch.Tensor:
    """Nearest integer, ties to even, of a float64 tensor (floor and a tie test; no torch.round)."""
    assert v.dtype == torch.float64
    r = torch.floor(v)
    frac = v - r  # exact in float64 for |v| < 2**52
    odd = torch.remainder(r, 2.0) == 1.0
    return r + ((frac > 0.5) | ((frac == 0.5) & odd)).to(torch.float64)


def grid_integers(h: torch.Tensor, frac_bits: int, where) -> torch.Tensor:
    """round(h * 2**k) as int64; raises OracleOverflow for non-finite h or |X| >= 2**29."""
    v = h.detach().to(torch.float64) * float(2**frac_bits)
    if not torch.isfinite(v).all():
        raise OracleOverflow(where)
    q = round_half_even(v)
    if q.abs().max().item() >= 2**LIMIT_BITS:
        raise OracleOverflow(where)
    return q.to(torch.int64)


def grad_dtype_of(model_dtype: torch.dtype) -> torch.dtype:
    """README: gradients are carried in fp32 (fp64 for an fp64 model)."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def stream_value(x_int: torch.Tensor, frac_bits: int, dtype: torch.dtype) -> torch.Tensor:
    """X * 2**-k in ``dtype``. Only used with |X| < 2**24, where every route to ``dtype`` agrees."""
    if dtype != torch.float64:
        assert x_int.abs().max().item() < 2**24, "oracle: keep test streams below 2**24 grid steps"
    return (x_int.to(torch.float64) * 2.0**-frac_bits).to(dtype)


def _straight_through(x_int, carrier, frac_bits):
    exact = stream_value(x_int, frac_bits, carrier.dtype)
    return exact + (carrier - carrier.detach())


def _half_input(v, dtype):
    x = v.to(dtype)
    return x.view_as(x) if x is v else x  # an identity node: the half's input grads are summed first


def check_range(x_int, where):
    if x_int.abs().max().item() >= 2**LIMIT_BITS:
        raise OracleOverflow(where)


def rounded_streams(halves, x1, x2, frac_bits=16):
    """Stored-activation forward of the rounded model on two float streams of the model dtype.

    ``halves``: [(F, G), ...] plain callables. Returns ``(v1, v2, X1, X2)``: the float values
    (model dtype, differentiable) and the int64 integer streams.
    """
    dtype = x1.dtype
    gdt = grad_dtype_of(dtype)
    s1 = grid_integers(x1, frac_bits, (0, "input"))
    s2 = grid_integers(x2, frac_bits, (0, "input"))
    v1 = _straight_through(s1, x1.to(gdt), frac_bits)
    v2 = _straight_through(s2, x2.to(gdt), frac_bits)
    for i, (f, g) in enumerate(halves):
        h = f(_half_input(v2, dtype))
        s1 = s1 + grid_integers(h, frac_bits, (i, "F"))
        check_range(s1, (i, "F"))
        v1 = _straight_through(s1, v1 + h.to(gdt), frac_bits)
        h = g(_half_input(v1, dtype))
        s2 = s2 + grid_integers(h, frac_bits, (i, "G"))
        check_range(s2, (i, "G"))
        v2 = _straight_through(s2, v2 + h.to(gdt), frac_bits)
    return v1.to(dtype), v2.to(dtype), s1, s2


def rounded_output(halves, x, frac_bits=16):
    """The stack's output for duplicate streams: the mean of the two final streams' values."""
    v1, v2, _, _ = rounded_streams(halves, x, x, frac_bits)
    return (v1 + v2) * 0.5


def integer_streams(halves, s1, s2, frac_bits, dtype):
    """Forward on integer streams (int32 in, int64 out), no grad: what ``forward_streams`` computes
    when given int32 streams (halves see values in the parameters' ``dtype``)."""
    s1, s2 = s1.to(torch.int64), s2.to(torch.int64)
    with torch.no_grad():
        for i, (f, g) in enumerate(halves):
            s1 = s1 + grid_integers(f(stream_value(s2, frac_bits, dtype)), frac_bits, (i, "F"))
            check_range(s1, (i, "F"))
            s2 = s2 + grid_integers(g(stream_value(s1, frac_bits, dtype)), frac_bits, (i, "G"))
            check_range(s2, (i, "G"))
    return s1, s2


def first_overflow(halves, x, frac_bits=16):
    """Where the rounded model first leaves the streams' range for input ``x``, or None."""
    try:
        with torch.no_grad():
            rounded_streams(halves, x, x, frac_bits)
    except OracleOverflow as overflow:
        return overflow.where
    return None
