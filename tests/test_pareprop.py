"""The two-stream PaReprop backward schedule (issue 5), on CPU where streams are no-ops."""
import pytest
import torch

from revtriton import ReversibleBlock, ReversibleStack, ScheduleTrace, schedules
from revtriton.profiling import peak_memory, saved_bytes
from test_engine import WidenTokens, loss_of
from twins import DropPath, grads_of, max_rel_error, mlp


def build(depth, schedule, exact, transition=False, dim=12):
    torch.manual_seed(1234 + depth)  # identical weights for both schedules
    layers = [ReversibleBlock(DropPath(mlp(dim, dropout=0.1), 0.2), DropPath(mlp(dim, dropout=0.1), 0.2))
              for _ in range(depth)]
    if transition:
        layers = layers[: depth // 2 + 1] + [WidenTokens(dim, dim)] + layers[depth // 2 + 1:]
    stack = ReversibleStack(layers, exact=exact, schedule=schedule).train()
    return stack if exact else stack.double()


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 6, 7, 24])
@pytest.mark.parametrize("exact", [False, True], ids=["float64", "exact"])
def test_pareprop_gradients_equal_sequential(depth, exact):
    dtype = torch.float32 if exact else torch.float64
    x = torch.randn(4, 5, 12, dtype=dtype, requires_grad=True)
    seed = int(torch.randint(0, 2**31, ()))
    results = []
    for schedule in ("sequential", "pareprop"):
        stack = build(depth, schedule, exact, transition=depth >= 3)
        torch.manual_seed(seed)
        results.append(grads_of(stack, x, lambda: loss_of(stack(x))))
    (g_seq, p_seq), (g_par, p_par) = results
    if exact:
        assert torch.equal(g_seq, g_par) and all(torch.equal(a, b) for a, b in zip(p_seq, p_par))
    else:
        assert max_rel_error([g_par] + p_par, [g_seq] + p_seq) <= 1e-12


@pytest.mark.parametrize("depth", [1, 2, 5, 8])
def test_trace_orders_rebuild_ahead_of_grads_and_bounds_run_ahead(depth):
    stack = build(depth, "pareprop", exact=True)
    stack.trace = trace = ScheduleTrace()
    x = torch.randn(2, 3, 12, requires_grad=True)
    stack(x).sum().backward()
    events = trace.events
    assert sorted((op, i) for op, i, _, _ in events) == sorted(
        [("rebuild", i) for i in range(depth)] + [("grads", i) for i in range(depth)]
    )
    for op, i, stream, waits in events:
        # Layer i is rebuilt and gets its gradients on lane i % 2 (where autograd runs its backward).
        assert stream == f"lane{i % 2}"
        if op == "grads":
            assert set(waits) == {("rebuild", i)} | ({("grads", i + 1)} if i + 1 < depth else set())
            if i > 0:  # rebuild(i-1) is queued, on the other lane, before grads(i)
                assert trace.index("rebuild", i - 1) < trace.index("grads", i)
        else:
            assert set(waits) == ({("rebuild", i + 1)} if i + 1 < depth else set()) | (
                {("grads", i + 2)} if i + 2 < depth else set())
            if i + 2 < depth:  # never more than two layers ahead of the gradients: grads(i+2) is
                # issued earlier on the same lane, so the lane runs it first
                assert trace.index("grads", i + 2) < trace.index("rebuild", i)
            grads_issued = [j for op2, j, _, _ in events[: trace.index("rebuild", i)] if op2 == "grads"]
            lowest_done = min(grads_issued, default=depth)
            assert lowest_done - i <= 2


class RecordingStream:
    """A stand-in stream that logs the waits and event records the schedule issues on it."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event))

    def wait_stream(self, stream):
        self.log.append(("wait_stream", self.name, stream.name))

    def record_event(self, event=None):
        event = object()
        self.log.append(("record", self.name, event))
        return event


@pytest.mark.parametrize("depth", [2, 3, 5, 8])
def test_pareprop_really_waits_on_the_events_it_needs(depth, monkeypatch):
    """The trace says what the schedule means to wait for; this checks the wait_event calls it makes."""
    log = []
    lanes = (RecordingStream("lane0", log), RecordingStream("lane1", log))
    monkeypatch.setattr(schedules, "_side_streams", lambda device: (RecordingStream("main", log), lanes))
    stack = build(depth, "pareprop", exact=True)
    stack.trace = trace = ScheduleTrace()
    stack(torch.randn(2, 3, 12, requires_grad=True)).sum().backward()
    # The k-th recorded event closes the k-th traced op (record_event runs right before trace.add).
    records = [event for kind, _, event in log if kind == "record"]
    op_of = {event: (op, i) for event, (op, i, _, _) in zip(records, trace.events)}
    waited, pending, ops = {}, {"lane0": set(), "lane1": set()}, iter(trace.events)
    for kind, lane, event in log:
        if kind == "wait":
            pending[lane].add(op_of[event])
        elif kind == "record":
            op, i, stream, _ = next(ops)
            assert stream == lane
            waited[op, i], pending[lane] = pending[lane], set()
    for i in range(depth - 1):
        assert ("rebuild", i + 1) in waited["rebuild", i]  # its inputs, from the other lane
        assert ("grads", i + 1) in waited["grads", i]  # its dy, from the other lane


def test_no_host_sync_in_backward(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("host sync inside backward")

    stack = build(5, "pareprop", exact=True)
    x = torch.randn(2, 3, 12, requires_grad=True)
    out = stack(x).sum()
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", forbidden)
    out.backward()
    assert x.grad is not None


def test_at_most_two_blocks_of_intermediates_alive():
    dim, tokens = 64, 64
    x = torch.randn(4, tokens, dim, requires_grad=True)
    one_block = ReversibleStack([ReversibleBlock(mlp(dim), mlp(dim))], exact=False)
    per_block = saved_bytes(lambda: [one_block[0](x, x)], one_block)  # one block's stored intermediates
    peaks = {}
    for schedule in ("sequential", "pareprop"):
        for depth in (4, 16):
            torch.manual_seed(0)
            stack = ReversibleStack([ReversibleBlock(mlp(dim), mlp(dim)) for _ in range(depth)], schedule=schedule)
            stack(x).sum().backward()  # .grad allocated: measure a steady-state step
            out = stack(x).sum()
            peaks[schedule, depth] = peak_memory(lambda: out.backward())
    # Flat in depth, and pareprop holds at most one block more than sequential.
    assert peaks["pareprop", 16] <= 1.05 * peaks["pareprop", 4]
    assert peaks["pareprop", 16] - peaks["sequential", 16] <= 1.25 * per_block, (peaks, per_block)
    assert peaks["pareprop", 16] > peaks["sequential", 16]  # the overlap really holds a second block
