"""A bottleneck adapter as a coupling half: the trainable half beside a pretrained layer in a
function-preserving conversion (``revify(model, preserve=...)``, MEFT-style).

``H(x) = up(gelu(down(norm(x))))`` with ``up`` initialised to zero, so the adapter starts as the
zero function and the converted block computes what the pretrained layer did; its gradient is
not zero (``up`` receives one at once), so it trains from the first step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.arguments import checked_int
from .base import CouplingHalf


class Adapter(CouplingHalf):
    """Bottleneck adapter ``[..., dim] -> [..., dim]`` through ``size`` hidden units, zero at init."""

    def __init__(self, dim: int, size: int, *, norm: bool = True, eps: float = 1e-6):
        super().__init__()
        for name, value in (("dim", dim), ("size", size)):
            checked_int(f"Adapter {name}", value, 1)
        # A norm of its own: residual streams of pretrained LLMs reach magnitudes in the hundreds.
        self.norm = nn.LayerNorm(dim, eps=eps) if norm else nn.Identity()
        self.down = nn.Linear(dim, size)
        self.up = nn.Linear(size, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.down.weight.dtype)
        return self.up(F.gelu(self.down(self.norm(x))))
