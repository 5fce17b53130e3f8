"""The reversible engine: ReversibleBlock, ReversibleStack and its autograd Function.

A block keeps two residual streams::

    forward   y1 = x1 + F(x2)        y2 = x2 + G(y1)
    inverse   x2 = y2 - G(y1)        x1 = y1 - F(x2)

The forward runs without grad and keeps only each reversible segment's final streams; the
backward rebuilds every block's input from its output and gets the gradients from the same
recompute (each half's forward runs exactly once per block in backward). The engine talks to
halves only through ``couple(res, x, sign, frac_bits)`` (revtriton.halves.base) and knows
nothing of Triton.

Exact streams (default) are int32 fixed point, so the inverse is bitwise exact; float streams
(``exact=False``) may drift, which ``anchor_every`` bounds.
"""
from __future__ import annotations

import contextlib
import math
import sys
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from .halves.base import as_half
from .ops.dispatch import capture_state, replayed
from .ops.streams import (STREAM_LIMIT_BITS, check_frac_bits, from_fixed, out_of_range, stream_grad_dtype,
                          to_fixed)
from .schedules import SCHEDULES, BlockGrads, Recovered, ScheduleTrace, run_backward_schedule


# --------------------------------------------------------------------------------------------
# Layers


class ReversibleBlock(nn.Module):
    """A reversible block of two coupling halves F and G (any ``[..., d] -> [..., d]`` modules)."""

    def __init__(self, f: nn.Module, g: nn.Module):
        super().__init__()
        self.f = as_half(f)
        self.g = as_half(g)

    def coupling_halves(self):
        return self.f, self.g

    def reversible_phase(self, work, *tensors):
        """One use of the halves by the stack, as one hookable call (see :func:`run_block_phase`)."""
        return block_phase(self, work, *tensors)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor):
        """Plain autograd forward on float streams (stores activations); the stack does not use it."""
        y1 = x1 + self.f(x2)
        return y1, x2 + self.g(y1)


def is_reversible_block(layer) -> bool:
    """A block is any module offering ``coupling_halves() -> (F, G)`` (duck-typed for revify)."""
    return callable(getattr(layer, "coupling_halves", None))


def is_invertible_layer(layer) -> bool:
    """A module mapping the two streams with an exact ``inverse(y1, y2) -> (x1, x2)``."""
    return not is_reversible_block(layer) and callable(getattr(layer, "inverse", None))


# --------------------------------------------------------------------------------------------
# One hookable call per block and phase (FSDP2)
#
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
    if not getattr(layer, "_revtriton_fsdp_phase", False) and _is_fsdp_module(layer):
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


# --------------------------------------------------------------------------------------------
# RNG and autocast replay


def _rng_devices(tensor: torch.Tensor):
    return [tensor.device] if tensor.is_cuda else []


class RngTape:
    """RNG states recorded before each half call in forward, replayed in backward.

    A state is stored only when it differs from the last one recorded, so halves that draw no
    random numbers share one state and the tape does not grow with depth.
    """

    def __init__(self, devices):
        self.devices = list(devices)
        self._last = None

    def record(self):
        state = (torch.get_rng_state(), tuple(torch.cuda.get_rng_state(d) for d in self.devices))
        last = self._last
        if last is not None and torch.equal(last[0], state[0]) and all(
            torch.equal(a, b) for a, b in zip(last[1], state[1])
        ):
            return last
        self._last = state
        return state

    def set(self, state):
        torch.set_rng_state(state[0])
        for device, cuda_state in zip(self.devices, state[1]):
            torch.cuda.set_rng_state(cuda_state, device)

    @contextlib.contextmanager
    def preserved(self):
        """Leave the caller's global RNG as it was (the backward replays forward states)."""
        saved = (torch.get_rng_state(), tuple(torch.cuda.get_rng_state(d) for d in self.devices))
        try:
            yield
        finally:
            self.set(saved)


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings of the forward, restored around every recompute."""

    settings: tuple

    @staticmethod
    def capture():
        settings = []
        for device_type in ("cpu", "cuda"):
            enabled = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type)
            settings.append((device_type, enabled, dtype))
        return AutocastState(tuple(settings))

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.settings:
                if device_type == "cuda" and not torch.cuda.is_available():
                    continue
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield


# --------------------------------------------------------------------------------------------
# Stream values and guards


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


@dataclass
class ForwardGuards:
    """Device-side flags checked with one host sync at the end of a stack's forward."""

    labels: list = field(default_factory=list)
    flags: list = field(default_factory=list)

    def add(self, label, flag: torch.Tensor):
        self.labels.append(label)
        self.flags.append(flag.reshape(()))

    def first_failure(self):
        if not self.flags:
            return None
        failed = torch.stack(self.flags).nonzero()
        self.flags.clear()  # the graph keeps the segment runs: don't let it keep the flags too
        return None if failed.numel() == 0 else self.labels[int(failed[0, 0])]


FIND_UNUSED_HINT = (
    "revtriton: DistributedDataParallel(find_unused_parameters=True) does not work with reversible "
    "stacks: their blocks' parameters are not in the output's autograd graph (the forward keeps no "
    "graph), so DDP marks them unused and then sees their gradients arrive in backward. Use "
    "find_unused_parameters=False (the default) or static_graph=True (which also allows parameters "
    "that are unused in every step); with the Hugging Face Trainer set "
    "TrainingArguments(ddp_find_unused_parameters=False)."
)


class BackwardChecks:
    """Checksum flags of all segments of one forward, checked with one host sync.

    Segments run backward last to first, so the first segment's backward does the check.
    """

    def __init__(self, first_layer: int):
        self.first_layer = first_layer
        self.flags = []  # (index of the segment's last layer, flags in backward order)

    def add(self, last_layer, flags):
        self.flags.append((last_layer, flags))

    def raise_if_mismatched(self):
        if not self.flags:
            return
        found = torch.cat([f for _, f in self.flags]).nonzero()
        if found.numel():
            position = int(found[0, 0])
            for last_layer, flags in self.flags:
                if position < len(flags):
                    layer_index = last_layer - position
                    break
                position -= len(flags)
            self.flags.clear()
            raise RuntimeError(
                f"revtriton: the input of layer {layer_index} rebuilt in backward does not match the forward "
                f"(int64 checksum differs). F or G of that block is not deterministic: the recompute must run "
                f"the same kernels with the same configs, autocast state and RNG stream as the forward "
                f"(no atomics or split-K in the forward path, no data-dependent randomness outside torch's RNG)."
            )
        self.flags.clear()


def _checksum(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    # int32 sums accumulate in int64 (torch's default for integers; an explicit dtype would copy first).
    return torch.stack([s1.sum(), s2.sum()])


# --------------------------------------------------------------------------------------------
# One reversible segment: forward, recover, gradients


@dataclass
class SegmentRun:
    """Everything a segment's forward records for its backward (besides the saved streams)."""

    layers: list
    first_index: int  # index of layers[0] in the stack, for error messages
    fmt: StreamFormat
    anchor_every: int
    schedule: str
    guards: ForwardGuards | None = None
    rng: RngTape | None = None
    rng_states: list = field(default_factory=list)  # per layer: (state_F, state_G) or None
    autocast: AutocastState | None = None
    dispatch: tuple | None = None  # where ops ran in forward (ops.dispatch.capture_state), replayed in backward
    anchor_layers: list = field(default_factory=list)
    trace: ScheduleTrace | None = None
    checks: BackwardChecks | None = None


def _segment_forward(run: SegmentRun, s1: torch.Tensor, s2: torch.Tensor, record: bool):
    """Run the segment's layers on streams (no grad). Returns final streams, anchors, checksums."""
    fmt, k = run.fmt, run.fmt.frac_bits
    anchors, checksums = [], []
    if fmt.exact:
        checksums.append(_checksum(s1, s2))
        if run.guards is not None:
            index = run.first_index
            run.guards.add(("overflow", index, "input"), out_of_range(s1) | out_of_range(s2))
    for i, layer in enumerate(run.layers):
        if record and run.anchor_every and i > 0 and i % run.anchor_every == 0:
            run.anchor_layers.append(i)
            anchors += [s1, s2]
        if is_reversible_block(layer):

            def forward_phase(f, g, s1=s1, s2=s2):
                values = run.fmt.for_block(f)
                state_f = run.rng.record() if record else None
                y1, _ = f.couple(s1, values.value(s2), +1, k)
                state_g = run.rng.record() if record else None
                y2, _ = g.couple(s2, values.value(y1), +1, k)
                return (PhaseResult((y1, y2, state_f, state_g)),)

            y1, y2, state_f, state_g = run_block_phase(layer, forward_phase)
            if fmt.exact and run.guards is not None:
                index = run.first_index + i
                run.guards.add(("overflow", index, "F"), out_of_range(y1))
                run.guards.add(("overflow", index, "G"), out_of_range(y2))
            if record:
                run.rng_states.append((state_f, state_g))
            s1, s2 = y1, y2
        else:
            if record:
                run.rng_states.append(None)
            s1, s2 = layer(s1, s2)
        if fmt.exact:
            checksums.append(_checksum(s1, s2))
    return s1, s2, anchors, checksums


class ReversibleSegmentFunction(torch.autograd.Function):
    """Autograd node of one reversible segment: saves only its final streams (and anchors)."""

    @staticmethod
    def forward(ctx, run: SegmentRun, x1, x2, *grad_anchor):
        fmt = run.fmt
        s1 = fmt.encode(x1)
        s2 = s1 if x2 is x1 else fmt.encode(x2)
        y1, y2, anchors, checksums = _segment_forward(run, s1, s2, record=True)
        ctx.run = run
        checksum = torch.stack(checksums) if checksums else None
        ctx.has_checksum = checksum is not None
        ctx.save_for_backward(y1, y2, *anchors, *([checksum] if checksum is not None else []))
        out1, out2 = fmt.value(y1), fmt.value(y2)
        # Outputs must not alias the saved streams (float mode) or the inputs.
        if out1 is y1 or out1 is x1 or out1 is x2:
            out1 = out1.clone()
        if out2 is y2 or out2 is x1 or out2 is x2 or out2 is out1:
            out2 = out2.clone()
        return out1, out2

    @staticmethod
    def backward(ctx, dy1, dy2):
        run: SegmentRun = ctx.run
        saved = ctx.saved_tensors
        y1, y2 = saved[0], saved[1]
        checksum = saved[-1] if ctx.has_checksum else None
        anchor_tensors = saved[2 : len(saved) - (1 if ctx.has_checksum else 0)]
        anchors = {
            layer: (anchor_tensors[2 * j], anchor_tensors[2 * j + 1]) for j, layer in enumerate(run.anchor_layers)
        }
        grad_dtype = stream_grad_dtype(run.fmt.value_dtype) if run.fmt.exact else y1.dtype
        dy1 = torch.zeros(y1.shape, dtype=grad_dtype, device=y1.device) if dy1 is None else dy1.to(grad_dtype)
        dy2 = torch.zeros(y2.shape, dtype=grad_dtype, device=y2.device) if dy2 is None else dy2.to(grad_dtype)
        stepper = _SegmentBackward(run, anchors, checksum)
        try:
            with run.rng.preserved():
                dx1, dx2, mismatch = run_backward_schedule(run.schedule, stepper, (y1, y2), dy1, dy2, run.trace)
        except RuntimeError as error:
            if "mark a variable ready only once" in str(error):  # DDP(find_unused_parameters=True)
                raise RuntimeError(FIND_UNUSED_HINT) from error
            raise
        if mismatch is not None:
            run.checks.add(run.first_index + len(run.layers) - 1, mismatch)
        if run.first_index == run.checks.first_layer:
            run.checks.raise_if_mismatched()  # the one host sync of the backward
        return None, dx1, dx2, None


class _SegmentBackward:
    """The per-layer steps a backward schedule composes: recover (rebuild) and grads."""

    def __init__(self, run: SegmentRun, anchors: dict, checksum):
        self.run = run
        self.anchors = anchors
        self.checksum = checksum
        self.num_layers = len(run.layers)

    def streams_entering(self, i, rebuilt):
        """The output streams of layer i: the exact anchor when one was kept, else ``rebuilt``."""
        return self.anchors.get(i + 1, rebuilt)

    def recover(self, i: int, streams) -> Recovered:
        """Rebuild layer i's input from its output, keeping the graph for its gradients."""
        run, fmt, k = self.run, self.run.fmt, self.run.fmt.frac_bits
        y1, y2 = self.streams_entering(i, streams)
        layer = run.layers[i]
        if is_reversible_block(layer):
            state_f, state_g = run.rng_states[i]

            def rebuild_phase(f, g, token):
                run.rng.set(state_g)
                y1_value = fmt.value(y1).detach().requires_grad_()
                x2, port_g = g.couple(y2, y1_value, -1, k)
                x2_value = fmt.value(x2).detach().requires_grad_()
                run.rng.set(state_f)
                x1, port_f = f.couple(y1, _AfterToken.apply(x2_value, token), -1, k)
                # y1_value is visible so FSDP2's pre-backward hook (prefetch) fires in grads(i).
                return PhaseResult((x1, x2, port_g, y1_value, port_f, x2_value)), y1_value

            with torch.enable_grad(), run.autocast.restored(), replayed(run.dispatch):
                token = torch.empty(0, device=y1.device, requires_grad=True)
                x1, x2, port_g, y1_value, port_f, x2_value = run_block_phase(layer, rebuild_phase, token)
            recovered = Recovered(i, (x1.detach(), x2.detach()), kind="block",
                                  tensors=(port_g, y1_value, port_f, x2_value))
        else:
            with torch.no_grad():
                x1, x2 = layer.inverse(y1, y2)
            with torch.enable_grad(), run.autocast.restored(), replayed(run.dispatch):
                v1 = fmt.value(x1).detach().requires_grad_()
                v2 = fmt.value(x2).detach().requires_grad_()
                o1, o2 = layer(v1, v2)
            recovered = Recovered(i, (x1, x2), kind="invertible", tensors=(o1, o2, v1, v2))
        if self.checksum is not None:
            recovered.mismatch = (_checksum(*recovered.inputs) != self.checksum[i]).any()
        return recovered

    @staticmethod
    def grads(recovered: Recovered, dy1: torch.Tensor, dy2: torch.Tensor) -> BlockGrads:
        """Gradients of one recovered layer: accumulates parameter grads, returns input grads."""
        if recovered.kind == "block":
            port_g, y1_value, port_f, x2_value = recovered.tensors
            # x2 = y2 - G(y1): backward(x2, -dy2) gives G's grads of the forward's y2 = x2 + G(y1).
            if port_g is not None:
                torch.autograd.backward(port_g, -dy2)
            if y1_value.grad is not None:
                dy1 = dy1 + y1_value.grad
            if port_f is not None:
                torch.autograd.backward(port_f, -dy1)
            dx2 = dy2 if x2_value.grad is None else dy2 + x2_value.grad
            return BlockGrads(dy1, dx2)
        o1, o2, v1, v2 = recovered.tensors
        outputs = [o for o in (o1, o2) if o.requires_grad]
        if outputs:
            grads = [g for o, g in zip((o1, o2), (dy1, dy2)) if o.requires_grad]
            torch.autograd.backward(outputs, grads)
        dx1 = torch.zeros_like(dy1) if v1.grad is None else v1.grad.to(dy1.dtype)
        dx2 = torch.zeros_like(dy2) if v2.grad is None else v2.grad.to(dy2.dtype)
        return BlockGrads(dx1, dx2)


# --------------------------------------------------------------------------------------------
# The stack


_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)


class ReversibleStack(nn.Module):
    """A stack of reversible blocks (plus invertible layers and stage transitions).

    Args:
        layers: modules in order. :class:`ReversibleBlock` (or any module with
            ``coupling_halves()``) and invertible layers (``forward(x1, x2)`` and
            ``inverse(y1, y2)``) form reversible segments that store only their final streams.
            Any other module is a stage transition: it maps the mean of the two streams and
            keeps its activations the ordinary way; the next segment starts both streams from
            its output.
        exact: int32 fixed-point streams (bitwise inverse); False gives float streams.
        frac_bits: fractional bits of the fixed-point streams (value = X * 2**-frac_bits).
        anchor_every: keep every K-th layer's input streams and rebuild each chunk from them.
        schedule: ``"sequential"`` or ``"pareprop"`` (rebuild block i-1 beside block i's grads).
        streams: ``"duplicate"`` (both streams start as x; output is their mean) or
            ``"split"`` (x's last dim is split into the two streams; output is their concat).

    Children are registered as ``"0"``, ``"1"``, ... like ``nn.Sequential``, so a stack that
    replaces a model's block list keeps its ``state_dict`` keys.
    """

    def __init__(self, layers, *, exact: bool = True, frac_bits: int = 16, anchor_every: int = 0,
                 schedule: str = "sequential", streams: str = "duplicate"):
        super().__init__()
        layers = list(layers)
        if not layers:
            raise ValueError("ReversibleStack needs at least one layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"layer {i} must be an nn.Module, got {type(layer).__name__}")
            self.add_module(str(i), layer)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if streams not in ("duplicate", "split"):
            raise ValueError(f"streams must be 'duplicate' or 'split', got {streams!r}")
        if not isinstance(anchor_every, int) or isinstance(anchor_every, bool) or anchor_every < 0:
            raise ValueError(f"anchor_every must be an int >= 0, got {anchor_every!r}")
        self.exact = bool(exact)
        self.frac_bits = check_frac_bits(frac_bits)
        self.anchor_every = anchor_every
        self.schedule = schedule
        self.streams = streams
        self.trace: ScheduleTrace | None = None  # set a ScheduleTrace to record the backward

    # -- structure ------------------------------------------------------------------------

    def __len__(self):
        return len(self._modules)

    def __getitem__(self, index):
        return list(self._modules.values())[index]

    def __iter__(self):
        return iter(self._modules.values())

    def _segments(self):
        """[(first_index, [layers]) | (index, transition_module)] in order."""
        parts, current, start = [], [], 0
        for i, layer in enumerate(self):
            if is_reversible_block(layer) or is_invertible_layer(layer):
                if not current:
                    start = i
                current.append(layer)
            else:
                if current:
                    parts.append(("segment", start, current))
                    current = []
                parts.append(("transition", i, layer))
        if current:
            parts.append(("segment", start, current))
        return parts

    # -- checks ---------------------------------------------------------------------------

    def _check_float_input(self, name, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype in _INT_DTYPES or x.is_complex():
            raise TypeError(f"{name} must be a real floating-point tensor, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] == 0:
            raise ValueError(f"{name} must have a non-empty last (feature) dim, got shape {tuple(x.shape)}")
        param = next(self.parameters(), None)
        if param is not None and param.device != x.device:
            raise ValueError(f"{name} is on {x.device} but the stack's parameters are on {param.device}")

    def _format(self, dtype) -> StreamFormat:
        return StreamFormat(self.frac_bits if self.exact else None, dtype)

    # -- forward --------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_float_input("input", x)
        if self.streams == "split":
            if x.shape[-1] % 2:
                raise ValueError(f"streams='split' needs an even last dim to split in two, got {x.shape[-1]}")
            x1, x2 = x.chunk(2, dim=-1)
            y1, y2 = self.forward_streams(x1, x2)
            return torch.cat([y1, y2], dim=-1)
        y1, y2 = self._run(x, x)
        return (y1 + y2) * 0.5

    def forward_streams(self, x1: torch.Tensor, x2: torch.Tensor):
        """Run on two streams: float in, float out (differentiable); int32 in, int32 out (exact, no grad)."""
        if x1.shape != x2.shape:
            raise ValueError(f"x1 and x2 must have the same shape, got {tuple(x1.shape)} and {tuple(x2.shape)}")
        if x1.dtype == torch.int32 or x2.dtype == torch.int32:
            return self._run_fixed(x1, x2, inverse=False)
        self._check_float_input("x1", x1)
        self._check_float_input("x2", x2)
        if x1.dtype != x2.dtype:
            raise TypeError(f"x1 and x2 must have the same dtype, got {x1.dtype} and {x2.dtype}")
        return self._run(x1, x2)

    # One deliberate graph break under torch.compile: the engine's Function (its RNG tape, guards and
    # nested backward) stays eager; users compile F and G regionally.
    @torch.compiler.disable
    def _run(self, x1, x2):
        inputs = (x1, x2)
        guards = ForwardGuards()
        checks = None
        if self.exact:
            with torch.no_grad():  # isfinite is composite: under grad it would save its input
                guards.add(("nonfinite",), ~(torch.isfinite(x1).all() & torch.isfinite(x2).all()))
        for kind, index, item in self._segments():
            if kind == "transition":
                x = item((x1 + x2) * 0.5)
                x1 = x2 = x
                continue
            checks = checks or BackwardChecks(index)
            x1, x2 = self._run_segment(index, item, x1, x2, guards, checks)
        failure = guards.first_failure()  # the one host sync of the forward
        if failure is not None:
            self._raise_guard(failure, inputs)
        return x1, x2

    def _run_segment(self, first_index, layers, x1, x2, guards, checks):
        fmt = self._format(x1.dtype)
        run = SegmentRun(layers, first_index, fmt, self.anchor_every, self.schedule, guards=guards,
                         rng=RngTape(_rng_devices(x1)), autocast=AutocastState.capture(), trace=self.trace,
                         checks=checks, dispatch=capture_state())
        params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        needs_graph = torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad or params)
        if not needs_graph:
            with torch.no_grad():
                s1 = fmt.encode(x1)
                s2 = s1 if x2 is x1 else fmt.encode(x2)
                y1, y2, _, _ = _segment_forward(run, s1, s2, record=False)
            return fmt.value(y1), fmt.value(y2)
        # A requires-grad dummy input makes autograd record the node even when x needs no grad
        # (frozen embeddings, LoRA): otherwise the blocks' parameters would silently get no grads.
        grad_anchor = torch.empty(0, device=x1.device, requires_grad=True)
        return ReversibleSegmentFunction.apply(run, x1, x2, grad_anchor)

    def _raise_guard(self, failure, inputs):
        if failure[0] == "nonfinite":
            raise ValueError("input contains NaN or Inf: exact (fixed-point) streams need finite values")
        _, index, half = failure
        peak = self._float_peak(inputs, index)
        suggestion = ""
        if peak is not None and math.isfinite(peak) and peak > 0:
            # 2**(29 - fit) > 1.01 * peak: 1% of slack for the exact model's rounding.
            fit = int(math.ceil(STREAM_LIMIT_BITS - math.log2(1.01 * peak))) - 1
            suggestion = (f"; the float streams reach |value| = {peak:.4g} there, so frac_bits <= {fit} would fit"
                          if fit >= 0 else f"; the float streams reach |value| = {peak:.4g}: too large for int32")
        elif peak is not None:
            suggestion = "; the float model itself produces non-finite values there"
        where = f"the {half} half of layer {index}" if half != "input" else f"the input of layer {index}"
        raise OverflowError(
            f"revtriton: the exact int32 stream left its range in {where} "
            f"(frac_bits={self.frac_bits} holds |value| < {2.0 ** (STREAM_LIMIT_BITS - self.frac_bits):.6g})"
            f"{suggestion}. "
            f"Lower frac_bits or use exact=False."
        )

    @torch.no_grad()
    def _float_peak(self, inputs, last_index):
        """Largest |stream value| through layer ``last_index`` of the float model (for the overflow message).

        Runs only when an overflow is being reported; the caller's RNG is left untouched.
        """
        x1, x2 = inputs
        if x1.dtype == torch.int32:
            x1, x2 = (from_fixed(s, self.frac_bits) for s in inputs)
        peak = torch.zeros((), device=x1.device)
        with torch.random.fork_rng(devices=_rng_devices(x1)):
            for i, layer in enumerate(self):
                if i > last_index:
                    break
                if is_reversible_block(layer):

                    def peak_phase(f, g, x1=x1, x2=x2):
                        x1 = f.couple(x1, x2, +1, None)[0]
                        return (PhaseResult((x1, g.couple(x2, x1, +1, None)[0])),)

                    x1, x2 = run_block_phase(layer, peak_phase)
                elif is_invertible_layer(layer):
                    x1, x2 = layer(x1, x2)
                else:
                    x1 = x2 = layer((x1 + x2) * 0.5)
                peak = torch.maximum(peak, torch.maximum(x1.abs().amax(), x2.abs().amax()).float())
        return float(peak)

    # -- inverse --------------------------------------------------------------------------

    @torch.no_grad()
    def inverse(self, y1: torch.Tensor, y2: torch.Tensor):
        """Rebuild the stack's input streams from its output streams (bitwise in exact mode).

        Stochastic layers (dropout, drop-path) are run with the current RNG: call it in eval mode.
        """
        if y1.shape != y2.shape:
            raise ValueError(f"y1 and y2 must have the same shape, got {tuple(y1.shape)} and {tuple(y2.shape)}")
        if y1.dtype == torch.int32 or y2.dtype == torch.int32:
            return self._run_fixed(y1, y2, inverse=True)
        self._check_float_input("y1", y1)
        self._check_float_input("y2", y2)
        if y1.dtype != y2.dtype:
            raise TypeError(f"y1 and y2 must have the same dtype, got {y1.dtype} and {y2.dtype}")
        fmt = self._format(y1.dtype)
        s1, s2 = fmt.encode(y1), fmt.encode(y2)
        if fmt.exact:  # what forward's guards check, here at once (inverse is not a training hot path)
            if not (torch.isfinite(y1).all() and torch.isfinite(y2).all()):
                raise ValueError("y1 / y2 contain NaN or Inf: exact (fixed-point) streams need finite values")
            if bool(out_of_range(s1) | out_of_range(s2)):
                raise OverflowError(f"y1 / y2 exceed what exact streams hold at frac_bits={self.frac_bits} "
                                    f"(|value| < {2.0 ** (STREAM_LIMIT_BITS - self.frac_bits):.6g})")
        s1, s2 = self._invert(fmt, s1, s2)
        return fmt.value(s1), fmt.value(s2)

    def _invert(self, fmt, s1, s2):
        for i in reversed(range(len(self))):
            layer = self[i]
            if is_reversible_block(layer):

                def inverse_phase(f, g, s1=s1, s2=s2):
                    values = fmt.for_block(f)
                    s2 = g.couple(s2, values.value(s1), -1, fmt.frac_bits)[0]
                    return (PhaseResult((f.couple(s1, values.value(s2), -1, fmt.frac_bits)[0], s2)),)

                s1, s2 = run_block_phase(layer, inverse_phase)
            elif is_invertible_layer(layer):
                s1, s2 = layer.inverse(s1, s2)
            else:
                raise ValueError(
                    f"layer {i} ({type(layer).__name__}) is a stage transition with no inverse: a stack with "
                    f"non-invertible layers cannot be inverted as a whole (give the module an "
                    f"inverse(y1, y2) to make it an invertible layer)"
                )
        return s1, s2

    @torch.no_grad()
    def _run_fixed(self, s1, s2, inverse):
        if not self.exact:
            raise TypeError("int32 streams are fixed-point streams: they need an exact=True stack")
        if s1.dtype != torch.int32 or s2.dtype != torch.int32:
            raise TypeError(f"both streams must be int32, got {s1.dtype} and {s2.dtype}")
        fmt = self._format(None)  # no float input to take a dtype from: each block's parameters'
        if inverse:
            return self._invert(fmt, s1, s2)
        for kind, index, item in self._segments():
            if kind == "transition":
                raise ValueError(
                    f"layer {index} ({type(item).__name__}) is a stage transition: fixed-point streams can only "
                    f"run through reversible blocks and invertible layers"
                )
        guards = ForwardGuards()
        run = SegmentRun(list(self), 0, fmt, 0, self.schedule, guards=guards)
        y1, y2, _, _ = _segment_forward(run, s1, s2, record=False)
        failure = guards.first_failure()
        if failure is not None:
            self._raise_guard(failure, (s1, s2))
        return y1, y2
