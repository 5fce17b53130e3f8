"""Oracles: the same coupling architecture run with plain stored-activation autograd."""
import pytest
import torch
from torch import nn

from revtriton.models.common import stored_exact_streams, stored_float_streams

# Both stream modes as test parameters: exact (int32 fixed point) and float.
MODES = [pytest.param(True, id="exact"), pytest.param(False, id="float")]


def mlp(dim, hidden=None, dropout=0.0):
    hidden = hidden or 2 * dim
    layers = [nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class DropPath(nn.Module):
    """Per-sample stochastic depth around a module (draws from the global RNG)."""

    def __init__(self, module, p):
        super().__init__()
        self.module, self.p = module, p

    def forward(self, x):
        out = self.module(x)
        if not self.training or self.p == 0:
            return out
        keep = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype).bernoulli_(1 - self.p)
        return out * keep / (1 - self.p)


def plain_forward(stack, x, cond=None):
    """Stored-activation forward of a stack's layers (float streams), ``cond`` to the halves that take it."""
    y1, y2 = stored_float_streams(list(stack), x, x, cond)
    return (y1 + y2) * 0.5


def rounded_forward(stack, x, frac_bits, cond=None):
    """Stored-activation forward of the *rounded* model that exact streams compute."""
    y1, y2 = stored_exact_streams(list(stack), x, x, frac_bits, cond)
    return (y1 + y2) * 0.5


def grads_of(module, x, loss_fn):
    """(input grad, [param grads]) of loss_fn() with fresh .grad fields."""
    module.zero_grad(set_to_none=True)
    if x.grad is not None:
        x.grad = None
    loss_fn().backward()
    return x.grad, [p.grad for p in module.parameters()]


def max_rel_error(a_list, b_list):
    worst = 0.0
    for a, b in zip(a_list, b_list):
        assert (a is None) == (b is None)
        if a is None:
            continue
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return worst


class CountingHalf(nn.Module):
    """An MLP half that counts its calls (how often the engine runs each half)."""

    def __init__(self, dim):
        super().__init__()
        self.inner = mlp(dim)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)
