"""The block protocol: a reversible block is any module offering ``coupling_halves() -> (F, G)``;
an invertible layer maps the two streams with an exact ``inverse``. Both are duck-typed (revify's
blocks are the host library's own classes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..halves.base import as_half, half_output
from ..ops.streams import ResidualScale, check_scale
from .fsdp import block_phase


@dataclass(frozen=True)
class Coupling:
    """How a block couples its streams: ``y1 = scale1 * x1 + F(x2)``, ``y2 = scale2 * x2 + G(y1)``,
    and with ``swap`` the block outputs ``(y2, y1)``.

    Scales below 1 make a pretrained layer one half of a block without changing its function much
    (MEFT, Liao et al. 2023; see revtriton.convert's ``preserve``); the inverse divides by them, so
    float streams amplify their rounding error by 1 / scale per block, while exact streams (which
    need scales 2**-s) keep the s bits the shift drops and stay bitwise at any depth.
    """

    scale1: float = 1.0
    scale2: float = 1.0
    swap: bool = False

    @property
    def scaled(self) -> bool:
        return self.scale1 != 1.0 or self.scale2 != 1.0

    def check(self, exact: bool, where: str) -> Coupling:
        try:
            check_scale(self.scale1, exact)
            check_scale(self.scale2, exact)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        if not isinstance(self.swap, bool):
            raise TypeError(f"{where}: swap must be a bool, got {self.swap!r}")
        return self


PLAIN_COUPLING = Coupling()


def coupling_of(layer) -> Coupling:
    """A block's :class:`Coupling` (its ``coupling`` attribute; the plain additive one if it has none)."""
    coupling = getattr(layer, "coupling", None)
    if coupling is None:
        return PLAIN_COUPLING
    if not isinstance(coupling, Coupling):
        raise TypeError(f"{type(layer).__name__}.coupling must be a revtriton Coupling, got {type(coupling).__name__}")
    return coupling


def residual_scale(scale: float, low_bits=None) -> ResidualScale | None:
    """The ResidualScale handed to a half for a coupling scale; None for 1 (the plain add)."""
    return None if scale == 1.0 else ResidualScale(scale, low_bits)


class ReversibleBlock(nn.Module):
    """A reversible block of two coupling halves F and G (any ``[..., d] -> [..., d]`` modules).

    A half whose ``forward`` has a ``cond`` parameter (``forward(self, x, cond)``) gets the stack's
    conditioning (``stack(x, cond=c)``): a timestep or class embedding, the adaLN / DiT pattern.

    ``scale1`` / ``scale2`` / ``swap`` make it a scaled coupling (see :class:`Coupling`):
    ``y1 = scale1 * x1 + F(x2)``, ``y2 = scale2 * x2 + G(y1)``, outputs ``(y2, y1)`` when swapped.
    """

    def __init__(self, f: nn.Module, g: nn.Module, *, scale1: float = 1.0, scale2: float = 1.0,
                 swap: bool = False):
        super().__init__()
        self.f = f
        self.g = g
        self.coupling = Coupling(float(scale1), float(scale2), swap).check(exact=False, where="ReversibleBlock")

    def __setattr__(self, name, value):
        if name in ("f", "g") and isinstance(value, nn.Module):  # at construction and when a half is swapped
            value = as_half(value)
        super().__setattr__(name, value)

    def coupling_halves(self):
        modules = self._modules  # (read directly: nn.Module.__getattr__ costs about half a microsecond a half)
        return modules["f"], modules["g"]

    def reversible_phase(self, work, *tensors):
        """One use of the halves by the stack, as one hookable call (see :func:`run_block_phase`)."""
        return block_phase(self, work, *tensors)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, cond=None):
        """Plain autograd forward on float streams (stores activations); the stack does not use it."""
        return coupled_forward(self, x1, x2, cond)

    def extra_repr(self) -> str:
        c = self.coupling
        return "" if c == PLAIN_COUPLING else f"scale1={c.scale1}, scale2={c.scale2}, swap={c.swap}"


def coupled_forward(block, x1: torch.Tensor, x2: torch.Tensor, cond=None):
    """A block's coupling with plain autograd on float streams (stored activations)."""
    f, g = block.coupling_halves()
    c = coupling_of(block)
    y1 = (x1 if c.scale1 == 1.0 else c.scale1 * x1) + half_output(f, x2, cond)
    y2 = (x2 if c.scale2 == 1.0 else c.scale2 * x2) + half_output(g, y1, cond)
    return (y2, y1) if c.swap else (y1, y2)


def is_reversible_block(layer) -> bool:
    """A block is any module offering ``coupling_halves() -> (F, G)`` (duck-typed for revify)."""
    return callable(getattr(layer, "coupling_halves", None))


def is_invertible_layer(layer) -> bool:
    """A module mapping the two streams with an exact ``inverse(y1, y2) -> (x1, x2)``."""
    return not is_reversible_block(layer) and callable(getattr(layer, "inverse", None))
