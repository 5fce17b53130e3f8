"""The reversible engine: ReversibleBlock, ReversibleStack and its autograd Function.

A block keeps two residual streams::

    forward   y1 = x1 + F(x2)        y2 = x2 + G(y1)
    inverse   x2 = y2 - G(y1)        x1 = y1 - F(x2)

or a scaled coupling (``Coupling``: ``y1 = a * x1 + F(x2)``, ``y2 = b * x2 + G(y1)``, optionally
swapped), which keeps a pretrained layer's function when it becomes a half (revify's ``preserve``).

The forward runs without grad and keeps only each reversible segment's final streams; the
backward rebuilds every block's input from its output and gets the gradients from the same
recompute (each half's forward runs exactly once per block in backward). The engine talks to
halves only through ``couple(res, x, sign, frac_bits)`` (revtriton.halves.base; ``cond=c`` too for
halves that take the stack's conditioning) and knows nothing of Triton.

Exact streams (default) are int32 fixed point, so the inverse is bitwise exact; float streams
(``exact=False``) may drift, which ``anchor_every`` bounds.

Where things are:

* ``protocol``: the block protocol (ReversibleBlock, reversible blocks and invertible layers).
* ``fsdp``: one hookable call per block and phase (FSDP2), the post-backward token.
* ``replay``: RNG and autocast replay for the backward's recompute.
* ``guards``: stream format, overflow guards, checksums, error hints.
* ``checks``: exact streams' checks of a step resolved at one host point (deferred, optimizer guard).
* ``graphs``: a whole training step captured in one CUDA graph (CapturedStep).
* ``plan``: what a stack's steps reuse (modules, parameters, buffers, RNG draws), rebuilt on change.
* ``state``: what the backward needs unchanged (modes, parameter versions, buffers, inputs).
* ``hooks``: a block's forward / backward hooks, fired by the stack.
* ``segment``: one reversible segment's forward and autograd Function (recover and grads).
* ``stack``: ReversibleStack.
"""
from .fsdp import PHASE_METHOD, PhaseResult, block_phase, hook_phase_for_fsdp, run_block_phase
from .checks import StepChecks, check_step, deferred_checks
from .graphs import CapturedStep
from .guards import CAPTURED_TENSOR_HINT, FIND_UNUSED_HINT, ForwardGuards, StreamFormat, out_of_range
from .hooks import BlockHooks
from .protocol import Coupling, ReversibleBlock, coupled_forward, coupling_of, is_invertible_layer, is_reversible_block
from .replay import AutocastState, HalfRandomness
from .segment import DOUBLE_BACKWARD_MESSAGE, ReversibleSegmentFunction, SegmentRun
from .stack import ReversibleStack
from .state import StateWatch

__all__ = ["PHASE_METHOD", "AutocastState", "CapturedStep", "StepChecks", "check_step", "deferred_checks", "BlockHooks", "CAPTURED_TENSOR_HINT", "Coupling",
           "DOUBLE_BACKWARD_MESSAGE", "FIND_UNUSED_HINT", "ForwardGuards", "PhaseResult", "ReversibleBlock",
           "ReversibleSegmentFunction", "ReversibleStack", "HalfRandomness", "SegmentRun", "StateWatch", "StreamFormat",
           "block_phase", "coupled_forward", "coupling_of", "hook_phase_for_fsdp", "is_invertible_layer", "is_reversible_block", "out_of_range",
           "run_block_phase"]
