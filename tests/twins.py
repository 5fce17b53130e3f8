"""Oracles: the same coupling architecture run with plain stored-activation autograd."""
import torch
from torch import nn

from revtriton.engine import is_invertible_layer, is_reversible_block
from revtriton.ops.streams import from_fixed, quantize_reference, to_fixed


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


def plain_streams(layers, x1, x2):
    """Stored-activation forward of a stack's layers (float streams)."""
    for layer in layers:
        if is_reversible_block(layer):
            f, g = layer.coupling_halves()
            x1 = x1 + f(x2)
            x2 = x2 + g(x1)
        elif is_invertible_layer(layer):
            x1, x2 = layer(x1, x2)
        else:
            x1 = x2 = layer((x1 + x2) * 0.5)
    return x1, x2


def plain_forward(stack, x):
    y1, y2 = plain_streams(list(stack), x, x)
    return (y1 + y2) * 0.5


class _Snap(torch.autograd.Function):
    """Forward: the exact grid value; backward: identity to the float path (straight-through)."""

    @staticmethod
    def forward(ctx, z, exact_value):
        return exact_value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def rounded_forward(stack, x, frac_bits):
    """Stored-activation forward of the *rounded* model that exact streams compute."""
    s1 = s2 = to_fixed(x.detach(), frac_bits)
    # Two snaps, as the engine sums the two streams' input grads last: dx = dx1 + dx2.
    v1, v2 = _Snap.apply(x, from_fixed(s1, frac_bits)), _Snap.apply(x, from_fixed(s2, frac_bits))
    for layer in stack:
        f, g = layer.coupling_halves()
        h = f(v2)
        s1 = s1 + quantize_reference(h.detach(), frac_bits)
        v1 = _Snap.apply(v1 + h, from_fixed(s1, frac_bits))
        h = g(v1)
        s2 = s2 + quantize_reference(h.detach(), frac_bits)
        v2 = _Snap.apply(v2 + h, from_fixed(s2, frac_bits))
    return (v1 + v2) * 0.5


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
