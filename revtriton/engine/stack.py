"""ReversibleStack: the module users build, its segments and stage transitions, the overflow
message, the inverse and the int32-stream API."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..halves.base import takes_cond, transition_output, transition_takes_cond
from ..ops.arguments import checked_int
from ..ops.dispatch import capture_state
from ..ops.streams import STREAM_LIMIT_BITS, check_frac_bits, from_fixed
from ..schedules import SCHEDULES, ScheduleTrace
from .fsdp import PhaseResult, run_block_phase
from .checks import StepChecks, deferring, resolve_leftovers
from .guards import ForwardGuards, StreamFormat, out_of_range
from .plan import plan_of
from .protocol import PLAIN_COUPLING, coupling_of, is_invertible_layer, is_reversible_block, residual_scale
from .replay import AutocastState
from .rows import couple_by_rows, layer_rows
from .segment import ReversibleSegmentFunction, SegmentRun, _segment_forward
from .state import StateWatch, swapped_parameter_message


READOUTS = ("mean", "first", "second")
# Float streams: warn when scaled couplings let the inverse amplify rounding by more than 2**12
# between anchors (float32 keeps 24 bits: half of them would go).
FLOAT_AMPLIFICATION_WARN_BITS = 12


def _warn_float_amplification(layers, anchor_every: int):
    """Warn when a float stack's scaled couplings amplify the inverse's rounding too much between anchors."""
    bits = []
    for layer in layers:
        c = coupling_of(layer) if is_reversible_block(layer) else PLAIN_COUPLING
        bits.append(-math.log2(c.scale1) - math.log2(c.scale2))
    window = anchor_every or len(bits)
    worst = max(sum(bits[i: i + window]) for i in range(0, len(bits), window))
    if worst > FLOAT_AMPLIFICATION_WARN_BITS:
        import warnings

        warnings.warn(
            f"revtriton: float streams with scaled couplings: the inverse amplifies rounding by up to 2**{worst:.0f} "
            f"between anchors, so the rebuilt inputs and the gradients may be far off; set anchor_every (each "
            f"anchor keeps two streams) so that it stays below 2**{FLOAT_AMPLIFICATION_WARN_BITS}, or use "
            f"exact=True (bitwise at any depth)", stacklevel=3)
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
        readout: what a duplicate-stream stack returns and its stage transitions map:
            ``"mean"`` (``(y1 + y2) / 2``), ``"first"`` (y1) or ``"second"`` (y2). A conversion
            that keeps a pretrained model's function reads the stream that carries it.
        token_chunk: run the halves whose rows are independent (``rows_independent``: the MLP
            halves) on at most this many token rows at a time, in the forward, the inverse and
            the rebuild (the sequential backward runs each chunk's gradients before the next), so
            their hidden activations stay ``[token_chunk, hidden]``; None (the default): whole.
            Same FLOPs; see revtriton.engine.rows.

    Blocks may be scaled couplings (``ReversibleBlock(f, g, scale1=, scale2=, swap=)``, see
    :class:`~revtriton.engine.protocol.Coupling`); exact stacks need their scales to be 2**-s.

    Conditioning: ``stack(x, cond=c)`` (also ``forward_streams`` and ``inverse``) hands ``c``, a
    tensor or a tuple of tensors, to every half whose ``forward`` has a ``cond`` parameter (a
    timestep or class embedding, the adaLN / DiT pattern); its gradient is every half's
    contribution, summed. Stage transitions get it when their ``forward`` has a ``cond`` parameter
    (stored activations: its gradient flows as any input's); invertible layers do not.

    Children are registered as ``"0"``, ``"1"``, ... like ``nn.Sequential``, so a stack that
    replaces a model's block list keeps its ``state_dict`` keys.
    """

    def __init__(self, layers, *, exact: bool = True, frac_bits: int = 16, anchor_every: int = 0,
                 schedule: str = "sequential", streams: str = "duplicate", readout: str = "mean",
                 token_chunk: int | None = None):
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
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
        for i, layer in enumerate(layers):
            if is_reversible_block(layer):
                coupling_of(layer).check(bool(exact), f"layer {i} ({type(layer).__name__})")
        if not exact:
            _warn_float_amplification(layers, anchor_every)
        self.exact = bool(exact)
        self.frac_bits = check_frac_bits(frac_bits)
        self.anchor_every = checked_int("anchor_every", anchor_every, 0)
        self.schedule = schedule
        self.streams = streams
        self.readout = readout
        self.token_chunk = None if token_chunk is None else checked_int("token_chunk", token_chunk, 1)
        self.trace: ScheduleTrace | None = None  # set a ScheduleTrace to record the backward

    @property
    def chunk_rows(self) -> int | None:
        """``token_chunk`` (None for a stack pickled before it existed)."""
        return getattr(self, "token_chunk", None)

    # -- structure ------------------------------------------------------------------------

    def __len__(self):
        return len(self._modules)

    def __getitem__(self, index):
        """A layer; a slice is a ReversibleStack of those layers with the same options (as
        nn.Sequential: timm's prune_intermediate_layers assigns ``blocks[:n]``).

        ``layers_view`` (an attribute a conversion may set: a module-level function, so the stack
        still pickles) may answer a slice, and iteration (``slice(None)``), instead:
        ``layers_view(stack, index)`` returns what they stand for (a host model's layer loop meets
        stand-ins), or None for the layers themselves (a slice: the stack of those layers, which
        keeps ``layers_view``)."""
        layers = list(self._modules.values())
        if isinstance(index, slice):
            view = getattr(self, "layers_view", None)
            layer_calls = None if view is None else view(self, index)
            if layer_calls is not None:  # a conversion's stand-ins for its host model's layer loop
                return layer_calls
            part = ReversibleStack(layers[index], exact=self.exact, frac_bits=self.frac_bits,
                                   anchor_every=self.anchor_every, schedule=self.schedule, streams=self.streams,
                                   readout=getattr(self, "readout", "mean"), token_chunk=self.chunk_rows)
            if view is not None:
                part.layers_view = view
            return part
        return layers[index]

    def __iter__(self):
        view = getattr(self, "layers_view", None)
        layer_calls = None if view is None else view(self, slice(None))
        return iter(self._modules.values() if layer_calls is None else layer_calls)

    # -- checks ---------------------------------------------------------------------------

    def _check_float_input(self, name, x, plan=None):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype in _INT_DTYPES or x.is_complex():
            raise TypeError(f"{name} must be a real floating-point tensor, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] == 0:
            raise ValueError(f"{name} must have a non-empty last (feature) dim, got shape {tuple(x.shape)}")
        param = (plan or plan_of(self)).first_param
        if param is not None and param.device != x.device:
            raise ValueError(f"{name} is on {x.device} but the stack's parameters are on {param.device}")

    def stream_format(self, dtype) -> StreamFormat:
        """How this stack's streams hold values of ``dtype``: int32 fixed point (exact) or as they are."""
        return StreamFormat(self.frac_bits if self.exact else None, dtype)

    def _check_cond(self, cond):
        """``cond`` as halves get it (a tensor or a tuple of tensors; None for none), checked."""
        if cond is None:
            return None
        tensors = (cond,) if isinstance(cond, torch.Tensor) else tuple(cond) if isinstance(cond, (tuple, list)) else ()
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError(f"cond must be a tensor or a tuple of tensors, got {type(cond).__name__}")
        halves = [half for layer in self if is_reversible_block(layer) for half in layer.coupling_halves()]
        transitions = [layer for layer in self if not is_reversible_block(layer) and not is_invertible_layer(layer)]
        if not any(takes_cond(half) for half in halves) and not any(map(transition_takes_cond, transitions)):
            raise ValueError("cond was given but no half of the stack takes it: a half gets the conditioning when its "
                             "forward has a `cond` parameter (def forward(self, x, cond))")
        return cond if isinstance(cond, torch.Tensor) else tensors

    # -- forward --------------------------------------------------------------------------

    # The graph break is the whole forward under torch.compile: Dynamo tracing its checks (the plan's
    # signature reads every module) took 8 s for a 3-block stack, growing with the modules.
    @torch._disable_dynamo
    def forward(self, x: torch.Tensor, cond=None) -> torch.Tensor:
        plan = plan_of(self)  # once a call: checking that it is current reads every module's flags
        self._check_float_input("input", x, plan)
        if self.streams == "split":
            if x.shape[-1] % 2:
                raise ValueError(f"streams='split' needs an even last dim to split in two, got {x.shape[-1]}")
            x1, x2 = x.chunk(2, dim=-1)
            # join: the last segment of a float stack returns the concatenation itself, its halves being
            # the streams kept for backward (one copy of the output alive, not two).
            y1, y2 = self._run(x1, x2, self._check_cond(cond), plan, join=True)
            return y1 if y2 is None else torch.cat([y1, y2], dim=-1)
        y1, y2 = self._run(x, x, self._check_cond(cond), plan)
        return self.read(y1, y2)

    def read(self, y1: torch.Tensor, y2: torch.Tensor) -> torch.Tensor:
        """The one tensor a stack returns (and its stage transitions map) from two streams (``readout``)."""
        readout = getattr(self, "readout", "mean")  # stacks pickled before the option existed
        if readout == "first":
            return y1
        if readout == "second":
            return y2
        return (y1 + y2) * 0.5

    def forward_streams(self, x1: torch.Tensor, x2: torch.Tensor, cond=None, plan=None):
        """Run on two streams: float in, float out (differentiable); int32 in, int32 out (exact, no grad)."""
        cond = self._check_cond(cond)
        plan = plan or plan_of(self)
        if self._fixed_pair("x", x1, x2, plan):
            return self._run_fixed(x1, x2, inverse=False, cond=cond)
        return self._run(x1, x2, cond, plan)

    def _fixed_pair(self, name: str, a: torch.Tensor, b: torch.Tensor, plan=None) -> bool:
        """Check two streams given together (``name``1, ``name``2); True when they are int32 (exact)."""
        if a.shape != b.shape:
            raise ValueError(f"{name}1 and {name}2 must have the same shape, got {tuple(a.shape)} and "
                             f"{tuple(b.shape)}")
        if a.dtype == torch.int32 or b.dtype == torch.int32:
            return True
        self._check_float_input(f"{name}1", a, plan)
        self._check_float_input(f"{name}2", b, plan)
        if a.dtype != b.dtype:
            raise TypeError(f"{name}1 and {name}2 must have the same dtype, got {a.dtype} and {b.dtype}")
        return False

    # One deliberate graph break under torch.compile: the engine's Function (its RNG tape, guards and
    # nested backward) stays eager; users compile F and G regionally. torch._disable_dynamo is
    # torch.compiler.disable applied at the first call: the decorator itself imports torch._dynamo,
    # about 1.5 s of `import revtriton` on a CPU (torch uses it the same way in its own modules).
    @torch._disable_dynamo
    def _run(self, x1, x2, cond=None, plan=None, join=False):
        inputs = (x1, x2)
        guards = ForwardGuards()
        checks = StepChecks(self, inputs, cond) if self.exact else None
        if self.exact:
            resolve_leftovers()  # a forward whose backward never ran: its checks are resolved now
            with torch.no_grad():  # isfinite is composite: under grad it would save its input
                guards.add(("nonfinite",), ~(torch.isfinite(x1).all() & torch.isfinite(x2).all()))
        recorded = False
        parts = (plan or plan_of(self)).parts
        for position, (kind, index, item) in enumerate(parts):
            if kind == "transition":
                x = transition_output(item, self.read(x1, x2), cond)
                x1 = x2 = x
                continue
            last = join and position == len(parts) - 1
            x1, x2, node = self._run_segment(item, x1, x2, guards, checks, cond, join=last)
            recorded |= node
        if self.exact:
            if recorded or deferring():  # no host sync: resolved when the backward ends (engine.checks)
                checks.defer_forward(guards)
            else:  # nothing to differentiate (no_grad, a frozen stack): resolved now, one host sync
                failure = guards.first_failure()
                if failure is not None:
                    self._raise_guard(failure, inputs, cond)
        return x1, x2

    def _run_segment(self, plan, x1, x2, guards, checks, cond, join=False):
        """``(y1, y2, recorded)``; with ``join`` (float streams) possibly ``(cat([y1, y2], -1), None, True)``."""
        fmt = self.stream_format(x1.dtype)
        run = SegmentRun(plan.modules, plan.first_index, fmt, self.anchor_every, self.schedule, guards=guards,
                         autocast=AutocastState.capture(), trace=self.trace,
                         checks=checks, dispatch=capture_state(), cond_is_tuple=isinstance(cond, tuple), plan=plan,
                         token_chunk=self.chunk_rows)
        cond_tensors = () if cond is None else (cond,) if isinstance(cond, torch.Tensor) else cond
        per_layer = [lp.parameters() for lp in plan.layers]
        params = [p for layer_params in per_layer for p in layer_params]
        needs_graph = torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad
                                                   or any(p.requires_grad for p in params)
                                                   or any(c.requires_grad for c in cond_tensors))
        if not needs_graph:
            # Nothing here needs a gradient. In grad mode the halves still run with it (which records
            # nothing when no input requires grad), so an output that requires grad gives away a tensor a
            # half captured from outside the stack: with no_grad it would silently get no gradient.
            s1 = fmt.encode(x1)
            s2 = s1 if x2 is x1 else fmt.encode(x2)
            y1, y2, _, _ = _segment_forward(run, s1, s2, record=False, cond=cond,
                                            check_captured=torch.is_grad_enabled())
            return fmt.value(y1), fmt.value(y2), False
        stateless = plan.stateless_parameter()
        if stateless is not None:
            raise RuntimeError(swapped_parameter_message(plan, *stateless))
        # A requires-grad dummy input makes autograd record the node even when x needs no grad
        # (frozen embeddings, LoRA): otherwise the blocks' parameters would silently get no grads.
        grad_anchor = torch.empty(0, device=x1.device, requires_grad=True)
        run.grad_anchor = grad_anchor
        run.param_ids = frozenset(id(p) for p in params)
        run.watch = StateWatch(plan, per_layer)
        run.walk_key = (tuple(x1.shape), x1.dtype, run.autocast.settings, run.dispatch,
                        tuple(c.requires_grad for c in cond_tensors))
        run.join = join and not fmt.exact
        out = ReversibleSegmentFunction.apply(run, x1, x2, grad_anchor, *cond_tensors)
        return (out, None, True) if run.join else (*out, True)

    def _raise_guard(self, failure, inputs, cond=None):
        raise self._guard_error(failure, inputs, cond)

    def _guard_error(self, failure, inputs, cond=None) -> Exception:
        """The error of a failed forward guard (``inputs``: the stack's input streams, for the float
        model's peak in the message; None when they are gone)."""
        if failure[0] == "nonfinite":
            return ValueError("input contains NaN or Inf: exact (fixed-point) streams need finite values")
        _, index, half = failure
        peak, peak_index = self._float_peak(inputs, cond) if inputs is not None else (None, -1)
        suggestion = ""
        if peak is not None and math.isfinite(peak) and peak > 0:
            # 2**(29 - fit) > 1.01 * peak: 1% of slack for the exact model's rounding.
            fit = int(math.ceil(STREAM_LIMIT_BITS - math.log2(1.01 * peak))) - 1
            at = "at its input" if peak_index < 0 else f"at layer {peak_index}"
            suggestion = (f"; the float model's streams peak at |value| = {peak:.4g} ({at}, over the whole stack), "
                          f"so frac_bits <= {fit} fits this input all the way through"
                          if fit >= 0 else f"; the float streams reach |value| = {peak:.4g}: too large for int32")
        elif peak is not None:
            suggestion = "; the float model itself produces non-finite values"
        where = f"the {half} half of layer {index}" if half != "input" else f"the input of layer {index}"
        return OverflowError(
            f"revtriton: the exact int32 stream left its range in {where} "
            f"(frac_bits={self.frac_bits} holds |value| < {2.0 ** (STREAM_LIMIT_BITS - self.frac_bits):.6g})"
            f"{suggestion}. "
            f"Lower frac_bits or use exact=False."
        )

    @torch.no_grad()
    def _float_peak(self, inputs, cond=None):
        """(largest |stream value|, layer where it is reached; -1: the input) of the float model over
        the whole stack, so one suggested frac_bits fits every layer (for the overflow message).

        Runs only when an overflow is being reported; the caller's RNG and buffers are left untouched.
        """
        x1, x2 = inputs
        if x1.dtype == torch.int32:
            x1, x2 = (from_fixed(s, self.frac_bits) for s in inputs)
        if x1.numel() == 0:
            return None, -1
        peaks = [torch.maximum(x1.abs().amax(), x2.abs().amax()).float()]
        saved_buffers = [(b, b.clone()) for b in self.buffers()]
        with torch.random.fork_rng(devices=[x1.device] if x1.is_cuda else []):
            for layer in self:
                if is_reversible_block(layer):

                    c = coupling_of(layer)

                    def peak_phase(f, g, x1=x1, x2=x2, c=c, rows=layer_rows(layer, self.chunk_rows)):
                        x1 = couple_by_rows(f, x1, x2, +1, None, cond, residual_scale(c.scale1), rows)[0]
                        x2 = couple_by_rows(g, x2, x1, +1, None, cond, residual_scale(c.scale2), rows)[0]
                        return (PhaseResult((x2, x1) if c.swap else (x1, x2)),)

                    x1, x2 = run_block_phase(layer, peak_phase)
                elif is_invertible_layer(layer):
                    x1, x2 = layer(x1, x2)
                else:
                    x1 = x2 = transition_output(layer, self.read(x1, x2), cond)
                peaks.append(torch.maximum(x1.abs().amax(), x2.abs().amax()).float())
        for buffer, value in saved_buffers:
            buffer.copy_(value)
        peaks = torch.stack(peaks)
        if not bool(torch.isfinite(peaks).all()):
            return math.inf, -1
        where = int(peaks.argmax())
        return float(peaks[where]), where - 1

    # -- inverse --------------------------------------------------------------------------

    @torch.no_grad()
    def inverse(self, y1: torch.Tensor, y2: torch.Tensor, cond=None):
        """Rebuild the stack's input streams from its output streams (bitwise in exact mode), with the
        conditioning the forward had.

        Stochastic layers (dropout, drop-path) are run with the current RNG: call it in eval mode.
        """
        cond = self._check_cond(cond)
        if self._fixed_pair("y", y1, y2):
            return self._run_fixed(y1, y2, inverse=True, cond=cond)
        fmt = self.stream_format(y1.dtype)
        s1, s2 = fmt.encode(y1), fmt.encode(y2)
        if fmt.exact:  # what forward's guards check, here at once (inverse is not a training hot path)
            if not (torch.isfinite(y1).all() and torch.isfinite(y2).all()):
                raise ValueError("y1 / y2 contain NaN or Inf: exact (fixed-point) streams need finite values")
            if bool(out_of_range(s1) | out_of_range(s2)):
                raise OverflowError(f"y1 / y2 exceed what exact streams hold at frac_bits={self.frac_bits} "
                                    f"(|value| < {2.0 ** (STREAM_LIMIT_BITS - self.frac_bits):.6g})")
        s1, s2 = self._invert(fmt, s1, s2, cond)
        return fmt.value(s1), fmt.value(s2)

    def _invert(self, fmt, s1, s2, cond):
        for i in reversed(range(len(self))):
            layer = self[i]
            if is_reversible_block(layer):
                c = coupling_of(layer)
                if fmt.exact and c.scaled:
                    raise ValueError(
                        f"layer {i} ({type(layer).__name__}) is a scaled coupling on exact streams: its forward drops "
                        f"the low bits of the scaled stream, which only the stack's own backward keeps, so the "
                        f"input cannot be rebuilt from the output alone (float streams can: exact=False)")
                if c.swap:
                    s1, s2 = s2, s1

                def inverse_phase(f, g, s1=s1, s2=s2, c=c, rows=layer_rows(layer, self.chunk_rows)):
                    values = fmt.for_block(f)
                    k = fmt.frac_bits
                    s2 = couple_by_rows(g, s2, values.value(s1), -1, k, cond, residual_scale(c.scale2), rows)[0]
                    s1 = couple_by_rows(f, s1, values.value(s2), -1, k, cond, residual_scale(c.scale1), rows)[0]
                    return (PhaseResult((s1, s2)),)

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
    def _run_fixed(self, s1, s2, inverse, cond=None):
        if not self.exact:
            raise TypeError("int32 streams are fixed-point streams: they need an exact=True stack")
        if s1.dtype != torch.int32 or s2.dtype != torch.int32:
            raise TypeError(f"both streams must be int32, got {s1.dtype} and {s2.dtype}")
        fmt = self.stream_format(None)  # no float input to take a dtype from: each block's parameters'
        if inverse:
            return self._invert(fmt, s1, s2, cond)
        for kind, index, item in plan_of(self).parts:
            if kind == "transition":
                raise ValueError(
                    f"layer {index} ({type(item).__name__}) is a stage transition: fixed-point streams can only "
                    f"run through reversible blocks and invertible layers"
                )
        guards = ForwardGuards()
        run = SegmentRun(list(self), 0, fmt, 0, self.schedule, guards=guards, token_chunk=self.chunk_rows)
        y1, y2, _, _ = _segment_forward(run, s1, s2, record=False, cond=cond)
        failure = guards.first_failure()
        if failure is not None:
            self._raise_guard(failure, (s1, s2), cond)
        return y1, y2
