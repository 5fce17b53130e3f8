"""The block protocol: a reversible block is any module offering ``coupling_halves() -> (F, G)``;
an invertible layer maps the two streams with an exact ``inverse``. Both are duck-typed (revify's
blocks are the host library's own classes)."""
from __future__ import annotations

import torch
from torch import nn

from ..halves.base import as_half, half_output
from .fsdp import block_phase


class ReversibleBlock(nn.Module):
    """A reversible block of two coupling halves F and G (any ``[..., d] -> [..., d]`` modules).

    A half whose ``forward`` has a ``cond`` parameter (``forward(self, x, cond)``) gets the stack's
    conditioning (``stack(x, cond=c)``): a timestep or class embedding, the adaLN / DiT pattern.
    """

    def __init__(self, f: nn.Module, g: nn.Module):
        super().__init__()
        self.f = as_half(f)
        self.g = as_half(g)

    def coupling_halves(self):
        return self.f, self.g

    def reversible_phase(self, work, *tensors):
        """One use of the halves by the stack, as one hookable call (see :func:`run_block_phase`)."""
        return block_phase(self, work, *tensors)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, cond=None):
        """Plain autograd forward on float streams (stores activations); the stack does not use it."""
        y1 = x1 + half_output(self.f, x2, cond)
        return y1, x2 + half_output(self.g, y1, cond)


def is_reversible_block(layer) -> bool:
    """A block is any module offering ``coupling_halves() -> (F, G)`` (duck-typed for revify)."""
    return callable(getattr(layer, "coupling_halves", None))


def is_invertible_layer(layer) -> bool:
    """A module mapping the two streams with an exact ``inverse(y1, y2) -> (x1, x2)``."""
    return not is_reversible_block(layer) and callable(getattr(layer, "inverse", None))
