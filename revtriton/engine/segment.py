"""One reversible segment: its forward (no grad, keeps only the final streams), and its autograd
Function whose backward rebuilds each layer's input from its output and gets the gradients from
that same recompute, as a backward schedule composes the two steps (revtriton.schedules)."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import get_gradient_edge

from ..halves.base import couple_half, half_part_output
from ..ops.dispatch import replayed
from ..ops.graph import backward_keeps_graph
from ..ops.streams import couple_output, stream_grad_dtype
from ..schedules import BlockGrads, Recovered, ScheduleTrace, run_backward_schedule
from .fsdp import PhaseResult, _AfterToken, _is_fsdp_module, run_block_phase
from .checks import StepChecks
from .guards import (CAPTURED_TENSOR_HINT, FIND_UNUSED_HINT, ForwardGuards, StreamFormat, _checksum,
                     captured_tensor_message, graph_leaves, reaches_foreign_leaf)
from .hooks import BlockHooks
from .protocol import coupling_of, is_reversible_block, residual_scale
from .plan import SegmentPlan
from .replay import AutocastState, HalfRandomness
from .rows import add_part, couple_by_rows, layer_rows, row_chunks, rows_of
from .state import (StateWatch, _buffer_starts, _buffer_versions, _check_input_untouched, _scratch_buffers,
                    _updated_buffers, _version_of)

_engine = torch.autograd.Variable._execution_engine
_NO_SCRATCH = contextlib.nullcontext()
_NO_DRAWS = contextlib.nullcontext()  # a half known to draw no random number: run as it is


DOUBLE_BACKWARD_MESSAGE = (
    "revtriton: a reversible stack does not support double backward (create_graph=True, as in gradient "
    "penalties or Hessian-vector products): its backward rebuilds each block outside the autograd graph, so "
    "second-order gradients through it would be wrong. Use a stored-activation twin of the model "
    "(revtriton.to_stored_activations(model), same weights) for the step that needs second-order gradients."
)


SECOND_BACKWARD_MESSAGE = (
    "revtriton: a reversible stack's backward ran a second time through the same forward, whose final streams "
    "its first backward freed (as autograd frees saved tensors). Pass retain_graph=True to the first backward "
    "to run it again."
)


def _accumulates_into_leaves(anchor) -> bool:
    """Whether the running backward accumulates into every leaf (``loss.backward()``) or only computes
    what was asked for (``torch.autograd.grad(loss, x)``, ``loss.backward(inputs=...)``).

    The segment's node has an edge to its requires-grad dummy input; autograd runs that leaf's
    accumulator only in a backward that fills ``.grad`` of all leaves, so block parameters (which
    are not in the outer graph) get gradients exactly then.
    """
    node = torch._C._current_autograd_node()
    if node is None:
        return True
    for fn, _ in node.next_functions:
        if fn is not None and getattr(fn, "variable", None) is anchor:
            return torch._C._will_engine_execute_node(fn)
    return True


def _requested_or_reached(accumulator) -> bool:
    """Whether the running backward reaches a leaf's accumulator: ``backward(inputs=...)`` answers;
    ``torch.autograd.grad`` refuses to answer for a leaf it captures (RuntimeError "A leaf node was
    passed ...": that leaf is one it was asked for), and answers False for one it does not reach."""
    try:
        return torch._C._will_engine_execute_node(accumulator)
    except RuntimeError:
        return True


def _refuse_requested_block_parameters(run):
    """Raise when ``torch.autograd.grad`` or ``backward(inputs=...)`` asks for a block parameter that the
    outer graph reaches (a module used inside a half and also before the stack): autograd would
    return its outside part alone, as if the stack did not use it (block parameters get their
    gradients from ``loss.backward()`` only). A parameter only the stack uses is not in the outer
    graph: autograd itself refuses it. Run only in such a backward, not in ``loss.backward()``."""
    for i, layer in enumerate(run.layers):
        for name, p in layer.named_parameters():
            if p.requires_grad and _requested_or_reached(get_gradient_edge(p).node):
                raise RuntimeError(
                    f"revtriton: the gradient of {name} (layer {run.first_index + i}) was asked for with "
                    f"torch.autograd.grad or backward(inputs=...), and the graph reaches it outside the stack too "
                    f"(a module used both inside a half and outside): autograd would return only the outside part. "
                    f"Block parameters get their gradients from loss.backward(): call it and read .grad")


@dataclass
class SegmentRun:
    """Everything a segment's forward records for its backward (besides the saved streams)."""

    layers: list
    first_index: int  # index of layers[0] in the stack, for error messages
    fmt: StreamFormat
    anchor_every: int
    schedule: str
    guards: ForwardGuards | None = None
    rng_states: list = field(default_factory=list)  # per layer: (F's, G's HalfRandomness start states) or None
    low_bits: list = field(default_factory=list)  # per layer: the bits exact scaled couplings dropped, or None
    autocast: AutocastState | None = None
    dispatch: tuple | None = None  # where ops ran in forward (ops.dispatch.capture_state), replayed in backward
    anchor_layers: list = field(default_factory=list)
    trace: ScheduleTrace | None = None
    checks: StepChecks | None = None
    watch: StateWatch | None = None  # modes and parameter versions at forward (set when a graph is recorded)
    updated_buffers: dict = field(default_factory=dict)  # layer -> [(module, name, start)] the forward updated
    grad_anchor: torch.Tensor | None = None  # the segment node's requires-grad dummy input
    param_ids: frozenset = frozenset()  # ids of the layers' parameters at forward (for the captured-tensor check)
    cond_is_tuple: bool = False  # the conditioning was given as a tuple of tensors (else one tensor)
    plan: SegmentPlan | None = None  # the layers' modules, parameters, buffers, RNG draws (engine.plan)
    walk_key: tuple | None = None  # what a rebuilt half's graph depends on besides the plan (shapes, modes)
    join: bool = False  # float streams, the stack's split output: return one tensor whose halves are the kept streams
    token_chunk: int | None = None  # rows a chunk of the rows-independent halves (engine.rows), None: whole

    def chunk_rows(self, layer) -> int | None:
        """The rows a chunk for this layer's halves (engine.rows.layer_rows)."""
        return layer_rows(layer, self.token_chunk)

    def cond_value(self, tensors):
        """The conditioning as halves get it, from its tensors (the node's inputs, or their leaves in backward)."""
        if not tensors:
            return None
        return tuple(tensors) if self.cond_is_tuple else tensors[0]


def _segment_forward(run: SegmentRun, s1: torch.Tensor, s2: torch.Tensor, record: bool, cond=None,
                     check_captured: bool = False):
    """Run the segment's layers on streams. Returns final streams, anchors, checksums.

    ``record``: keep what the backward needs (RNG states, anchors, checksums, updated buffers).
    ``cond``: the conditioning handed to halves that take it.
    ``check_captured``: the caller runs a frozen segment (nothing in it requires grad) in grad mode,
    so a half output that requires grad used a tensor from outside the stack that does.
    """
    fmt, k = run.fmt, run.fmt.frac_bits
    anchors, checksums = [], []
    checksummed = fmt.exact and record
    if checksummed:
        checksums.append(_checksum(s1, s2))
    if fmt.exact and run.guards is not None:
        run.guards.add_range(("overflow", run.first_index, "input"), s1, s2)
    layer_plans = run.plan.layers if run.plan is not None else [None] * len(run.layers)
    for i, (layer, lp) in enumerate(zip(run.layers, layer_plans)):
        index = run.first_index + i
        if record and run.anchor_every and i > 0 and i % run.anchor_every == 0:
            run.anchor_layers.append(i)
            anchors += [s1, s2]
        buffers = run.watch.buffers[i] if record and run.watch is not None else ()
        versions = _buffer_versions(buffers) if buffers else ()
        starts = _buffer_starts(buffers, lp.bumped if lp is not None else None) if buffers else ()
        if lp.is_block if lp is not None else is_reversible_block(layer):
            hooks = BlockHooks.of(layer)
            if hooks is not None and hooks.has_forward:
                values = fmt.for_block(layer.coupling_halves()[0])
                hook_args = (values.value(s1), values.value(s2))
                hooks.forward_pre(hook_args, index)

            coupling = lp.coupling if lp is not None else coupling_of(layer)
            # Which halves draw random numbers, and how: known from the plan, or probed now (None:
            # both run under HalfRandomness.recorded with routing, which sees how they draw).
            draws = (lp.draws if lp is not None else None) if record else (False, False)
            routing = lp.routing if lp is not None else (True, True)

            def forward_phase(f, g, s1=s1, s2=s2, index=index, coupling=coupling, draws=draws, routing=routing, lp=lp):
                values = run.fmt.for_block(f)
                scale1, scale2 = residual_scale(coupling.scale1), residual_scale(coupling.scale2)
                # Exact scaled couplings drop the low bits of the scaled stream: kept for the inverse.
                keep_bits = record and fmt.exact
                low1 = scale1.dropped_bits(s1) if keep_bits and scale1 is not None else None
                low2 = scale2.dropped_bits(s2) if keep_bits and scale2 is not None else None
                states = []  # what each half that may draw drew (HalfRandomness.recorded)
                x = values.value(s2)
                version = _version_of(x)
                rows = run.chunk_rows(layer)
                with _recording(draws, 0, states, routing[0]):
                    y1, port_f = couple_by_rows(f, s1, x, +1, k, cond, scale1, rows)
                state_f = states.pop() if states else None
                _check_input_untouched(x, version, "F", index)
                x = values.value(y1)
                version = _version_of(x)
                with _recording(draws, 1, states, routing[1]):
                    y2, port_g = couple_by_rows(g, s2, x, +1, k, cond, scale2, rows)
                state_g = states.pop() if states else None
                _check_input_untouched(x, version, "G", index)
                if lp is not None and (draws is None or "global" in draws):  # probed: later forwards
                    lp.draws = (_draw_kind(state_f), _draw_kind(state_g))  # record as the halves drew
                if check_captured:
                    for half, port in (("F", port_f), ("G", port_g)):
                        if port is not None:
                            raise RuntimeError(captured_tensor_message(f"the {half} half of layer {index}"))
                if coupling.swap:
                    y1, y2 = y2, y1
                return (PhaseResult((y1, y2, state_f, state_g, (low1, low2))),)

            y1, y2, state_f, state_g, low_bits = run_block_phase(layer, forward_phase)
            if hooks is not None and hooks.has_forward:
                hooks.forward_post(hook_args, (values.value(y1), values.value(y2)), index)
            if fmt.exact and run.guards is not None:
                run.guards.add_range(("overflow", index, "F"), y1)
                run.guards.add_range(("overflow", index, "G"), y2)
            if record:
                run.rng_states.append((state_f, state_g))
                run.low_bits.append(low_bits)
            s1, s2 = y1, y2
        else:
            if record:
                run.rng_states.append(None)
                run.low_bits.append(None)
            s1, s2 = layer(s1, s2)
            if check_captured and (s1.requires_grad or s2.requires_grad):
                raise RuntimeError(captured_tensor_message(f"layer {index}"))
        if buffers:
            bumped = _updated_buffers(buffers, versions, starts)
            if lp is not None:  # later forwards copy only these before the layer runs
                lp.bumped = (lp.bumped or set()) | {(m, name) for m, name, _ in bumped}
            stats = run.watch.running_stats[i]
            updated = [(m, name, None) for m, name in stats] + [e for e in bumped if (e[0], e[1]) not in stats]
            if updated:
                run.updated_buffers[i] = updated
        if checksummed:
            checksums.append(_checksum(s1, s2))
    return s1, s2, anchors, checksums


def _recording(draws, half: int, states: list, routing: bool = True):
    """The context a half's forward runs in: ``draws`` is the plan's (kind of F, kind of G), or None
    (not known yet: probe); a kind is False (draws nothing), "own" (asks for the half's generator:
    halves.randomness), "routed" (draws with no generator: the routing mode) or "global" (draws the
    routing cannot reach: replayed from the global generators' state, engine.replay.GlobalStart).
    ``routing`` False (a half running compiled code, engine.plan.runs_compiled_code): no routing
    mode, draws with no generator are "global"."""
    if draws is None:
        return HalfRandomness.recorded(states, routing=routing)
    kind = draws[half]
    return HalfRandomness.recorded(states, kind, routing) if kind else _NO_DRAWS


def _draw_kind(recorded) -> bool | str:
    return False if recorded is None else recorded.kind


def _index_low_bits(low_bits: list):
    """(the tensors of ``low_bits``, ``low_bits`` with each tensor replaced by its index among them)."""
    tensors, entries = [], []
    for pair in low_bits:
        if pair is None or all(t is None for t in pair):
            entries.append(None)
            continue
        entry = []
        for t in pair:
            entry.append(None if t is None else len(tensors))
            if t is not None:
                tensors.append(t)
        entries.append(tuple(entry))
    return tensors, entries


def _low_bits_of(entry, tensors):
    return None if entry is None else tuple(None if j is None else tensors[j] for j in entry)


class ReversibleSegmentFunction(torch.autograd.Function):
    """Autograd node of one reversible segment: saves only its final streams (and anchors)."""

    @staticmethod
    def forward(ctx, run: SegmentRun, x1, x2, grad_anchor, *cond):
        # ``cond``: the conditioning's tensors, inputs of the node so that their gradient (every
        # half's contribution, summed) flows back to whatever computed them.
        fmt = run.fmt
        s1 = fmt.encode(x1)
        s2 = s1 if x2 is x1 else fmt.encode(x2)
        y1, y2, anchors, checksums = _segment_forward(run, s1, s2, record=True, cond=run.cond_value(cond))
        if run.watch is not None:
            run.watch.record_versions()
        ctx.run = run
        checksum = torch.stack(checksums) if checksums else None
        ctx.has_checksum = checksum is not None
        ctx.num_cond = len(cond)
        # Saved, not kept on run: autograd then raises if the conditioning is modified in place before backward.
        # The bits exact scaled couplings dropped are saved tensors too (saved-tensor hooks such as
        # save_on_cpu apply to them); run.low_bits keeps their positions among them.
        low_tensors, run.low_bits = _index_low_bits(run.low_bits)
        ctx.num_low = len(low_tensors)
        ctx.save_for_backward(*cond, *low_tensors, *anchors, *([checksum] if checksum is not None else []))
        # The final streams are kept on ctx, not saved: autograd frees saved tensors only once the node's
        # backward returns, while the backward drops these as soon as the last layer is rebuilt from them
        # (RevTorch does the same). Their versions stand in for autograd's in-place check.
        out1, out2 = fmt.value(y1), fmt.value(y2)
        # Outputs must not alias the inputs (autograd would take them for views of them). Float streams
        # return the kept streams themselves and keep detached aliases of them (one storage, one version
        # counter, no reference cycle through the outputs' grad_fn): an in-place change of an output is
        # then an in-place change of the kept stream, which the version check catches.
        if out1 is x1 or out1 is x2:
            out1 = out1.clone()
        if out2 is x1 or out2 is x2 or out2 is out1:
            out2 = out2.clone()
        ctx.joined = run.join and not fmt.exact
        if ctx.joined:  # the stack's split output is concatenated anyway: keep its halves, not a copy
            joined = torch.cat([out1, out2], dim=-1)
            y1, y2 = joined.detach().chunk(2, dim=-1)
            out1, out2 = joined, None
        if out1 is y1:
            y1 = y1.detach()
        if out2 is y2:
            y2 = y2.detach()
        ctx.streams = [y1, y2]
        ctx.stream_versions = (_version_of(y1), _version_of(y2))
        return out1 if ctx.joined else (out1, out2)

    @staticmethod
    def backward(ctx, *grads):
        dy1, dy2 = ((None, None) if grads[0] is None else grads[0].chunk(2, dim=-1)) if ctx.joined else grads
        run: SegmentRun = ctx.run
        if torch.is_grad_enabled():  # the engine runs a backward with create_graph=True in grad mode
            raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)
        if run.watch is not None:
            run.watch.check()
        streams = ctx.streams
        if streams is None:
            raise RuntimeError(SECOND_BACKWARD_MESSAGE)
        if (_version_of(streams[0]), _version_of(streams[1])) != ctx.stream_versions:
            raise RuntimeError("revtriton: the streams a reversible segment's backward starts from were modified in "
                               "place after its forward (an in-place op on what a stack's invertible layer returned "
                               "unchanged): its gradients would be wrong")
        if not backward_keeps_graph():  # then the streams stay for the next backward
            ctx.streams = None  # the schedule empties ``final`` once the last layer is rebuilt: then they are freed
        final = list(streams)
        del streams
        saved = ctx.saved_tensors
        cond = saved[: ctx.num_cond]
        low_tensors = saved[ctx.num_cond : ctx.num_cond + ctx.num_low]
        checksum = saved[-1] if ctx.has_checksum else None
        anchor_tensors = saved[ctx.num_cond + ctx.num_low : len(saved) - (1 if ctx.has_checksum else 0)]
        anchors = {
            layer: (anchor_tensors[2 * j], anchor_tensors[2 * j + 1]) for j, layer in enumerate(run.anchor_layers)
        }
        like = final[0]
        grad_dtype = stream_grad_dtype(run.fmt.value_dtype) if run.fmt.exact else like.dtype
        # The schedule carries the negated gradients (see _SegmentBackward._block_grads): fresh tensors here.
        grads = [torch.zeros(like.shape, dtype=grad_dtype, device=like.device) if dy is None else torch.neg(
            dy.to(grad_dtype)) for dy in (dy1, dy2)]
        del like, dy1, dy2
        # One leaf per conditioning tensor for the whole segment: every half's rebuild uses it, so its
        # .grad sums their contributions, in backward order (as autograd sums the uses of a tensor).
        cond_leaves = tuple(c.detach().requires_grad_() if c.requires_grad else c.detach() for c in cond)
        accumulate = _accumulates_into_leaves(run.grad_anchor)
        if not accumulate:
            _refuse_requested_block_parameters(run)
        stepper = _SegmentBackward(run, anchors, checksum, accumulate, cond_leaves,
                                   [_low_bits_of(entry, low_tensors) for entry in run.low_bits])
        stepper._owned = tuple(grads)
        try:
            # Every block is rebuilt as the forward ran it: with grad, the forward's autocast and dispatch
            # state, each half's random draws (replayed from its own generators: the caller's are untouched).
            with torch.enable_grad(), run.autocast.restored(), replayed(run.dispatch):
                n1, n2, rebuilt_checksums = run_backward_schedule(run.schedule, stepper, final, grads, run.trace)
        except RuntimeError as error:
            if "mark a variable ready only once" in str(error):  # DDP(find_unused_parameters=True)
                raise RuntimeError(FIND_UNUSED_HINT) from error
            if "backward through the graph a second time" in str(error):  # saved tensors are ours: intact
                raise RuntimeError(CAPTURED_TENSOR_HINT) from error
            raise
        if rebuilt_checksums is not None:  # resolved when the whole backward has run (engine.checks)
            # One comparison per segment (not per block): flags in backward order, as the rebuilds ran.
            forward_checksums = checksum[:len(rebuilt_checksums)].flip(0)
            mismatch = (rebuilt_checksums != forward_checksums).any(1)
            # The stack's rebuilt input stands in for its input in an overflow's message.
            rebuilt = stepper.rebuilt_input if run.first_index == 0 else None
            run.checks.add(run.first_index + len(run.layers) - 1, mismatch, rebuilt)
        return (None, torch.neg(n1), torch.neg(n2), None,
                *(leaf.grad if leaf.requires_grad else None for leaf in cond_leaves))


class _HalfInput:
    """Where a rebuilt half's input gets its gradient: a leaf sharing the stream's storage (float
    streams), or a storage-less leaf its float value is computed from (exact streams:
    StreamFormat.differentiable_value), so the engine keeps no copy of the value alive: the half's
    graph keeps it only if an op saves it."""

    __slots__ = ("leaf", "grad")

    def __init__(self):
        self.leaf = None
        self.grad = None  # a half rebuilt by chunks of rows: their gradients, put together (see _RowChunks)

    def gradient(self):
        return self.leaf.grad if self.leaf is not None else self.grad

    def attach(self, stream: torch.Tensor, fmt: StreamFormat) -> torch.Tensor:
        """The tensor the half takes: the stream's value, whose gradient ``gradient()`` then returns."""
        if fmt.exact:
            self.leaf, value = fmt.differentiable_value(stream)
            return value
        self.leaf = stream.detach().requires_grad_()
        return self.leaf

    def subtract_from(self, n: torch.Tensor, owned: bool = False):
        """``(n - the input's gradient, fresh)``: ``n`` itself (fresh False) when none arrived (``n`` is a
        negated gradient: see _block_grads). The difference goes in place where that is safe: into ``n``
        when the engine owns it (the leaf's gradient then goes with the leaf), else into the leaf's
        gradient (autograd's own buffer, which nothing else holds); the bits are those of ``n - grad``
        either way."""
        g = self.gradient()
        if g is None:
            return n, False
        if g.shape == n.shape:
            dtype = torch.result_type(n, g)
            if owned and n.dtype == dtype:  # (the leaf's gradient goes with the leaf)
                return n.sub_(g), True
            if g.dtype == dtype:
                return torch.sub(n, g, out=g), True
        return n - g, True


class _RowChunks:
    """A half rebuilt chunk by chunk of rows (engine.rows) whose gradients run later (PaReprop's
    recover, or a block with backward hooks): each chunk's port and input, until :meth:`backward`
    runs them and puts the inputs' gradients together."""

    __slots__ = ("chunks", "bounds", "ports", "inputs", "negated")

    def __init__(self, chunks):
        self.chunks = chunks  # engine.rows.RowChunks: how a chunk's rows are viewed
        self.bounds, self.ports, self.inputs, self.negated = [], [], [], []

    def add(self, bounds, port, half_input, negated: bool = False):
        """A chunk's port (``negated``: a part's output, which takes minus the stream's gradient)."""
        if port is not None:
            self.bounds.append(bounds)
            self.ports.append(port)
            self.inputs.append(half_input)
            self.negated.append(negated)

    def backward(self, segment, grad: torch.Tensor, into: _HalfInput):
        """Every chunk's backward with its rows of ``grad``; their input gradients go into ``into`` (a
        half in parts: each part's port after the last, one input leaf a chunk, its rows written again
        with the sum so far)."""
        last, params = len(self.ports) - 1, None
        for k, ((start, stop), port, half_input, negated) in enumerate(zip(self.bounds, self.ports, self.inputs,
                                                                           self.negated)):
            rows = self.chunks.view(grad, start, stop)
            if negated:  # a part's output (engine.rows): its own parameters, minus the stream's gradient
                segment._chunk_backward(port, -rows, half_input, k == last)
            else:
                params = segment._chunk_backward(port, rows, half_input, k == last, params)
            _put_rows(into, half_input.gradient(), start, stop, grad)  # (a chunk's parts: the sum so far)
        self.ports = self.inputs = ()


def _put_rows(into: _HalfInput, chunk_grad, start: int, stop: int, like: torch.Tensor, add: bool = False):
    """Write a chunk's input gradient into rows ``start:stop`` of ``into.grad`` (made at the first one, in
    ``like``'s shape, zeros where no chunk's gradient arrives); ``add``: add it there (a half's later part)."""
    if chunk_grad is None:
        return
    if into.grad is None:
        into.grad = torch.zeros(like.shape, dtype=chunk_grad.dtype, device=chunk_grad.device)
    rows = rows_of(into.grad)[start:stop]
    if add:
        rows.add_(rows_of(chunk_grad).to(rows.dtype))
    else:
        rows.copy_(rows_of(chunk_grad))


@dataclass(eq=False)
class _BlockRebuild:
    """One reversible block in backward: its output streams, what its rebuild makes (G's half, then
    F's) and the graphs its gradients need; the streams are dropped as soon as they are used."""

    index: int
    layer: object
    coupling: object
    y1: torch.Tensor | None  # the block's output streams (a swapped block's in coupling order)
    y2: torch.Tensor | None
    scale1: object
    scale2: object
    state_f: object
    state_g: object
    token_leaf: torch.Tensor | None  # FSDP2 layers only
    token: torch.Tensor | None = None  # the token as the rebuild phase got it (FSDP2's view of token_leaf)
    x1: torch.Tensor | None = None
    x2: torch.Tensor | None = None
    port_g: torch.Tensor | _RowChunks | None = None
    port_f: torch.Tensor | _RowChunks | None = None
    input_g: _HalfInput | None = None  # G's input, y1's value
    input_f: _HalfInput | None = None  # F's input, x2's value


class _SegmentBackward:
    """The per-layer steps a backward schedule composes: recover (rebuild) and grads, or step (both,
    one half at a time: the sequential schedule)."""

    def __init__(self, run: SegmentRun, anchors: dict, checksum, accumulate: bool = True, cond_leaves=(),
                 low_bits=()):
        self.run = run
        self.anchors = anchors
        self.checksum = checksum
        self.low_bits = low_bits  # per layer: (bits dropped from x1, from x2) by an exact scaled coupling
        self.num_layers = len(run.layers)
        # False in torch.autograd.grad(loss, x) and backward(inputs=...): only the streams' (and the
        # conditioning's) grads are computed, no parameter's .grad is touched.
        self.accumulate = accumulate
        self.cond_leaves = cond_leaves
        self.cond = run.cond_value(cond_leaves)
        self.grad_leaves = [leaf for leaf in cond_leaves if leaf.requires_grad]
        self._owned = ()  # the input grads the last step() made (fresh tensors nothing else holds)
        self.rebuilt_input = None  # the segment's input streams, as the schedule rebuilt them last

    def streams_entering(self, i, rebuilt):
        """The output streams of layer i: the exact anchor when one was kept, else ``rebuilt``."""
        return self.anchors.get(i + 1, rebuilt)

    # -- a reversible block, half by half ------------------------------------------------------

    def _begin(self, i: int, streams) -> _BlockRebuild:
        y1, y2 = self.streams_entering(i, streams)
        layer = self.run.layers[i]
        coupling = coupling_of(layer)
        if coupling.swap:
            y1, y2 = y2, y1
        kept = self.low_bits[i] if self.low_bits else None
        low1, low2 = kept if kept is not None else (None, None)
        state_f, state_g = self.run.rng_states[i]
        # FSDP2's post-backward token (see _rebuild_f); other layers need none.
        token = torch.empty(0, device=y1.device, requires_grad=True) if _is_fsdp_module(layer) else None
        return _BlockRebuild(i, layer, coupling, y1, y2, residual_scale(coupling.scale1, low1),
                             residual_scale(coupling.scale2, low2), state_f, state_g, token)

    def _in_phase(self, rb: _BlockRebuild, work, with_token: bool = False):
        """``work`` in one phase call of the block (FSDP2 gathers its parameters; the phase that rebuilds G
        takes the post-backward token as its tensor argument). Grad mode, autocast and dispatch are the
        forward's: the segment's backward set them once for all its blocks."""
        token = (rb.token_leaf,) if with_token and rb.token_leaf is not None else ()
        run_block_phase(rb.layer, work, *token)

    def _rebuild_g(self, rb: _BlockRebuild, g, token=None, grad=None, into=None) -> torch.Tensor | None:
        """x2 = y2 - G(y1), keeping G's graph; drops y2. Returns G's input (for FSDP2's pre-backward hook).

        A G run by chunks of rows (engine.rows) is rebuilt chunk by chunk; with ``grad`` (the gradient of
        y2, the sequential step's) each chunk's backward runs right after its rebuild, so one chunk's
        graph is alive at a time, and ``rb.input_g`` gets the gradient of y1 itself, or ``into`` (the
        negated gradient it is subtracted from, when the engine owns it) has it subtracted, chunk by chunk."""
        run, fmt = self.run, self.run.fmt
        rb.token = token
        chunks = row_chunks(g, rb.y2, run.chunk_rows(rb.layer), self.cond, rb.scale2)
        if chunks is not None:
            x2, rb.port_g, rb.input_g = self._rebuild_by_rows(rb, g, "G", rb.y2, rb.y1, rb.state_g, chunks, grad,
                                                              into)
            rb.x2, rb.y2 = x2, None
            return None
        rb.input_g = _HalfInput()
        y1_value = rb.input_g.attach(rb.y1, fmt)
        with HalfRandomness.replayed(rb.state_g):
            x2, rb.port_g = couple_half(g, rb.y2, y1_value, -1, fmt.frac_bits, self.cond, rb.scale2)
        rb.x2, rb.y2 = x2.detach(), None  # the output stream G's rebuild consumed is not needed any more
        self._check_captured(rb, "G", rb.port_g, rb.input_g.leaf)
        return y1_value

    def _rebuild_f(self, rb: _BlockRebuild, f, grad=None, into=None):
        """x1 = y1 - F(x2), keeping F's graph (its input joined to FSDP2's post-backward token); drops y1.
        By chunks of rows as :meth:`_rebuild_g` (no FSDP2 token then: engine.rows)."""
        run, fmt = self.run, self.run.fmt
        chunks = row_chunks(f, rb.y1, run.chunk_rows(rb.layer), self.cond, rb.scale1)
        if chunks is not None:
            x1, rb.port_f, rb.input_f = self._rebuild_by_rows(rb, f, "F", rb.y1, rb.x2, rb.state_f, chunks, grad,
                                                              into)
            rb.x1, rb.y1 = x1, None
            return
        rb.input_f = _HalfInput()
        x2_value = rb.input_f.attach(rb.x2, fmt)
        if rb.token_leaf is not None:  # (only FSDP2's post-backward hook waits on the token)
            x2_value = _AfterToken.apply(x2_value, rb.token)
        with HalfRandomness.replayed(rb.state_f):
            x1, rb.port_f = couple_half(f, rb.y1, x2_value, -1, fmt.frac_bits, self.cond, rb.scale1)
        rb.x1, rb.y1 = x1.detach(), None
        # ``token`` here may be FSDP2's view of the token passed in (``token_leaf``), the leaf the graph reaches.
        self._check_captured(rb, "F", rb.port_f, rb.input_f.leaf, *(() if rb.token_leaf is None else (rb.token_leaf,)))

    def _rebuild_by_rows(self, rb: _BlockRebuild, half, name: str, res, other, state, chunks, grad, into=None):
        """``res - H(value of other)`` chunk by chunk of rows: ``(rebuilt stream, port, input)``. With
        ``grad`` each chunk's backward runs at once (port None, the input holding the gradient put
        together); without, the port is a :class:`_RowChunks` whose backward runs later. ``into``: a
        negated gradient of the engine's own that the input's gradient is subtracted from (see
        _HalfInput.subtract_from): each chunk's goes into its rows at once, where the dtypes allow (the
        same bits as the whole ``into - grad``), so the whole gradient is never held."""
        fmt = self.run.fmt
        out = torch.empty(res.shape, dtype=res.dtype, device=res.device)
        out_rows = rows_of(out)
        if into is not None and not into.is_contiguous():  # its rows would be a copy's, not views of it
            into = None
        whole, later, params = _HalfInput(), _RowChunks(chunks), None
        with HalfRandomness.replayed(state):
            for start, stop in chunks.bounds:
                half_input = _HalfInput()
                value = half_input.attach(chunks.view(other, start, stop), fmt)
                cond = chunks.cond(half, self.cond, start, stop)
                if chunks.parts > 1:
                    stream = self._rebuild_parts(rb, half, name, chunks, res, value, half_input, cond, start, stop,
                                                 grad, into, whole, later, other)
                    out_rows[start:stop] = rows_of(stream)
                    continue
                stream, port = couple_half(half, chunks.view(res, start, stop), value, -1, fmt.frac_bits, cond)
                out_rows[start:stop] = rows_of(stream.detach())
                self._check_captured(rb, name, port, half_input.leaf)
                if grad is None:
                    later.add((start, stop), port, half_input)
                elif port is not None:
                    last = stop == chunks.bounds[-1][1]
                    params = self._chunk_backward(port, chunks.view(grad, start, stop), half_input, last, params)
                    self._take_input_gradient(half_input, into, whole, start, stop, other)
        return out, (later if grad is None and later.ports else None), whole

    def _take_input_gradient(self, half_input: _HalfInput, into, whole: _HalfInput, start: int, stop: int, other,
                             add: bool = False):
        """A chunk's input gradient subtracted from ``into``'s rows where the dtypes allow, else written into
        (``add``: added to) ``whole``'s (see :meth:`_rebuild_by_rows`)."""
        chunk_grad = half_input.gradient()
        if into is not None and chunk_grad is not None and torch.result_type(into, chunk_grad) == into.dtype:
            rows_of(into)[start:stop].sub_(rows_of(chunk_grad))
        else:
            _put_rows(whole, chunk_grad, start, stop, other, add=add)

    def _rebuild_parts(self, rb: _BlockRebuild, half, name: str, chunks, res, value, half_input: _HalfInput, cond,
                       start: int, stop: int, grad, into, whole: _HalfInput, later: "_RowChunks", other):
        """Rows ``start:stop`` of ``res - H(value)`` for a half in parts (engine.rows): each part's output
        computed with its graph, its gradients run at once (the port's gradient, negated: ``res - H``'s
        port hands ``H`` minus the stream's) and its input gradient taken, before the next part; the parts'
        sum coupled once, as the forward coupled it. Without ``grad`` each part's output is kept for
        ``later`` (PaReprop's recover)."""
        fmt, neg_grad, total = self.run.fmt, None, None
        for part in range(chunks.parts):
            h = half_part_output(half, part, chunks.parts, value, cond)
            total = add_part(total, h.detach())
            port = h if h.requires_grad else None
            self._check_captured(rb, name, port, half_input.leaf)
            if grad is None:
                later.add((start, stop), port, half_input, negated=True)
            elif port is not None:
                if neg_grad is None:
                    neg_grad = torch.neg(chunks.view(grad, start, stop))
                last = stop == chunks.bounds[-1][1] and part == chunks.parts - 1
                # (each part's own parameters: a part's graph need not reach them all, the out bias)
                self._chunk_backward(port, neg_grad, half_input, last)
                self._take_input_gradient(half_input, into, whole, start, stop, other, add=part > 0)
                if half_input.leaf is not None:
                    half_input.leaf.grad = None  # (taken: the next part's arrives alone)
        with torch.no_grad():
            return couple_output(chunks.view(res, start, stop), total, -1, fmt.frac_bits)[0]

    def _chunk_backward(self, port, grad, half_input: _HalfInput, last: bool, params=None):
        """One chunk's backward; returns the half's parameters (``params`` the next chunk may pass back).

        The parameters' gradients of every chunk but the last are added into their ``.grad`` here, the
        last one's through autograd's accumulation: so a parameter's gradient hooks (DDP's reducer,
        ``register_post_accumulate_grad_hook``) fire once a backward, as for a half run whole, with the
        whole gradient. The parameters are the leaves the first chunk's graph reaches (every chunk's
        graph is the same ops; the captured-tensor check admits only the segment's own leaves)."""
        leaf = half_input.leaf
        if last or not self.accumulate:
            self._backward(port, grad, [leaf])
            return params
        if params is None:
            own = {id(leaf), *(id(c) for c in self.cond_leaves)}
            params = [p for p in graph_leaves(port) if id(p) not in own]
        inputs = (leaf, *self.grad_leaves, *params)
        grads = _engine.run_backward((port,), (grad,), False, False, inputs, True, False)
        with torch.no_grad():
            for t, g in zip(inputs, grads):
                if g is None:
                    continue
                if t.grad is None:  # (a copy: autograd's result may be a view of a buffer it shares)
                    t.grad = g.clone(memory_format=torch.contiguous_format)
                else:
                    t.grad.add_(g)
        return params

    def _half_backward(self, port, grad, half_input: _HalfInput):
        """A rebuilt half's backward with the gradient of its output stream (none left to run: None)."""
        if isinstance(port, _RowChunks):
            port.backward(self, grad, half_input)
        elif port is not None:
            self._backward(port, grad, [half_input.leaf])

    def _check_captured(self, rb: _BlockRebuild, half: str, port, *leaves):
        """Raise if the rebuilt half's graph reaches a leaf from outside the stack (reaches_foreign_leaf).

        The walk runs once per half and ``run.walk_key`` (input shape and dtype, autocast and dispatch
        state, which conditioning tensors require grad) of a plan: the plan is rebuilt, and the halves
        walked again, when a module, parameter, buffer or attribute is assigned or removed, a training
        flag or a dropout rate changes, or a tensor attribute is replaced or starts requiring grad
        (engine.plan). FSDP2 layers are walked every time (their parameters are other objects at every
        gather)."""
        plan, run = self.run.plan, self.run
        key = None if plan is None or rb.token_leaf is not None else (rb.index, half, run.walk_key)
        if key is not None and key in plan.captured_checked:
            return
        # In the phase, where FSDP2's gathered parameters are the module's.
        is_own = self._own_leaf_test(rb.layer, *leaves)
        if reaches_foreign_leaf(port, is_own):
            raise RuntimeError(captured_tensor_message(f"the {half} half of layer {run.first_index + rb.index}"))
        if key is not None and port is not None:
            plan.captured_checked.add(key)

    def _checked(self, recovered: Recovered) -> Recovered:
        if self.checksum is not None:
            recovered.checksum = _checksum(*recovered.inputs)
        return recovered

    def _owns(self, t: torch.Tensor) -> bool:
        return any(t is mine for mine in self._owned)

    def _block_grads(self, rb: _BlockRebuild, n1, n2, owned=(False, False), rebuild_f=None):
        """The two local backward calls of a block; ``rebuild_f`` (step) rebuilds F between them.

        ``n1``, ``n2`` are the *negated* gradients of the block's outputs, as the whole segment backward
        carries them: the rebuild computes ``x2 = y2 - G(y1)``, so ``backward(x2, -dy2)`` gives G's
        gradients of the forward's ``y2 = x2 + G(y1)``, and carrying ``-dy`` from block to block
        (negated once per segment, not twice per half) hands each port its gradient as it is. Negation
        is exact, so the bits are those of negating per half. Returns ``(BlockGrads, mine)``: the
        negated input grads, and ``mine``, those made here that nothing else holds."""
        hooks = BlockHooks.of(rb.layer)
        owned1, owned2 = owned
        if hooks is not None:  # hooks see and give the gradients themselves
            grad_out = hooks.backward_before(-n1, -n2)
            n1, n2 = -grad_out[0], -grad_out[1]
        coupling = rb.coupling
        if coupling.swap:  # the gradients of the block's outputs (y2, y1)
            n1, n2 = n2, n1
            owned1, owned2 = owned2, owned1
        self._half_backward(rb.port_g, n2, rb.input_g)
        rb.port_g = None
        n1, fresh = rb.input_g.subtract_from(n1, owned1)
        owned1 = owned1 or fresh
        rb.input_g = None
        if rebuild_f is not None:  # (F's input gradient may go straight into n2, G's done with it)
            rebuild_f(n1, n2 if owned2 and coupling.scale2 == 1.0 and n2 is not n1 else None)
        self._half_backward(rb.port_f, n1, rb.input_f)
        rb.port_f = None
        # y1 = a * x1 + F(x2), y2 = b * x2 + G(y1): the streams' own paths carry a and b.
        nx1 = n1 if coupling.scale1 == 1.0 else n1 * coupling.scale1
        nx2 = n2 if coupling.scale2 == 1.0 else n2 * coupling.scale2
        nx2, fresh = rb.input_f.subtract_from(nx2, owned2 or coupling.scale2 != 1.0)
        rb.input_f = None
        if hooks is not None:
            dx1, dx2 = hooks.backward_after(-nx1, -nx2, *grad_out)
            return BlockGrads(-dx1, -dx2), ()  # a hook may keep them
        mine = tuple(t for t, made_here in ((nx1, owned1 or coupling.scale1 != 1.0),
                                            (nx2, owned2 or fresh or coupling.scale2 != 1.0)) if made_here)
        return BlockGrads(nx1, nx2), mine

    # -- the steps schedules compose -----------------------------------------------------------

    def recover(self, i: int, streams) -> Recovered:
        """Rebuild layer i's input from its output, keeping the graph for its gradients (both halves')."""
        layer = self.run.layers[i]
        if not is_reversible_block(layer):
            return self._recover_invertible(i, streams)
        rb = self._begin(i, streams)

        def rebuild_phase(f, g, token=None):
            with scratch:  # BatchNorm & co. update copies of their buffers, not the forward's
                y1_value = self._rebuild_g(rb, g, token)
                self._rebuild_f(rb, f)
            # y1_value is visible so FSDP2's pre-backward hook (prefetch) fires in grads(i).
            return PhaseResult(None), y1_value

        updated = self.run.updated_buffers.get(i)
        scratch = _scratch_buffers(updated) if updated else _NO_SCRATCH
        self._in_phase(rb, rebuild_phase, with_token=True)
        return self._checked(Recovered(i, (rb.x1, rb.x2), kind="block", tensors=(rb,)))

    def grads(self, recovered: Recovered, dy1: torch.Tensor, dy2: torch.Tensor) -> BlockGrads:
        """Gradients of one recovered layer: accumulates parameter grads, returns input grads."""
        self._owned = ()  # (step's bookkeeping: keep no reference to the segment's first gradients)
        if recovered.kind == "block":
            return self._block_grads(recovered.tensors[0], dy1, dy2)[0]
        return self._invertible_grads(recovered, dy1, dy2)

    def step(self, i: int, streams: list, dy1: torch.Tensor, dy2: torch.Tensor):
        """recover(i) and grads(i) in one, one half at a time (the sequential schedule): G is rebuilt and
        its gradients run before F is rebuilt, so one half's recompute graph is alive at a time, and each
        output stream is let go once its half is rebuilt (``streams`` is emptied: the caller keeps no
        reference). Each half's forward still runs once. Returns ``(Recovered, BlockGrads)``."""
        layer = self.run.layers[i]
        if not is_reversible_block(layer):
            recovered = self._recover_invertible(i, streams)
            streams.clear()
            self._owned = ()
            return recovered, self._invertible_grads(recovered, dy1, dy2)
        rb = self._begin(i, streams)
        streams.clear()
        owned = (self._owns(dy1), self._owns(dy2))

        # A G by chunks of rows runs each chunk's backward at its rebuild: with the gradient of its output
        # stream, known now unless backward hooks are still to see (and may change) it (_block_grads).
        # Its input's gradient then goes straight into the block's other negated gradient where the engine
        # owns it (else it is put together first).
        hooks = BlockHooks.of(layer)
        g_grad = g_into = None
        if hooks is None or not (hooks.backward_pre or hooks.backward):
            (g_grad, g_into), g_owns = ((dy1, dy2), owned[1]) if rb.coupling.swap else ((dy2, dy1), owned[0])
            g_into = g_into if g_owns and g_into is not g_grad else None

        def g_phase(f, g, token=None):
            return PhaseResult(None), self._rebuild_g(rb, g, token, g_grad, g_into)  # visible: FSDP2's pre-backward

        def f_phase(f, g, grad, into):
            self._rebuild_f(rb, f, grad, into)
            return (PhaseResult(None),)

        def rebuild_f(n1, into):  # (F by chunks of rows runs each chunk's backward with n1 at its rebuild)
            self._in_phase(rb, functools.partial(f_phase, grad=n1, into=into))

        updated = self.run.updated_buffers.get(i)
        with _scratch_buffers(updated) if updated else _NO_SCRATCH:  # BatchNorm & co. update copies
            self._in_phase(rb, g_phase, with_token=True)
            grads, self._owned = self._block_grads(rb, dy1, dy2, owned, rebuild_f=rebuild_f)
        return self._checked(Recovered(i, (rb.x1, rb.x2), kind="block", tensors=())), grads

    # -- invertible layers -------------------------------------------------------------------------

    def _recover_invertible(self, i: int, streams) -> Recovered:
        run, fmt = self.run, self.run.fmt
        y1, y2 = self.streams_entering(i, streams)
        layer = run.layers[i]
        scratch = _scratch_buffers(run.updated_buffers.get(i, ()))
        with torch.no_grad():
            x1, x2 = layer.inverse(y1, y2)
        with torch.enable_grad(), run.autocast.restored(), replayed(run.dispatch), scratch:
            v1 = fmt.value(x1).detach().requires_grad_()
            v2 = fmt.value(x2).detach().requires_grad_()
            o1, o2 = layer(v1, v2)
        is_own = self._own_leaf_test(layer, v1, v2)
        if reaches_foreign_leaf(o1, is_own) or reaches_foreign_leaf(o2, is_own):
            raise RuntimeError(captured_tensor_message(f"layer {run.first_index + i}"))
        return self._checked(Recovered(i, (x1, x2), kind="invertible", tensors=(o1, o2, v1, v2)))

    def _invertible_grads(self, recovered: Recovered, n1, n2) -> BlockGrads:
        """An invertible layer's backward (its own forward direction: its parameters, if any, need the
        gradients themselves); returns the negated input grads, as blocks do."""
        o1, o2, v1, v2 = recovered.tensors
        outputs = [o for o in (o1, o2) if o.requires_grad]
        if outputs:
            grads = [-n for o, n in zip((o1, o2), (n1, n2)) if o.requires_grad]
            self._backward(outputs, grads, [v1, v2])
        nx1 = torch.zeros_like(n1) if v1.grad is None else v1.grad.to(n1.dtype).neg_()
        nx2 = torch.zeros_like(n2) if v2.grad is None else v2.grad.to(n2.dtype).neg_()
        return BlockGrads(nx1, nx2)

    # -- shared ------------------------------------------------------------------------------------

    def _own_leaf_test(self, layer, *leaves):
        """``is_own(leaf)`` for the captured-tensor check of a rebuilt layer: the segment's parameters,
        the rebuild's input leaves and the conditioning's leaves."""
        own = {id(leaf) for leaf in (*leaves, *self.cond_leaves)}
        if _is_fsdp_module(layer):  # FSDP2 swaps in gathered parameters for the phase: other objects
            own.update(id(p) for p in layer.parameters())
        param_ids = self.run.param_ids
        return lambda leaf: id(leaf) in own or id(leaf) in param_ids

    def _backward(self, output, grad, leaves):
        """Backward of a recompute graph: into every parameter's .grad, or only into ``leaves`` and the
        conditioning's leaves (whose .grad sums every block's contribution).

        Autograd's engine directly: ``torch.autograd.backward``'s checks and conversions of its arguments
        (tensors the engine made, of the right shapes) cost more Python than the call itself here."""
        outputs = tuple(output) if isinstance(output, (list, tuple)) else (output,)
        grads = tuple(grad) if isinstance(grad, (list, tuple)) else (grad,)
        inputs = () if self.accumulate else tuple(leaves + self.grad_leaves)
        _engine.run_backward(outputs, grads, False, False, inputs, True, True)
