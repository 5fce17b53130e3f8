"""Pieces the model presets share: stack options, drop-path schedule, init, stored-activation twins.

A *stored-activation twin* runs the same reversible architecture with plain autograd: each
block computes ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)`` and autograd keeps every activation.
It is the baseline of the examples (same weights, same function, ordinary memory) and the
oracle of the gradient tests. :func:`to_stored_activations` turns every
:class:`~revtriton.engine.ReversibleStack` of a model into one, in place (state_dict keys and
parameters unchanged); :func:`to_reversible` turns them back.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..engine import ReversibleStack, coupled_forward, coupling_of, is_invertible_layer, is_reversible_block
from ..halves.base import half_output, transition_output
from ..ops.arguments import checked_int
from ..ops.streams import from_fixed, quantize_reference, scale_shift, stream_grad_dtype, to_fixed

STACK_OPTIONS = ("exact", "frac_bits", "anchor_every", "schedule", "token_chunk")


def drop_path_schedule(drop_path_rate: float, depth: int) -> list[float]:
    """Linearly increasing stochastic-depth rates 0 .. drop_path_rate over ``depth`` blocks (as timm)."""
    if not 0.0 <= drop_path_rate < 1.0:
        raise ValueError(f"drop_path_rate must be in [0, 1), got {drop_path_rate}")
    if depth == 1:
        return [0.0]
    return [drop_path_rate * i / (depth - 1) for i in range(depth)]


def trunc_normal_(tensor: torch.Tensor, std: float, a: float, b: float) -> torch.Tensor:
    """``tensor`` filled in place from N(0, std**2) truncated to [a, b], by the inverse CDF: one
    uniform draw in the bounds' CDF range, ``erfinv``, a scale and a clamp (against rounding at
    the ends). torch's ``nn.init.trunc_normal_`` redraws the whole tensor until every element is in
    range (2.3 s for GPT-2's 50,257 x 768 embedding-sized weight on a CPU, 0.2 s this way; 8 s to
    build ``rev_gpt("gpt2")``). The same distribution, other numbers."""
    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / (std * math.sqrt(2.0)))) / 2.0

    with torch.no_grad():
        return tensor.uniform_(2 * cdf(a) - 1, 2 * cdf(b) - 1).erfinv_().mul_(std * math.sqrt(2.0)).clamp_(a, b)


def init_transformer_weights(module: nn.Module, std: float = 0.02):
    """Truncated-normal Linear/Embedding weights, zero biases, unit norms (ViT / GPT-2 style)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            if m.weight is not None:
                nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once), as timm and Hugging Face report."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Stored-activation twins


class _Snap(torch.autograd.Function):
    """Forward: the exact fixed-point value; backward: identity to the float path (straight-through)."""

    @staticmethod
    def forward(ctx, z, exact_value):
        return exact_value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _HalfInput(torch.autograd.Function):
    """Identity whose backward hands on the half's input gradient already summed.

    The engine reads a half's input gradient as a whole (``x.grad``) and then adds the stream's
    own gradient; without this node autograd would add the stream's gradient in between the
    half's partial gradients (a LayerNorm input gets two), another float summation order.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class StoredActivationStack(ReversibleStack):
    """The same layers and options as a ReversibleStack, run with plain (stored-activation) autograd.

    Float stacks compute ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)`` (gradients equal to the
    reversible stack's up to the float rounding of its inverse); exact stacks compute the same
    rounded model as the fixed-point streams (every half output rounded to the 2**-frac_bits
    grid, straight-through gradient) with the engine's summation order, so on the same device
    and halves their losses and gradients are bitwise those of the reversible stack (one that runs
    its halves whole: by chunks of rows, ``token_chunk``, its GEMMs may differ in the last bits).
    Made by :func:`to_stored_activations`; not meant to be built directly.
    """

    def _run(self, x1, x2, cond=None, plan=None, join=False):  # the engine's forward / forward_streams call this
        if self.exact:
            return stored_exact_streams(list(self), x1, x2, self.frac_bits, cond, read=self.read)
        return stored_float_streams(list(self), x1, x2, cond, read=self.read)


def _mean(x1, x2):
    return (x1 + x2) * 0.5


def stored_float_streams(layers, x1, x2, cond=None, read=_mean):
    """Stored-activation (plain autograd) forward of a stack's layers on float streams; ``read``
    maps the two streams to a stage transition's input (the stack's readout)."""
    for layer in layers:
        if is_reversible_block(layer):
            x1, x2 = coupled_forward(layer, x1, x2, cond)
        elif is_invertible_layer(layer):
            x1, x2 = layer(x1, x2)
        else:
            x1 = x2 = transition_output(layer, read(x1, x2), cond)
    return x1, x2


def stored_exact_streams(layers, x1, x2, frac_bits, cond=None, read=_mean):
    """Stored-activation forward of the *rounded* model that exact streams compute (straight-through).

    Gradients are summed in the engine's order: each stream is encoded with its own snap (the
    engine adds the two streams' input grads last, dx = dx1 + dx2) and each half's input grad is
    summed before the stream's own grad joins it (:class:`_HalfInput`). With the same order the
    gradients agree bitwise, so the two train step for step alike.

    This is the twins' own arithmetic on purpose, not the engine's: the bitwise twin tests compare
    the reversible engine against it, and an oracle that ran the engine's segment, epilogue or
    rebuild code would share its bugs and pass them. Only the definitions of the rounded model
    are shared (``to_fixed``, ``from_fixed``, ``quantize_reference``, ``scale_shift`` of
    ops.streams: the fixed-point format itself, each with its own tests).
    """
    k, dtype = frac_bits, x1.dtype
    grad_dtype = stream_grad_dtype(dtype)  # the engine's stream-gradient dtype

    def encode(v):  # float value -> (int32 stream, value on the grid with a straight-through grad)
        s = to_fixed(v.detach(), k)
        return s, _Snap.apply(v.to(grad_dtype), from_fixed(s, k, grad_dtype))

    # Between segments (at the start, after a stage transition) the streams are float values the
    # engine does not round: a segment encodes them when its first block runs, as the engine does.
    f1, f2, in_segment = x1, x2, False
    for layer in layers:
        if is_reversible_block(layer):
            if not in_segment:
                s1, v1 = encode(f1)
                s2, v2 = encode(f2)
                in_segment = True
            f, g = layer.coupling_halves()
            c = coupling_of(layer)
            # A scaled coupling shifts the int32 stream right (the value's floor on the grid) and
            # scales the straight-through path by the same power of two, as the engine does.
            if c.scale1 != 1.0:
                s1, v1 = s1 >> scale_shift(c.scale1), v1 * c.scale1
            h = half_output(f, _HalfInput.apply(v2.to(dtype)), cond)  # halves see the stack's dtype, as in the engine
            s1 = s1 + quantize_reference(h.detach(), k)
            v1 = _Snap.apply(v1 + h, from_fixed(s1, k, grad_dtype))
            if c.scale2 != 1.0:
                s2, v2 = s2 >> scale_shift(c.scale2), v2 * c.scale2
            h = half_output(g, _HalfInput.apply(v1.to(dtype)), cond)
            s2 = s2 + quantize_reference(h.detach(), k)
            v2 = _Snap.apply(v2 + h, from_fixed(s2, k, grad_dtype))
            if c.swap:
                (s1, v1), (s2, v2) = (s2, v2), (s1, v1)
        elif is_invertible_layer(layer):
            raise NotImplementedError("exact stored-activation twins of invertible layers are not supported")
        else:
            # A transition sees the mean of the segment's float outputs; the next segment re-encodes.
            if in_segment:
                f1, f2, in_segment = v1.to(dtype), v2.to(dtype), False
            f1 = f2 = transition_output(layer, read(f1, f2), cond)
    if in_segment:
        return v1.to(dtype), v2.to(dtype)
    return f1, f2


def to_stored_activations(model: nn.Module) -> nn.Module:
    """Make every ReversibleStack in ``model`` run with plain autograd (in place; returns ``model``)."""
    for module in model.modules():
        if type(module) is ReversibleStack:
            module.__class__ = StoredActivationStack
    return model


def to_reversible(model: nn.Module) -> nn.Module:
    """Undo :func:`to_stored_activations` (in place; returns ``model``)."""
    for module in model.modules():
        if type(module) is StoredActivationStack:
            module.__class__ = ReversibleStack
    return model


def stack_options(kwargs: dict) -> dict:
    """Pick the ReversibleStack options out of a preset's keyword arguments."""
    return {name: kwargs.pop(name) for name in STACK_OPTIONS if name in kwargs}


def make_stack(layers, *, reversible: bool = True, **options) -> ReversibleStack:
    """A ReversibleStack (or its stored-activation twin when ``reversible=False``)."""
    stack = ReversibleStack(layers, **options)
    if not reversible:
        stack.__class__ = StoredActivationStack
    return stack


def check_positive(name: str, value) -> int:
    return checked_int(name, value, 1)
