"""One hookable call per block and phase, so FSDP2 can gather a block's parameters around every use
of its halves (forward, rebuild in backward, inverse), and the token that runs FSDP2's
post-backward once a block's gradients are accumulated."""
from __future__ import annotations

import sys
import types

import torch


# Every use of a block's halves (forward, rebuild in backward, inverse) goes through ONE call of
# the block's ``reversible_phase`` method. FSDP2 (revtriton.distributed.shard_reversible) registers
# that method with ``register_fsdp_forward_method``: it gathers the block's parameters before the
# call and, outside backward, frees them after it. In backward it leaves them gathered; the
# rebuild's post-backward token (``_AfterToken``) runs FSDP2's post-backward (reduce-scatter,
# free) once the gradient has passed both halves.

PHASE_METHOD = "reversible_phase"


class PhaseResult:
    """A phase's results, hidden from hooks that walk a call's outputs (FSDP2 hooks and casts them)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def block_phase(block, work, *tensors):
    """The body of ``reversible_phase``: ``work(f, g, *tensors)`` on the block's halves.

    ``work`` returns ``(PhaseResult(value), *visible)``: only ``visible`` tensors are outputs a hook
    may see. ``tensors`` are the call's tensor arguments, which a hook may replace.
    """
    f, g = block.coupling_halves()
    return work(f, g, *tensors)


def run_block_phase(layer, work, *tensors):
    """Run one phase of a block through its ``reversible_phase`` method (or directly for duck-typed
    blocks that have none); returns the phase's value."""
    # (the FSDP2 test first: a plain module's missing attribute goes through nn.Module.__getattr__, ~1 us)
    if _is_fsdp_module(layer) and not getattr(layer, "_revtriton_fsdp_phase", False):
        hook_phase_for_fsdp(layer)  # sharded by fully_shard directly (e.g. by accelerate)
    method = getattr(layer, PHASE_METHOD, None)
    out = method(work, *tensors) if method is not None else block_phase(layer, work, *tensors)
    return out[0].value


def _is_fsdp_module(layer) -> bool:
    # FSDP2 not imported: nothing can be sharded (and the engine does not import it).
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return fsdp_module is not None and isinstance(layer, fsdp_module)


def hook_phase_for_fsdp(block):
    """Register the block's ``reversible_phase`` as an FSDP2 forward method (once).

    For a block that ``fully_shard`` was applied to: FSDP2 then gathers its parameters around
    every phase. Duck-typed blocks get the method first.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not callable(getattr(block, PHASE_METHOD, None)):
        setattr(block, PHASE_METHOD, types.MethodType(block_phase, block))
    register_fsdp_forward_method(block, PHASE_METHOD)
    block._revtriton_fsdp_phase = True


class _AfterToken(torch.autograd.Function):
    """Identity on ``x`` whose backward also hands ``token`` an (empty) gradient.

    Joined to F's input in the rebuild, it makes a hook on the token (FSDP2's post-backward)
    run only after the gradient has passed F, the block's last half in backward, i.e. after
    all of the block's parameter gradients are accumulated.
    """

    @staticmethod
    def forward(ctx, x, token):
        ctx.token_meta = (token.shape, token.dtype, token.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.token_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)
