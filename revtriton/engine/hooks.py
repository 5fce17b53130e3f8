"""Forward and full-backward hooks registered on a reversible block, fired by the stack (which runs
the halves through the coupling protocol and never calls the block's ``__call__``)."""
from __future__ import annotations

from torch import nn


def _user_hooks(hooks: dict):
    """A module's hooks minus FSDP2's own (it gathers parameters around the block's phases itself)."""
    return [(hook_id, hook) for hook_id, hook in hooks.items()
            if not type(getattr(hook, "__self__", None)).__module__.startswith("torch.distributed")]


class BlockHooks:
    """Forward and full-backward hooks registered on a block, fired by the stack.

    The stack never calls a block's ``__call__`` (it runs the halves through the coupling
    protocol), so it fires the block's hooks itself: forward pre-hooks and forward hooks see the
    block's input and output stream values ``(x1, x2)`` / ``(y1, y2)`` in the forward (they may
    read them, not replace them: the streams are the block's state); full backward pre-hooks and
    hooks see ``(dy1, dy2)`` and ``(dx1, dx2)`` when the backward reaches the block and may
    replace them, as with any module.
    """

    def __init__(self, block):
        self.block = block
        self.pre = _user_hooks(block._forward_pre_hooks)
        self.post = _user_hooks(block._forward_hooks)
        self.backward_pre = list(block._backward_pre_hooks.values())
        self.backward = list(block._backward_hooks.values())

    @staticmethod
    def of(layer):
        if not isinstance(layer, nn.Module):
            return None
        if not (layer._forward_pre_hooks or layer._forward_hooks or layer._backward_pre_hooks
                or layer._backward_hooks):
            return None
        return BlockHooks(layer)

    @property
    def has_forward(self):
        return bool(self.pre or self.post)

    def _refuse(self, kind, index):
        raise RuntimeError(
            f"revtriton: a forward {kind} on the reversible block at layer {index} returned a value. In a "
            f"reversible stack a block's hooks may read its stream values, not replace them (the streams are "
            f"rebuilt from the outputs in backward). Change the block's halves instead, or return None."
        )

    def forward_pre(self, args, index):
        for hook_id, hook in self.pre:
            if hook_id in self.block._forward_pre_hooks_with_kwargs:
                result = hook(self.block, args, {})
            else:
                result = hook(self.block, args)
            if result is not None:
                self._refuse("pre-hook", index)

    def forward_post(self, args, output, index):
        for hook_id, hook in self.post:
            if hook_id in self.block._forward_hooks_with_kwargs:
                result = hook(self.block, args, {}, output)
            else:
                result = hook(self.block, args, output)
            if result is not None:
                self._refuse("hook", index)

    def backward_before(self, dy1, dy2):
        for hook in self.backward_pre:
            result = hook(self.block, (dy1, dy2))
            if result is not None:
                dy1, dy2 = result
        return dy1, dy2

    def backward_after(self, dx1, dx2, dy1, dy2):
        for hook in self.backward:
            result = hook(self.block, (dx1, dx2), (dy1, dy2))
            if result is not None:
                dx1, dx2 = result
        return dx1, dx2
