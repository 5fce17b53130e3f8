"""Stream values and the checks around them: the stream format (float or int32 fixed point), the
forward's device-side overflow guards (one host sync per forward), the position-sensitive
checksums compared in backward (one host sync per backward), and the errors' hints."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..ops.streams import extremes_out_of_range, from_fixed, stream_checksum, to_fixed, zero_element
from ..ops.streams import out_of_range as _stream_out_of_range


@dataclass
class StreamFormat:
    """How streams are held: float (``frac_bits`` None) or int32 fixed point.

    Halves and the stack's outputs see an exact stream's value in ``value_dtype``, the dtype the
    stack was given (so a bf16 or float64 model gets bf16 or float64 inputs, as with float
    streams); rounding it there is deterministic, so the stream itself stays exact.
    """

    frac_bits: int | None
    value_dtype: torch.dtype | None = torch.float32  # None: the block's parameters' (int32 API)

    @property
    def exact(self) -> bool:
        return self.frac_bits is not None

    def for_block(self, half: nn.Module) -> StreamFormat:
        """This format with ``value_dtype`` resolved for a block, inside its phase (so under FSDP2
        mixed precision the gathered bf16 parameters decide, not the float32 shards)."""
        if self.value_dtype is not None:
            return self
        dtype = next((p.dtype for p in half.parameters() if p.is_floating_point()), torch.float32)
        return StreamFormat(self.frac_bits, dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return to_fixed(x, self.frac_bits) if self.exact else x

    def value(self, stream: torch.Tensor) -> torch.Tensor:
        """The float value of a stream, as halves see it and the stack returns it."""
        return from_fixed(stream, self.frac_bits, self.value_dtype) if self.exact else stream

    def differentiable_value(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(leaf, value)`` for an int32 stream: ``value`` bitwise :meth:`value`'s, and its gradient
        arrives in ``leaf.grad``. The leaf is zeros of the stream's shape with one element of storage
        (stride 0) and ``value = leaf + stream * 2**-frac_bits`` in one add (adding +0.0 changes no
        bit: the stream's values have no -0.0), in float32 (float64) as from_fixed rounds, then cast:
        autograd's add and cast save nothing, so no one keeps the value but the ops that read it (a
        leaf holding the value itself would keep a stream-sized copy alive until the block's
        gradients are done)."""
        wide = torch.float64 if self.value_dtype == torch.float64 else torch.float32
        leaf = zero_element(wide, stream.device).expand(stream.shape).detach().requires_grad_()
        value = torch.add(leaf, stream, alpha=2.0**-self.frac_bits)
        return leaf, (value if self.value_dtype == wide else value.to(self.value_dtype))


@dataclass
class ForwardGuards:
    """Device-side flags checked with one host sync at the end of a stack's forward.

    Range checks keep only each stream's extremes (one aminmax a stream) and compare them with the
    bound all at once in :meth:`first_failure`: a few small ops per forward instead of three per
    stream, which on a CPU cost about as much as the aminmax itself."""

    labels: list = field(default_factory=list)  # every check's label, in the order they were added
    flags: list = field(default_factory=list)
    flag_at: list = field(default_factory=list)  # the position of each flag's label in ``labels``
    lows: list = field(default_factory=list)
    highs: list = field(default_factory=list)
    range_at: list = field(default_factory=list)  # the position of each range check's label

    def add(self, label, flag: torch.Tensor):
        self.flag_at.append(len(self.labels))
        self.labels.append(label)
        self.flags.append(flag.reshape(()))

    def add_range(self, label, *streams: torch.Tensor):
        """Fail ``label`` when some |X| of these int32 streams is >= 2**STREAM_LIMIT_BITS (an empty
        stream has nothing to overflow)."""
        at = len(self.labels)
        self.labels.append(label)
        for stream in streams:
            if stream.numel():
                low, high = torch.aminmax(stream)
                self.lows.append(low)
                self.highs.append(high)
                self.range_at.append(at)

    def device_flags(self):
        """``(flags, where, labels)``: one device bool per check (no host sync), the position of each
        flag's label in ``labels``, and the labels. Clears the guards (the graph keeps the segment
        runs: it must not keep the per-stream extremes too)."""
        parts, where = [], self.flag_at + self.range_at
        if self.flags:
            parts.append(torch.stack(self.flags))
        if self.lows:
            parts.append(extremes_out_of_range(torch.stack(self.lows), torch.stack(self.highs)))
        labels = self.labels
        self.flags, self.flag_at, self.lows, self.highs, self.range_at, self.labels = [], [], [], [], [], []
        flags = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
        return flags, where, labels

    def first_failure(self):
        """The label of the first failed check, in the order they were added; None if none failed
        (one host sync)."""
        return first_failed_label(*self.device_flags())


def first_failed_label(flags, where, labels):
    """The label of the first failed check of :meth:`ForwardGuards.device_flags`'s result, or None
    (one host sync)."""
    failed = flags.nonzero()
    return None if failed.numel() == 0 else labels[min(where[i] for i in failed[:, 0].tolist())]


def out_of_range(stream: torch.Tensor) -> torch.Tensor:
    """Device flag: some |X| >= 2**STREAM_LIMIT_BITS (``ops.streams.out_of_range``, which reduces with
    aminmax), also for an empty stream (an empty batch or T = 0: nothing to overflow)."""
    if stream.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=stream.device)
    return _stream_out_of_range(stream)


FIND_UNUSED_HINT = (
    "revtriton: DistributedDataParallel(find_unused_parameters=True) does not work with reversible "
    "stacks: their blocks' parameters are not in the output's autograd graph (the forward keeps no "
    "graph), so DDP marks them unused and then sees their gradients arrive in backward. Use "
    "find_unused_parameters=False (the default) or static_graph=True (which also allows parameters "
    "that are unused in every step); with the Hugging Face Trainer set "
    "TrainingArguments(ddp_find_unused_parameters=False)."
)


def captured_tensor_message(where: str) -> str:
    return (
        f"revtriton: {where} uses a tensor from outside the stack that requires grad (a conditioning or "
        f"timestep embedding set as an attribute, a tensor captured in a closure). A reversible stack keeps no "
        f"graph of its forward and rebuilds every block on its own in backward, so that tensor would get a wrong "
        f"gradient, or none at all. Pass it to the stack instead: stack(x, cond=c) hands c to every half whose "
        f"forward has a `cond` parameter (def forward(self, x, cond)) and gives c its gradient, summed over all "
        f"blocks. (Tensors that need no gradient may be captured; a trainable weight belongs in the block.)"
    )


CAPTURED_TENSOR_HINT = captured_tensor_message("a half of a reversible stack")


def reaches_foreign_leaf(output, is_own) -> bool:
    """Whether the autograd graph of ``output`` reaches a leaf requiring grad for which ``is_own(leaf)``
    is False.

    Run on each half's output as the backward rebuilds it: its graph may end only at the half's
    input leaves, the segment's parameters and the conditioning's leaves; any other leaf (also one
    behind a captured non-leaf's graph) belongs to a tensor the half took from outside the stack.
    Only the half's own graph is walked unless such a leaf is there (then the walk stops at it).
    """
    return any(not is_own(leaf) for leaf in graph_leaves(output))


def graph_leaves(output):
    """The leaves requiring grad that ``output``'s autograd graph reaches (each accumulator's variable),
    one at a time, as the walk meets them (none for an output without a graph)."""
    if output is None or output.grad_fn is None:
        return
    todo = [output.grad_fn]
    seen = set(todo)
    accumulate_grad = _ACCUMULATE_GRAD
    while todo:
        node = todo.pop()
        if isinstance(node, accumulate_grad):  # a leaf
            yield node.variable
            continue
        for fn, _ in node.next_functions:
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo.append(fn)


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


def _checksum(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """Position-sensitive int32 checksum of two int32 streams (ops.streams.stream_checksum): one
    reduction a stream, no host sync; moved values change it, not only changed ones."""
    return stream_checksum(s1, s2)
