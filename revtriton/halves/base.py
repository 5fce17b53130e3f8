"""The coupling-half protocol (DESIGN.md section 3) and the generic half.

Every half H offers one differentiable operation::

    couple(res, x, sign, frac_bits=None) -> (stream, port)

``stream = res + sign * H(x)``; sign is +1 in the forward and -1 in the inverse.

* float streams (``frac_bits=None``): ``res`` and ``stream`` are float tensors and ``port`` is
  ``stream`` itself when it requires grad.
* exact streams (``frac_bits=k``): ``res`` and ``stream`` are int32 fixed point
  (value = X * 2**-k); ``x`` is the float value of the other stream. ``H(x)`` is rounded to the
  grid and added as an integer (see ``revtriton.ops.streams``); ``port`` is the float tensor
  through which the straight-through gradient w.r.t. the stream's value enters.

``port`` is None when nothing requires grad. The engine calls ``torch.autograd.backward(port,
grad)`` with the gradient w.r.t. the stream's value.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.streams import couple_output


class CouplingHalf(nn.Module):
    """Base class of halves: ``forward(x)`` is H(x); ``couple`` adds or subtracts it."""

    def couple(self, res: torch.Tensor, x: torch.Tensor, sign: int, frac_bits: int | None = None):
        return couple_output(res, self(x), sign, frac_bits)


class GenericHalf(CouplingHalf):
    """Any ``nn.Module`` mapping ``[..., d] -> [..., d]`` as a coupling half (torch ops only)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        if not callable(module):
            raise TypeError(f"a coupling half must be a callable nn.Module, got {type(module).__name__}")
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def as_half(module) -> CouplingHalf:
    """Return ``module`` if it already is a coupling half, else wrap it in :class:`GenericHalf`."""
    if hasattr(module, "couple"):
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"a coupling half must be an nn.Module, got {type(module).__name__}")
    return GenericHalf(module)
