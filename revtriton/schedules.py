"""Backward schedules of a reversible segment: sequential and PaReprop (two streams).

A schedule composes two per-layer steps offered by the engine:

* ``recover(i, streams)``: rebuild layer i's input from its output, keeping the recompute's
  graph (both couple calls of a block, with grad);
* ``grads(recovered, dy1, dy2)``: the two local backward calls that accumulate the parameter
  grads and return the gradients w.r.t. layer i's input;
* ``step(i, streams, dy1, dy2)``: both for one layer, ``(recovered, grads)``, rebuilding and
  differentiating one half at a time (G's rebuild and gradients, then F's), so that only one
  half's recompute graph is alive at once; it empties the list ``streams``.

Sequential runs step(i) (recover(i) and grads(i), half by half) for i = L-1 .. 0. PaReprop (Zhao et al., 2023) rebuilds
layer i-1 while layer i's gradients run, on two side streams ("lanes") that take turns: layer
i is rebuilt *and* gets its gradients on lane i % 2. Autograd runs each backward op on the
stream its forward op ran on, so grads(i) lands on the stream that rebuilt layer i whichever
stream issues it; with one rebuild stream it would queue behind rebuild(i-1) and nothing would
overlap. The dependencies are device-side events, never host syncs, and stream order on a
lane (grads(i+1) before rebuild(i-1)) keeps at most two layers' recompute graphs alive.

On CPU the same code runs with streams that do nothing, so tests exercise the real ordering
(and can record it with a :class:`ScheduleTrace`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

SCHEDULES = ("sequential", "pareprop")


@dataclass
class Recovered:
    """A layer rebuilt in backward: its input streams and the graph its gradients need."""

    index: int
    inputs: tuple
    kind: str  # "block" or "invertible"
    tensors: tuple
    checksum: torch.Tensor | None = None  # exact streams: the rebuilt input's checksum (compared per segment)


@dataclass
class BlockGrads:
    dx1: torch.Tensor
    dx2: torch.Tensor

    def __iter__(self):
        return iter((self.dx1, self.dx2))


@dataclass
class ScheduleTrace:
    """Events issued by a backward schedule, in host issue order.

    Each event is ``(op, layer, stream, waits)``: op is "rebuild" or "grads", stream is "main"
    (sequential) or "lane0" / "lane1" (PaReprop), waits lists the ``(op, layer)`` events it
    depends on (device-side waits and same-stream order).
    """

    events: list = field(default_factory=list)

    def add(self, op, layer, stream, waits=()):
        self.events.append((op, layer, stream, tuple(waits)))

    def index(self, op, layer):
        for n, event in enumerate(self.events):
            if event[0] == op and event[1] == layer:
                return n
        raise KeyError((op, layer))


class _NullStream:
    """Stands in for a CUDA stream on CPU: ordering is program order, nothing to wait for."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return None


def _side_streams(device: torch.device):
    """(the caller's stream, two side streams): CUDA streams on a GPU, no-op stand-ins elsewhere."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device), (torch.cuda.Stream(device), torch.cuda.Stream(device))
    null = _NullStream()
    return null, (null, null)


def _on(stream):
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def _protect(tensors, stream):
    """Tell the caching allocator that ``stream`` uses these tensors (made on another stream)."""
    if isinstance(stream, torch.cuda.Stream):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(stream)


def _sequential(stepper, streams, grads, trace):
    (dy1, dy2), checksums = grads, []
    grads.clear()  # the caller's list: nothing outside keeps the first gradients once replaced
    for i in reversed(range(stepper.num_layers)):
        # step(i) empties ``streams`` (the caller's list, for the last layer): once a half is rebuilt from
        # an output stream nothing here keeps that stream alive.
        recovered, (dy1, dy2) = stepper.step(i, streams, dy1, dy2)
        if trace is not None:
            trace.add("rebuild", i, "main", [("grads", i + 1)] if i + 1 < stepper.num_layers else [])
            trace.add("grads", i, "main", [("rebuild", i)])
        streams = list(recovered.inputs)
        if recovered.checksum is not None:
            checksums.append(recovered.checksum)
        del recovered  # nothing of this layer's recompute is kept for the next one
    stepper.rebuilt_input = tuple(streams)
    return dy1, dy2, checksums


def _pareprop(stepper, streams, grads, trace):
    (dy1, dy2), n = grads, stepper.num_layers
    grads.clear()
    main, lanes = _side_streams(streams[0].device)
    for lane in lanes:
        lane.wait_stream(main)  # the segment's outputs, anchors and dy were made on the caller's stream
    rebuilt, grads_done = {}, {}
    checksums = []

    def issue_rebuild(i, inputs):
        lane, waits = lanes[i % 2], []
        if i + 1 < n:  # its inputs were rebuilt by layer i+1, on the other lane
            lane.wait_event(rebuilt[i + 1])
            waits.append(("rebuild", i + 1))
        if i + 2 < n:  # issued after grads(i+2) on this lane: run-ahead bounded by stream order
            waits.append(("grads", i + 2))
        _protect(inputs, lane)
        with _on(lane):
            recovered = stepper.recover(i, inputs)
        rebuilt[i] = lane.record_event()
        if trace is not None:
            trace.add("rebuild", i, f"lane{i % 2}", waits)
        return recovered

    upcoming = issue_rebuild(n - 1, streams)
    streams.clear()  # the caller's list: the last layer's rebuild holds what it still needs
    for i in reversed(range(n)):
        current = upcoming
        if i > 0:  # queued before grads(i) so the two run side by side
            upcoming = issue_rebuild(i - 1, current.inputs)
        lane, waits = lanes[i % 2], [("rebuild", i)]
        if i + 1 < n:  # dy comes from grads(i+1), on the other lane
            lane.wait_event(grads_done[i + 1])
            waits.append(("grads", i + 1))
        _protect([dy1, dy2], lane)
        with _on(lane):
            dy1, dy2 = stepper.grads(current, dy1, dy2)
        grads_done[i] = lane.record_event()
        if trace is not None:
            trace.add("grads", i, f"lane{i % 2}", waits)
        if current.checksum is not None:
            checksums.append(current.checksum)
        if i == 0:
            stepper.rebuilt_input = tuple(current.inputs)
        del current
    # The caller's stream (and so the optimizer step) sees every gradient.
    for lane in lanes:
        main.wait_stream(lane)
    _protect([dy1, dy2] + checksums, main)
    return dy1, dy2, checksums


def run_backward_schedule(schedule, stepper, streams, grads, trace=None):
    """Run a segment's backward; returns ``(dx1, dx2, rebuilt_checksums or None)``, the checksums of
    the rebuilt inputs (exact streams) stacked in backward order (the last layer's first).

    ``streams``: the segment's output streams, and ``grads`` their gradients ``[dy1, dy2]``, as lists
    that the schedule empties (the caller must keep no other reference, so that they are freed as soon
    as the backward is done with them)."""
    if schedule == "sequential":
        dy1, dy2, checksums = _sequential(stepper, streams, grads, trace)
    elif schedule == "pareprop":
        dy1, dy2, checksums = _pareprop(stepper, streams, grads, trace)
    else:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return dy1, dy2, (torch.stack(checksums) if checksums else None)
