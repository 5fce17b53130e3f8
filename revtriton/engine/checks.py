"""Exact streams' checks of a training step as device flags, resolved at the first host point that
must know, with one host sync.

A forward of an exact stack that records a graph keeps its overflow guards as device flags (no host
sync), and its backward adds every segment's recompute-checksum flags. Both are resolved together:

* eager (the default): when ``loss.backward()`` ends (a callback on autograd's graph task): one
  host sync per step;
* deferred (inside :func:`deferred_checks`, or while a CUDA graph is being captured): not in the
  step at all; :func:`check_step` resolves them, and so does every optimizer's ``step()`` (a global
  step pre-hook) before it applies any gradient.

A failed check raises the same error wherever it is resolved (the layer, and for an overflow the
``frac_bits`` that fits), and marks the gradients of the stack's parameters as failed: no
optimizer step applies them (it raises) until they are replaced (``optimizer.zero_grad()``, whose
default sets them to None, then a new backward).

A forward whose backward never runs is resolved by the next forward of any exact stack in eager
mode (or by check_step / the optimizer), so its overflow is never lost.

A step captured in a CUDA graph (engine.graphs.CapturedStep) keeps a flag its replays OR into;
check_step reads it with the rest. No optimizer step resolves checks while a step is captured.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .guards import first_failed_label

_state = threading.local()
_pending: list = []  # StepChecks waiting for check_step / the optimizer (deferred, or never backward)
_failed_grads: dict = {}  # id(param) -> (weakref to param, its .grad when the check failed, the error text)


def deferring() -> bool:
    """Whether checks wait for check_step: inside deferred_checks(), or while a CUDA graph is captured."""
    if getattr(_state, "deferred", 0):
        return True
    return capturing_now()


def capturing_now() -> bool:
    """Whether a step is being captured (a CUDA graph, or engine.graphs' capture on a CPU's stand-in):
    nothing may wait on the device then."""
    if getattr(_state, "capturing", 0):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def capturing():
    """A step being captured (engine.graphs): checks wait, and no optimizer step resolves them."""
    _state.capturing = getattr(_state, "capturing", 0) + 1
    try:
        yield
    finally:
        _state.capturing -= 1


@contextlib.contextmanager
def deferred_checks():
    """Run training steps with no host sync at all: exact streams' checks wait for :func:`check_step`
    (or the next optimizer step), which resolves every step's checks with one sync."""
    _state.deferred = getattr(_state, "deferred", 0) + 1
    try:
        yield
    finally:
        _state.deferred -= 1


# Captured steps (engine.graphs.CapturedStep): check_step() checks their replays too.
_replayed_steps: weakref.WeakSet = weakref.WeakSet()


def check_step():
    """Resolve every exact-stream check still waiting, and the replays of captured steps
    (engine.graphs), with one host sync; raise the first failure."""
    steps = [step for step in list(_replayed_steps) if step.failed_flag() is not None]
    pending = list(_pending)
    _pending.clear()
    if not pending and not steps:
        return
    flags = [step.failed_flag() for step in steps] + [checks.failed_flag() for checks in pending]
    if bool(torch.stack(flags).any()):  # the one host sync
        for step in steps:
            step.check()
        for checks in pending:
            checks.resolve()


def resolve_leftovers():
    """Resolve checks whose backward never came (an eager forward of an exact stack calls this)."""
    if _pending and not deferring():
        check_step()


class StepChecks:
    """The device flags of one forward of an exact stack and of its backward (see the module doc)."""

    def __init__(self, stack, inputs, cond):
        self.stack = stack
        # Weak: the inputs are needed only for an overflow message (the float model's peak); the
        # backward's rebuilt input stands in when they are gone.
        self.inputs = tuple(weakref.ref(t) for t in inputs)
        self.cond = cond
        self.rebuilt_input = None
        self.forward = None  # (flags, label positions, labels) of the forward's guards
        self.segments = []  # (index of the segment's last layer, flags in backward order)
        self.queued = False
        self.resolved = False

    # -- filled by the forward and the backward ---------------------------------------------------

    def defer_forward(self, guards):
        self.forward = guards.device_flags()
        _pending.append(self)  # resolved by its backward's end, or as a leftover

    def add(self, last_layer, flags, rebuilt_input=None):
        self.segments.append((last_layer, flags))
        if rebuilt_input is not None:
            self.rebuilt_input = rebuilt_input
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.at_backward_end)

    def at_backward_end(self):
        self.queued = False
        if deferring():
            if self not in _pending:
                _pending.append(self)
            return
        if self in _pending:
            _pending.remove(self)
        if bool(self.failed_flag()):  # the one host sync of an eager step
            self.resolve()

    # -- resolving ------------------------------------------------------------------------------

    def failed_flag(self) -> torch.Tensor:
        flags = [f for _, f in self.segments]
        if self.forward is not None:
            flags.append(self.forward[0])
        if not flags:
            return torch.zeros((), dtype=torch.bool)
        return torch.cat([f.reshape(-1) for f in flags]).any()

    def resolve(self):
        """Raise this step's first failure, if any (host syncs: called on the error path or after one)."""
        if self in _pending:
            _pending.remove(self)
        error = self._first_error()
        self.forward, self.segments = None, []
        if error is not None:
            mark_failed(self.stack, str(error))
            raise error

    def _first_error(self):
        if self.forward is not None:
            label = first_failed_label(*self.forward)
            if label is not None:
                inputs = tuple(ref() for ref in self.inputs)
                if any(t is None for t in inputs):
                    inputs = self.rebuilt_input
                return self.stack._guard_error(label, inputs, self.cond)
        if self.segments:
            found = torch.cat([f for _, f in self.segments]).nonzero()
            if found.numel():
                position = int(found[0, 0])
                for last_layer, segment_flags in self.segments:
                    if position < len(segment_flags):
                        return RuntimeError(mismatch_message(last_layer - position))
                    position -= len(segment_flags)
        return None


def mismatch_message(layer_index: int) -> str:
    return (
        f"revtriton: the input of layer {layer_index} rebuilt in backward does not match the forward "
        f"(position-weighted checksum differs). F or G of that block is not deterministic: the recompute "
        f"must run the same kernels with the same configs, autocast state and RNG stream as the forward "
        f"(no atomics or split-K in the forward path, no data-dependent randomness outside torch's RNG)."
    )


# -- no optimizer step applies the gradients of a failed check -----------------------------------------

def mark_failed(stack, error: str):
    for p in stack.parameters():
        if p.grad is not None:
            _failed_grads[id(p)] = (weakref.ref(p), p.grad, error)


def _before_optimizer_step(optimizer, args, kwargs):
    if capturing_now():  # the step is being captured: its checks are read after each replay
        return
    if _pending:
        check_step()  # raises on a failure, marking the gradients
    if not _failed_grads:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _failed_grads.get(id(p))
            if entry is None:
                continue
            ref, grad, error = entry
            if ref() is not p or p.grad is not grad:  # another parameter, or its gradients were replaced
                del _failed_grads[id(p)]
                continue
            raise RuntimeError(
                f"revtriton: optimizer.step() refused: the gradients of its parameters come from a backward whose "
                f"exact-stream check failed ({error}). Call optimizer.zero_grad() (set_to_none=True, the default) "
                f"and run the step again once the cause is fixed.")


register_optimizer_step_pre_hook(_before_optimizer_step)
