"""The coupling-half protocol (DESIGN.md section 3) and the generic half.

Every half H offers one differentiable operation::

    couple(res, x, sign, frac_bits=None) -> (stream, port)

``stream = res + sign * H(x)``; sign is +1 in the forward and -1 in the inverse. A scaled
coupling (``ReversibleBlock(f, g, scale1=..., scale2=...)``) passes ``scale=ResidualScale`` to
halves whose ``takes_scale`` is true (``scale * res + H(x)`` forward, ``(res - H(x)) / scale``
inverse); for other halves the engine applies it around their ``couple``.

* float streams (``frac_bits=None``): ``res`` and ``stream`` are float tensors and ``port`` is
  ``stream`` itself when it requires grad.
* exact streams (``frac_bits=k``): ``res`` and ``stream`` are int32 fixed point
  (value = X * 2**-k); ``x`` is the float value of the other stream. ``H(x)`` is rounded to the
  grid and added as an integer (see ``revtriton.ops.streams``); ``port`` is the float tensor
  through which the straight-through gradient w.r.t. the stream's value enters.

``port`` is None when nothing requires grad. The engine calls ``torch.autograd.backward(port,
grad)`` with the gradient w.r.t. the stream's value.

Conditioning (a timestep or class embedding, the adaLN / DiT pattern): ``stack(x, cond=c)`` hands
``c`` to every half that *takes* conditioning, i.e. whose ``forward`` has a parameter named
``cond``; the engine calls its ``couple(res, x, sign, frac_bits, cond=c)``, which computes
``H(x, cond=c)``. Halves without one (the fused transformer halves) are called as before.
``c`` is an input of the stack's autograd node, so its gradient is the sum of every half's.
"""
from __future__ import annotations

import functools
import inspect
import warnings

import torch
from torch import nn

from ..ops.streams import ResidualScale, couple_output


@functools.lru_cache(maxsize=None)
def _has_cond_parameter(forward) -> bool:
    try:
        return "cond" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a callable without a readable signature
        return False


def takes_cond(half) -> bool:
    """Whether a half takes the stack's conditioning (duck-typed halves without the attribute do not)."""
    return bool(getattr(half, "takes_cond", False))


@functools.lru_cache(maxsize=None)
def _has_scale_parameter(couple) -> bool:
    try:
        return "scale" in inspect.signature(couple).parameters
    except (TypeError, ValueError):
        return False


def takes_scale(half) -> bool:
    """Whether a half applies a coupling scale itself (in its couple epilogue): its ``couple`` has a
    ``scale`` parameter, or it says so with a ``takes_scale`` attribute."""
    flag = getattr(half, "takes_scale", None)
    if flag is not None:
        return bool(flag)
    return _has_scale_parameter(getattr(type(half), "couple", None))


def parameter(module: nn.Module, name: str):
    """``module.<name>`` (None where it has none): read from the module's parameter dict when it is
    there, since ``nn.Module.__getattr__`` costs about a microsecond a read and a couple reads six to
    eight; through getattr otherwise (a parametrization's property, a wrapper that forwards it)."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


def couple_half(half, res: torch.Tensor, x: torch.Tensor, sign: int, frac_bits: int | None, cond=None,
                scale: ResidualScale | None = None):
    """``half.couple(res, x, sign, frac_bits)``, handing ``cond`` to a half that takes it.

    ``scale`` (a scaled coupling): ``scale * res + H(x)`` forward, ``(res - H(x)) / scale`` inverse.
    A half with ``takes_scale`` applies it in its own epilogue; for any other half it is applied
    around the plain couple (one more elementwise pass), with the same result and port."""
    options = {"cond": cond} if cond is not None and takes_cond(half) else {}
    if scale is None:
        return half.couple(res, x, sign, frac_bits, **options)
    if takes_scale(half):
        return half.couple(res, x, sign, frac_bits, scale=scale, **options)
    if sign > 0:
        return half.couple(scale.apply(res, frac_bits), x, sign, frac_bits, **options)
    stream, port = half.couple(res, x, sign, frac_bits, **options)
    return scale.undo(stream.detach(), frac_bits), port


def half_part_output(half, part: int, parts: int, x: torch.Tensor, cond=None) -> torch.Tensor:
    """``H_part(x)`` with plain autograd, for a half that is the sum of ``parts`` parts (its
    ``head_parts(wanted, like, cond)`` said so; the attention halves' head groups: engine.rows), with ``cond``
    for a half that takes it."""
    options = {"cond": cond} if cond is not None and takes_cond(half) else {}
    return half.part_output(part, parts, x, **options)


def half_output(half, x: torch.Tensor, cond=None) -> torch.Tensor:
    """H(x) with plain autograd (stored-activation twins), with ``cond`` for a half that takes it."""
    return half(x, cond=cond) if cond is not None and takes_cond(half) else half(x)


def transition_takes_cond(layer) -> bool:
    """Whether a stage transition (any module of a stack that is not a block) takes the conditioning:
    its ``forward`` has a ``cond`` parameter."""
    return _has_cond_parameter(getattr(type(layer), "forward", None))


def transition_output(layer, x: torch.Tensor, cond=None) -> torch.Tensor:
    """A stage transition's output, with ``cond`` for one that takes it."""
    return layer(x, cond=cond) if cond is not None and transition_takes_cond(layer) else layer(x)


class OpHalf:
    """A half computed by one couple op of ``revtriton.ops``: ``couple_op`` (a class attribute, the
    function, called as ``couple_op(res, x, sign, frac_bits, *weights, **options)``) over
    ``operands(x)``, its (positional weights, keyword options) for input ``x``. The transformer
    halves (halves.transformer: modules owning their weights) and revify's halves over a block's
    own weights (revtriton.convert.core) are both."""

    couple_op = None

    def operands(self, x) -> tuple:
        raise NotImplementedError


class CouplingHalf(nn.Module):
    """Base class of halves: ``forward(x)`` (or ``forward(x, cond)``) is H(x); ``couple`` adds or subtracts it."""

    @property
    def takes_cond(self) -> bool:
        """True when ``forward`` has a ``cond`` parameter (see the module doc)."""
        return _has_cond_parameter(type(self).forward)

    def couple(self, res: torch.Tensor, x: torch.Tensor, sign: int, frac_bits: int | None = None, cond=None,
               scale: ResidualScale | None = None):
        return couple_output(res, self(x) if cond is None else self(x, cond=cond), sign, frac_bits, scale)


class GenericHalf(CouplingHalf):
    """Any ``nn.Module`` mapping ``[..., d] -> [..., d]`` as a coupling half (torch ops only)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        if not callable(module):
            raise TypeError(f"a coupling half must be a callable nn.Module, got {type(module).__name__}")
        self.module = module

    @property
    def takes_cond(self) -> bool:
        return _has_cond_parameter(getattr(type(self.module), "forward", None))

    def forward(self, x: torch.Tensor, cond=None) -> torch.Tensor:
        module = self._modules["module"]  # (read directly: nn.Module.__getattr__ costs about half a microsecond)
        return module(x) if cond is None else module(x, cond=cond)


def as_half(module) -> CouplingHalf:
    """Return ``module`` if it already is a coupling half, else wrap it in :class:`GenericHalf`."""
    if isinstance(getattr(module, "_orig_mod", None), CouplingHalf):
        warnings.warn(f"revtriton: a half given as torch.compile({type(module._orig_mod).__name__}(...)): the "
                      f"wrapper hands the engine the half's own couple(), which runs uncompiled; compile the "
                      f"half in place instead (half.compile(), README \"torch.compile\")", UserWarning, stacklevel=3)
    if hasattr(module, "couple"):
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"a coupling half must be an nn.Module, got {type(module).__name__}")
    return GenericHalf(module)
