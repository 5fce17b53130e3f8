"""The reversible engine on the CPU reference path (issue 2)."""
import copy
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch
from torch import nn

from revtriton import LayerNormAttention, LayerNormMLP, ReversibleBlock, ReversibleStack, engine
from revtriton.profiling import peak_memory, saved_bytes
from revtriton.ops.streams import to_fixed
from revtriton.models.common import stored_float_streams
from twins import CountingHalf, DropPath, grads_of, max_rel_error, mlp, plain_forward, rounded_forward

DIM = 16


@pytest.fixture(autouse=True)
def fresh_seed(seeded):
    """Every test here draws its inputs and weights from a fresh seed (conftest's rule)."""
    return seeded


def make_stack(depth, dim=DIM, dtype=torch.float64, dropout=0.0, drop_path=0.0, **kwargs):
    blocks = [
        ReversibleBlock(DropPath(mlp(dim, dropout=dropout), drop_path), DropPath(mlp(dim, dropout=dropout), drop_path))
        for _ in range(depth)
    ]
    return ReversibleStack(blocks, **kwargs).to(dtype)


def loss_of(out):
    # A loss with a non-uniform upstream gradient (not just ones).
    return (out * torch.linspace(-1, 2, out.shape[-1], dtype=out.dtype)).square().sum()


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 7, 24])
def test_float_mode_gradients_match_plain_autograd(depth):
    stack = make_stack(depth, exact=False)
    x = torch.randn(3, 5, DIM, dtype=torch.float64, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    want = grads_of(stack, x, lambda: loss_of(plain_forward(stack, x)))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_exact_mode_gradients_equal_rounded_model_bitwise(autocast):
    depth = 96
    stack = make_stack(depth, dim=8, dtype=torch.float32)
    for p in stack.parameters():  # trained-like weights keep the streams moving at depth 96
        p.data.mul_(0.5)
    x = torch.randn(2, 3, 8, requires_grad=True)

    def under_autocast(forward):
        # Only the forward runs under autocast: the engine must restore it for the recompute.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return loss_of(forward().float())

    got = grads_of(stack, x, lambda: under_autocast(lambda: stack(x)))
    want = grads_of(stack, x, lambda: under_autocast(lambda: rounded_forward(stack, x, 16)))
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_exact_streams_in_the_model_dtype(dtype):
    """A model held in bf16, fp16 or fp64 without autocast: halves see stream values in its dtype,
    the output and grads have its dtype and equal the rounded model's bitwise, and int32 streams
    run and invert bitwise (the halves then take the parameters' dtype)."""
    stack = make_stack(5, dim=8, dtype=dtype)
    x = torch.randn(2, 3, 8, dtype=dtype, requires_grad=True)
    assert stack(x).dtype == dtype
    got = grads_of(stack, x, lambda: loss_of(stack(x).float()))
    want = grads_of(stack, x, lambda: loss_of(rounded_forward(stack, x, 16).float()))
    assert got[0].dtype == dtype and torch.equal(got[0], want[0])
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(got[1], want[1]))
    s1, s2 = to_fixed(torch.randn(2, 3, 8), 16), to_fixed(torch.randn(2, 3, 8), 16)
    y1, y2 = stack.forward_streams(s1, s2)
    r1, r2 = stack.inverse(y1, y2)
    assert torch.equal(r1, s1) and torch.equal(r2, s2)


class DtypeProbe(nn.Module):
    """Records the dtype of its input and of the gradient reaching its output."""

    def __init__(self, module):
        super().__init__()
        self.module, self.seen = module, set()

    def forward(self, x):
        self.seen.add(("input", x.dtype))
        out = self.module(x)
        if out.requires_grad:
            out.register_hook(lambda grad: self.seen.add(("grad", grad.dtype)))
        return out


def test_exact_float64_keeps_float64_precision():
    """A float64 model's halves see float64 stream values and get float64 gradients, so exact
    mode is within the grid's rounding (2**-24 here) of plain float64 autograd."""
    probes = [DtypeProbe(mlp(8)) for _ in range(6)]
    stack = ReversibleStack([ReversibleBlock(probes[2 * i], probes[2 * i + 1]) for i in range(3)],
                            frac_bits=24).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    assert all(p.seen == {("input", torch.float64), ("grad", torch.float64)} for p in probes)
    want = grads_of(stack, x, lambda: loss_of(plain_forward(stack, x)))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_rebuilt_halfs_input_is_the_forwards_value_bitwise_from_a_storage_less_leaf(dtype):
    """The rebuild's differentiable value of an int32 stream (StreamFormat.differentiable_value):
    the forward's value bit for bit (zeros, both extremes of the stream range, values float32 must
    round), its gradient whole in the leaf, and the leaf one element of storage, so the engine holds
    no stream-sized copy (tests/test_pareprop.py's peak counts the rest)."""
    fmt = engine.guards.StreamFormat(16, dtype)
    limit = 2**29 - 1
    stream = torch.tensor([[0, 1, -1, limit, -limit, 2**24 + 1, -(2**24 + 3), 12345]], dtype=torch.int32)
    stream = torch.cat([stream, to_fixed(torch.randn(3, 8), 16)])
    leaf, value = fmt.differentiable_value(stream)
    assert value.dtype == dtype and torch.equal(value, fmt.value(stream))
    assert not torch.signbit(value[0, 0])  # +0.0: the leaf's zeros add no sign
    assert leaf.is_leaf and leaf.untyped_storage().nbytes() == leaf.element_size()
    grad = torch.randn(stream.shape, dtype=torch.float64).to(dtype)
    value.backward(grad)
    assert leaf.grad.shape == stream.shape and torch.equal(leaf.grad.to(dtype), grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_an_inverse_couples_port_holds_no_stream_and_passes_exact_adds_gradient(dtype):
    """The rebuild's exact couple (sign -1) makes its port without ExactAdd (ops.streams.inverse_port):
    the same stream, a port of the stream's gradient dtype (fp32 for 16-bit halves) with one element
    of storage, and the gradient ExactAdd's backward gives, bit for bit."""
    from revtriton.ops.streams import ExactAdd, couple_output, stream_grad_dtype

    weight = torch.randn(8, 8, dtype=dtype, requires_grad=True)
    x = torch.randn(3, 8, dtype=dtype)
    res = to_fixed(torch.randn(3, 8), 16)
    grad = torch.randn(3, 8, dtype=stream_grad_dtype(dtype))
    stream, port = couple_output(res, x @ weight, -1, 16)
    want_stream, want_port = ExactAdd.apply(res, x @ weight, -1, 16)
    assert torch.equal(stream, want_stream) and port.shape == stream.shape
    assert port.dtype == want_port.dtype == stream_grad_dtype(dtype)
    assert port.untyped_storage().nbytes() == port.element_size()
    (got,) = torch.autograd.grad(port, weight, grad)
    (want,) = torch.autograd.grad(want_port, weight, grad)
    assert torch.equal(got, want)


def test_the_cached_zero_and_powers_of_two_stay_what_they_are_through_exact_steps():
    """The exact path's ports and input leaves expand one cached zero element, and its scalings multiply
    by cached powers of two (ops.streams.zero_element, power_of_two: no tensor made per call): after
    training steps whose gradients flowed through those leaves and ports, the zero is still +0.0 and
    the powers are exact, and the steps' gradients are the same each time."""
    from revtriton.ops.streams import power_of_two, zero_element

    stack = make_stack(3, dim=8, dtype=torch.float32, exact=True)
    x = torch.randn(2, 4, 8, requires_grad=True)
    grads = []
    for _ in range(2):
        stack.zero_grad(set_to_none=True)
        x.grad = None
        stack(x).square().sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in stack.parameters()])
    zero = zero_element(torch.float32, x.device)
    assert zero.item() == 0.0 and not torch.signbit(zero)
    assert zero is zero_element(torch.float32, x.device)  # (one per dtype and device)
    assert power_of_two(16).item() == 2.0**16 and power_of_two(-16).item() == 2.0**-16
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_exact_inverse_is_bitwise_at_depth_96_and_float_drift_is_reported():
    stack = make_stack(96, dim=8, dtype=torch.float32)
    x1, x2 = torch.randn(2, 2, 4, 8).unbind(0)
    s1, s2 = to_fixed(x1, 16), to_fixed(x2, 16)
    y1, y2 = stack.forward_streams(s1, s2)
    assert y1.dtype == torch.int32 and not torch.equal(y1, s1)
    r1, r2 = stack.inverse(y1, y2)
    assert torch.equal(r1, s1) and torch.equal(r2, s2)

    stack.exact = False
    with torch.no_grad():
        f1, f2 = stack.inverse(*stack.forward_streams(x1, x2))
    error = max(((f1 - x1).norm() / x1.norm()).item(), ((f2 - x2).norm() / x2.norm()).item())
    print(f"float-mode reconstruction error at depth 96 (fp32): {error:.3e}")
    assert 0 < error < 1e-4  # float reversal drifts (~1e-6 measured), which is why exact streams exist


def test_bytes_kept_for_backward_do_not_grow_with_depth():
    x = torch.randn(4, 32, 64, requires_grad=True)
    kept = {}
    for depth in (12, 24, 48):
        stack = make_stack(depth, dim=64, dtype=torch.float32)
        kept[depth] = saved_bytes(lambda: stack(x), stack)
        if depth == 24:
            stored = saved_bytes(lambda: plain_forward(stack, x), stack)
    assert kept[48] <= 1.05 * kept[12]
    assert stored >= 20 * kept[24], (stored, kept[24])


def test_training_step_peak_memory_is_flat_in_depth():
    x = torch.randn(4, 32, 64, requires_grad=True)
    peaks = []
    for depth in (8, 32):
        stack = make_stack(depth, dim=64, dtype=torch.float32)
        stack(x).sum().backward()  # allocate .grad first: steady-state training steps reuse it
        peaks.append(peak_memory(lambda: stack(x).sum().backward()))
    assert peaks[1] <= 1.10 * peaks[0], peaks


class _GraphCount(torch.autograd.Function):
    """Identity whose recorded nodes are counted while alive: how many half graphs exist at once."""

    live = 0
    most = 0

    @staticmethod
    def forward(ctx, x):
        if x.requires_grad:  # recorded (a rebuild in backward); the forward runs without grad
            _GraphCount.live += 1
            _GraphCount.most = max(_GraphCount.most, _GraphCount.live)
            weakref.finalize(ctx, _GraphCount._freed)
        return x.view_as(x)

    @staticmethod
    def _freed():
        _GraphCount.live -= 1

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Counted(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(_GraphCount.apply(x))


@pytest.mark.parametrize("exact", [False, True])
def test_sequential_backward_keeps_one_half_graph_at_a_time(exact):
    """Sequential: G is rebuilt and differentiated before F is rebuilt (issue 20: the extra peak was
    F's recompute graph alive during G's gradients); PaReprop keeps two blocks' (four halves')."""
    most = {}
    for schedule in ("sequential", "pareprop"):
        torch.manual_seed(0)
        stack = ReversibleStack([ReversibleBlock(_Counted(mlp(DIM)), _Counted(mlp(DIM))) for _ in range(4)],
                                exact=exact, schedule=schedule)
        x = torch.randn(2, 3, DIM, requires_grad=True)
        out = stack(x)
        _GraphCount.live = _GraphCount.most = 0
        loss_of(out).backward()
        assert _GraphCount.live == 0  # every rebuilt graph freed once backward is done
        most[schedule] = _GraphCount.most
    assert most == {"sequential": 1, "pareprop": 4}, most


@pytest.mark.parametrize("exact", [False, True])
def test_backward_twice_needs_retain_graph_like_autograd(exact):
    """The final streams are freed by the first backward unless it retains the graph (as saved tensors are)."""
    stack = make_stack(3, exact=exact, dtype=torch.float32)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    out = loss_of(stack(x))
    out.backward(retain_graph=True)
    first = [x.grad.clone()] + [p.grad.clone() for p in stack.parameters()]
    out.backward()  # the same gradients again, accumulated
    again = [x.grad] + [p.grad for p in stack.parameters()]
    for a, b in zip(first, again):
        assert torch.allclose(b, 2 * a, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="backward ran a second time|backward through the graph a second time"):
        out.backward()


def test_the_engine_can_tell_whether_a_backward_keeps_the_graph():
    """The engine frees the final streams early only when it can ask autograd whether the running
    backward retains the graph (a private API; without it every backward would keep them: the memory
    bar would be lost silently). A torch that drops it must fail here."""
    from revtriton.ops.graph import backward_keeps_graph

    assert callable(getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None))
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(backward_keeps_graph())
            return grad

    x = torch.randn(3, requires_grad=True)
    Probe.apply(x).sum().backward(retain_graph=True)
    Probe.apply(x).sum().backward()
    assert seen == [True, False]


def test_in_place_change_of_a_returned_input_is_refused():
    """An invertible layer returning its input unchanged makes the final stream the caller's tensor:
    modifying it before backward is caught (autograd's saved-tensor check did this before)."""

    class Identity(nn.Module):
        def forward(self, x1, x2):
            return x1, x2

        def inverse(self, y1, y2):
            return y1, y2

    stack = ReversibleStack([Identity()], exact=False)
    x1, x2 = torch.randn(2, 3, DIM), torch.randn(2, 3, DIM)
    w = torch.randn(2, 3, DIM, requires_grad=True)
    a, b = x1 * w, x2 * w  # requires grad: the segment records its node
    y1, y2 = stack.forward_streams(a, b)
    loss = (y1 * y2).sum()
    a.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


@pytest.mark.parametrize("exact", [False, True])
def test_dropout_and_drop_path_replay_exactly(exact):
    dtype = torch.float32 if exact else torch.float64
    stack = make_stack(5, dtype=dtype, dropout=0.1, drop_path=0.2, exact=exact).train()
    x = torch.randn(6, 4, DIM, dtype=dtype, requires_grad=True)
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    after_reversible = torch.rand(())
    torch.manual_seed(seed)
    if exact:
        want = grads_of(stack, x, lambda: loss_of(rounded_forward(stack, x, 16)))
    else:
        want = grads_of(stack, x, lambda: loss_of(plain_forward(stack, x)))
    after_plain = torch.rand(())
    assert torch.equal(after_reversible, after_plain), "backward must not disturb the global RNG stream"
    if exact:
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    else:
        assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10


def another_thread_draws(n):
    """``n`` numbers drawn from the global generator by another thread, as a data-loading thread
    doing random augmentation would (started and joined here: the interleaving is deterministic)."""
    thread = threading.Thread(target=torch.rand, args=(n,))
    thread.start()
    thread.join()


class NoisyHalf(nn.Module):
    """A half that draws (a dropout mask and Gaussian noise: ``bernoulli_`` and ``randn_like``) and
    keeps each call's noise; before drawing, another thread draws from the global generator (in
    every call, in the recompute only, or in the recompute and the first, probed, forward), a
    different count each call."""

    def __init__(self, dim, dtype, other_thread):
        super().__init__()
        self.linear = nn.Linear(dim, dim, dtype=dtype)
        self.other_thread = other_thread
        self.noises = []

    def forward(self, x):
        recompute = torch.is_grad_enabled()
        if (self.other_thread == "always" or (self.other_thread == "recompute" and recompute)
                or (self.other_thread == "probe, recompute" and (recompute or not self.noises))):
            another_thread_draws(7 + len(self.noises))
        noise = nn.functional.dropout(torch.ones_like(x), 0.25, self.training) * (1 + 0.1 * torch.randn_like(x))
        self.noises.append(noise)
        return torch.tanh(self.linear(x)) * noise


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("exact", [False, True], ids=["float", "exact"])
def test_another_thread_drawing_during_a_step_changes_no_gradient(seeded, exact, schedule):
    """Issue 45: the recompute draws what the forward drew from the half's own generators, wherever
    the global generator stands (another thread drawing between the forward's draws and the
    recompute's moved it: gradients off by 0.7-1.4 relative before). Depth 3, two steps (the first
    probes which halves draw, the second records from the plan)."""
    dtype = torch.float32 if exact else torch.float64

    def steps(other_thread):
        torch.manual_seed(seeded)
        halves = [NoisyHalf(DIM, dtype, other_thread) for _ in range(6)]
        stack = ReversibleStack([ReversibleBlock(halves[2 * i], halves[2 * i + 1]) for i in range(3)],
                                exact=exact, schedule=schedule).train()
        x = torch.randn(2, 3, DIM, dtype=dtype, requires_grad=True)
        grads = []
        for step in range(2):
            torch.manual_seed(seeded + 1 + step)  # (the other thread moved the generator since: not counted)
            grads.append(grads_of(stack, x, lambda: loss_of(stack(x))))
        for half in halves:  # per step: the forward's noise, then the recompute's
            assert len(half.noises) == 4
            assert torch.equal(half.noises[0], half.noises[1]) and torch.equal(half.noises[2], half.noises[3])
            assert not torch.equal(half.noises[0], half.noises[2])  # each step draws anew
        return grads

    alone = steps(None)
    with_thread_in_recompute = steps("recompute")  # the forward draws as alone: the same gradients, bitwise
    steps("always")  # the forward's masks differ from alone's, and the recompute still draws them
    for (a_input, a_params), (b_input, b_params) in zip(alone, with_thread_in_recompute):
        assert torch.equal(a_input, b_input) and all(torch.equal(a, b) for a, b in zip(a_params, b_params))


@torch.library.custom_op("revtriton_test::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    """A custom op that draws inside, from the global generator (as an extension kernel's dropout
    does): no random tag, no generator argument, nothing the routing mode can hand a generator."""
    return x * torch.rand_like(x)


class EscapingHalf(nn.Module):
    def __init__(self, dim, dtype):
        super().__init__()
        self.linear = nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x):
        return torch.tanh(self.linear(x)) * (0.5 + noisy(torch.ones_like(x)))


class CountedGlobalStarts:
    """Counts the engine's GlobalStart records (the global generators' states around a half)."""

    def __init__(self, monkeypatch):
        self.starts = []
        starts = self.starts

        class Counted(engine.replay.GlobalStart):
            def __init__(self):
                super().__init__()
                starts.append(self)

        monkeypatch.setattr(engine.replay, "GlobalStart", Counted)


@pytest.mark.parametrize("exact", [False, True], ids=["float", "exact"])
def test_draws_the_routing_cannot_reach_replay_from_the_global_start(seeded, exact, monkeypatch):
    """A half drawing inside a custom op (the global generator moves under the routed half) is
    recorded by the global generators' start while it keeps moving, its routed draws still from its
    own generators: gradients match plain autograd (exact: bitwise, no checksum error)."""
    dtype = torch.float32 if exact else torch.float64
    counted = CountedGlobalStarts(monkeypatch)
    torch.manual_seed(seeded)
    stack = ReversibleStack([ReversibleBlock(EscapingHalf(DIM, dtype), NoisyHalf(DIM, dtype, None))
                             for _ in range(2)], exact=exact).train()
    x = torch.randn(2, 3, DIM, dtype=dtype, requires_grad=True)
    for step in range(3):
        counted.starts.clear()
        torch.manual_seed(seeded + 1 + step)
        got = grads_of(stack, x, lambda: loss_of(stack(x)))
        torch.manual_seed(seeded + 1 + step)
        reference = rounded_forward(stack, x, 16) if exact else plain_forward(stack, x)
        want = grads_of(stack, x, lambda: loss_of(reference))
        if exact:
            assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        else:
            assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10
        assert len(counted.starts) == (4 if step == 0 else 2), step  # the probe: all; then the escaping F's


def test_a_half_another_thread_drew_under_in_the_probe_goes_back_to_its_own_generators(seeded, monkeypatch):
    """Another thread drawing while the probe runs a half looks like an escaped draw: the half is
    checked again in the next forward, and back on its own generators alone once the global
    generator stays still under it, where other threads drawing in the recompute change nothing."""
    counted = CountedGlobalStarts(monkeypatch)
    torch.manual_seed(seeded)
    halves = [NoisyHalf(DIM, torch.float64, "probe, recompute") for _ in range(4)]
    stack = ReversibleStack([ReversibleBlock(halves[2 * i], halves[2 * i + 1]) for i in range(2)],
                            exact=False).train()
    x = torch.randn(2, 3, DIM, dtype=torch.float64, requires_grad=True)
    counts = []
    for _ in range(3):
        counted.starts.clear()
        loss_of(stack(x)).backward()
        counts.append(len(counted.starts))
    assert counts == [4, 4, 0]
    for half in halves:  # per step: the forward's noise, then the recompute's
        assert all(torch.equal(half.noises[i], half.noises[i + 1]) for i in (0, 2, 4))


@pytest.mark.parametrize("exact", [False, True], ids=["float", "exact"])
def test_transformer_halves_draw_drop_path_from_their_own_generator_unrouted(seeded, exact, monkeypatch):
    """revtriton's halves ask for the half's generator (halves.randomness.half_generator): after the
    probe they run with no routing mode (it costs host time on every torch call), and another
    thread drawing during the recompute still changes no gradient."""
    dtype = torch.float32 if exact else torch.float64
    routings = []

    class CountedRouting(engine.replay._RoutedToHalf):
        def __init__(self, half):
            super().__init__(half)
            routings.append(self)

    monkeypatch.setattr(engine.replay, "_RoutedToHalf", CountedRouting)
    real_couple_half = engine.segment.couple_half

    def steps(other_thread):
        def couple_half(*args, **kwargs):
            if other_thread and torch.is_grad_enabled():
                another_thread_draws(11)
            return real_couple_half(*args, **kwargs)

        monkeypatch.setattr(engine.segment, "couple_half", couple_half)
        torch.manual_seed(seeded)
        stack = ReversibleStack([ReversibleBlock(LayerNormAttention(DIM, 2, drop_path=0.5),
                                                 LayerNormMLP(DIM, 2 * DIM, drop_path=0.5)) for _ in range(3)],
                                exact=exact).to(dtype).train()
        x = torch.randn(4, 3, DIM, dtype=dtype, requires_grad=True)
        grads = []
        for step in range(3):
            torch.manual_seed(seeded + 1 + step)
            routings.clear()
            grads.append(grads_of(stack, x, lambda: loss_of(stack(x))))
            if step == 0:
                assert len(routings) == 6 and not any(mode.routed for mode in routings)  # the probe
            else:
                assert not routings
        return grads

    alone, with_thread = steps(False), steps(True)
    for (a_input, a_params), (b_input, b_params) in zip(alone, with_thread):
        assert torch.equal(a_input, b_input) and all(torch.equal(a, b) for a, b in zip(a_params, b_params))
    assert not torch.equal(alone[1][0], alone[2][0])  # drop-path drew other rows in each step


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_each_half_runs_twice_per_training_step(schedule):
    halves = [CountingHalf(DIM) for _ in range(6)]
    stack = ReversibleStack([ReversibleBlock(halves[2 * i], halves[2 * i + 1]) for i in range(3)], schedule=schedule)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    stack(x).sum().backward()
    assert [h.calls for h in halves] == [2] * 6


class WidenTokens(nn.Module):
    """A stage transition: mixes tokens and widens channels (not invertible)."""

    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x):
        return self.proj(torch.tanh(x))


class PairShuffle(nn.Module):
    """An invertible layer: merges token pairs into channels ([B, T, C] -> [B, T/2, 2C]) and swaps streams."""

    def forward(self, x1, x2):
        b, t, c = x1.shape
        return x2.reshape(b, t // 2, 2 * c), x1.reshape(b, t // 2, 2 * c)

    def inverse(self, y1, y2):
        b, t, c = y1.shape
        return y2.reshape(b, 2 * t, c // 2), y1.reshape(b, 2 * t, c // 2)


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_stage_transition_matches_plain_autograd(schedule):
    layers = [ReversibleBlock(mlp(8), mlp(8)) for _ in range(3)] + [WidenTokens(8, 12)]
    layers += [ReversibleBlock(mlp(12), mlp(12)) for _ in range(2)]
    stack = ReversibleStack(layers, exact=False, schedule=schedule).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    want = grads_of(stack, x, lambda: loss_of(plain_forward(stack, x)))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10
    with pytest.raises(ValueError, match="stage transition"):
        stack.inverse(torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 4, 12, dtype=torch.float64))


def test_invertible_layer_stays_in_the_segment():
    layers = [ReversibleBlock(mlp(8), mlp(8)) for _ in range(2)] + [PairShuffle()]
    layers += [ReversibleBlock(mlp(16), mlp(16)) for _ in range(2)]
    stack = ReversibleStack(layers, exact=False).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    want = grads_of(stack, x, lambda: loss_of(plain_forward(stack, x)))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10

    plain4 = ReversibleStack([ReversibleBlock(mlp(8), mlp(8)) for _ in range(4)], exact=False).double()
    assert saved_bytes(lambda: stack(x), stack) <= saved_bytes(lambda: plain4(x), plain4)

    exact = ReversibleStack(layers, exact=True)
    exact.float()
    s1, s2 = to_fixed(torch.randn(2, 6, 8), 16), to_fixed(torch.randn(2, 6, 8), 16)
    r1, r2 = exact.inverse(*exact.forward_streams(s1, s2))
    assert torch.equal(r1, s1) and torch.equal(r2, s2)


@pytest.mark.parametrize("exact", [False, True])
def test_frozen_input_still_gives_parameter_grads(exact):
    dtype = torch.float32 if exact else torch.float64
    stack = make_stack(3, dtype=dtype, exact=exact)
    x = torch.randn(2, 3, DIM, dtype=dtype)  # e.g. a frozen embedding's output
    stack.zero_grad(set_to_none=True)
    loss_of(stack(x)).backward()
    got = [p.grad.clone() for p in stack.parameters()]
    stack.zero_grad(set_to_none=True)
    reference = rounded_forward(stack, x, 16) if exact else plain_forward(stack, x)
    loss_of(reference).backward()
    assert all(g is not None for g in got)
    if exact:
        assert all(torch.equal(a, p.grad) for a, p in zip(got, stack.parameters()))
    else:
        assert max_rel_error(got, [p.grad for p in stack.parameters()]) <= 1e-10


def test_no_grad_and_inference_keep_nothing(monkeypatch):
    stack = make_stack(4, dtype=torch.float32, dropout=0.1)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    with torch.no_grad(), monkeypatch.context() as patch:
        # Nothing is prepared for a backward: no RNG state is recorded for a recompute.
        patch.setattr(engine.HalfRandomness, "recorded", lambda sink: pytest.fail("RNG recorded under no_grad"))
        y = stack(x)
    assert y.grad_fn is None
    peaks = []
    for depth in (8, 32):  # and memory does not grow with depth
        deep, xf = make_stack(depth, dtype=torch.float32), torch.randn(4, 16, DIM)
        with torch.no_grad():
            peaks.append(peak_memory(lambda: deep(xf)))
    assert peaks[1] <= 1.05 * peaks[0], peaks
    stack.eval()
    with torch.inference_mode():
        y = stack(x)
    assert y.grad_fn is None
    with torch.no_grad():
        assert saved_bytes(lambda: stack(x), stack) == 0


def test_second_backward_raises():
    stack = make_stack(2, dtype=torch.float32)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    loss = stack(x).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_anchors_bound_float_drift_and_match_plain_gradients():
    stack = make_stack(24, exact=False, anchor_every=4)
    x = torch.randn(2, 3, DIM, dtype=torch.float64, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    want = grads_of(stack, x, lambda: loss_of(plain_forward(stack, x)))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10
    plain = make_stack(24, exact=False)
    assert saved_bytes(lambda: stack(x), stack) > saved_bytes(lambda: plain(x), plain)  # it keeps anchors


@pytest.mark.parametrize("depth,every", [(8, 4), (9, 3)])
def test_backward_restarts_from_each_anchor_bitwise(depth, every):
    """Float streams drift when rebuilt; at an anchor the rebuild must start from the kept stream."""
    stack = make_stack(depth, dtype=torch.float32, exact=False, anchor_every=every)
    seen = {}
    for i, block in enumerate(stack):
        g = block.g

        def couple(res, x, sign, frac_bits=None, _real=g.couple, _i=i):
            stream, port = _real(res, x, sign, frac_bits)
            seen[_i, sign] = (stream if sign > 0 else res).detach().clone()  # layer i's output y2
            return stream, port

        g.couple = couple
    x = torch.randn(2, 5, DIM, requires_grad=True)
    stack(x).square().sum().backward()
    anchored = [i for i in range(depth - 1) if (i + 1) % every == 0]
    assert anchored and all(torch.equal(seen[i, 1], seen[i, -1]) for i in anchored)


class ShapeChanger(nn.Module):
    def forward(self, x):
        return x[..., :-1]


class Explode(nn.Module):
    def forward(self, x):
        return x * 1e6 + 1e6


class Noisy(nn.Module):
    """Not deterministic: draws from its own generator, which the engine cannot replay."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))

    def forward(self, x):
        return self.lin(x) + 0.01 * torch.randn(x.shape, generator=self.gen)


def test_bad_inputs_raise_clear_errors():
    stack = make_stack(2, dtype=torch.float32)
    x = torch.randn(2, 3, DIM)
    with pytest.raises(TypeError, match="floating"):
        stack(torch.ones(2, 3, DIM, dtype=torch.int64))
    with pytest.raises(TypeError, match="floating"):
        stack(torch.randn(2, 3, DIM, dtype=torch.complex64))
    with pytest.raises(ValueError, match="same shape"):
        stack.forward_streams(x, x[:1])
    with pytest.raises(ValueError, match="NaN or Inf"):  # resolved when the backward ends (engine.checks)
        stack(torch.full((2, 3, DIM), float("nan"))).sum().backward()
    with pytest.raises(ValueError, match="NaN or Inf"), torch.no_grad():  # nothing to differentiate: at once
        stack(torch.full((2, 3, DIM), float("nan")))
    with pytest.raises(ValueError, match="parameters are on"):
        stack(torch.randn(2, 3, DIM, device="meta"))
    split = ReversibleStack([ReversibleBlock(mlp(4), mlp(4))], streams="split")
    assert split(torch.randn(2, 8)).shape == (2, 8)
    with pytest.raises(ValueError, match="even last dim"):
        split(torch.randn(2, 7))
    with pytest.raises(ValueError, match="keep the shape"):
        ReversibleStack([ReversibleBlock(ShapeChanger(), mlp(DIM))])(x)
    with pytest.raises(ValueError, match="schedule"):
        ReversibleStack([ReversibleBlock(mlp(4), mlp(4))], schedule="fast")
    with pytest.raises(ValueError, match="frac_bits"):
        ReversibleStack([ReversibleBlock(mlp(4), mlp(4))], frac_bits=40)
    with pytest.raises(TypeError, match="nn.Module"):
        ReversibleStack([lambda x: x])
    with pytest.raises(ValueError, match="at least one layer"):
        ReversibleStack([])
    for options, match in (({"frac_bits": True}, "frac_bits"), ({"frac_bits": -1}, "frac_bits"),
                           ({"anchor_every": -1}, "anchor_every"), ({"anchor_every": True}, "anchor_every"),
                           ({"anchor_every": 1.5}, "anchor_every"), ({"streams": "bogus"}, "streams")):
        with pytest.raises(ValueError, match=match):
            ReversibleStack([ReversibleBlock(mlp(4), mlp(4))], **options)


def test_inverse_rejects_what_exact_streams_cannot_hold():
    stack = make_stack(2, dtype=torch.float32).eval()
    y = torch.randn(2, 3, DIM)
    with pytest.raises(ValueError, match="NaN or Inf"):
        stack.inverse(y, torch.full_like(y, float("nan")))
    with pytest.raises(OverflowError, match="frac_bits=16"):
        stack.inverse(y, y * 1e4)  # 8192 and up wrap at 16 fractional bits
    with pytest.raises(TypeError, match="same dtype"):
        stack.inverse(y, y.double())
    with pytest.raises(TypeError, match="floating"):
        stack.inverse(y, y.long())
    r1, r2 = stack.inverse(*stack.forward_streams(y, y))  # float in, float out: within the grid
    assert (r1 - y).abs().max() <= 2.0**-16 and (r2 - y).abs().max() <= 2.0**-16


def test_quantize_rounds_half_to_even_and_saturates():
    """The fixed-point rounding rule itself, against hand-written values (the oracles all share it)."""
    from revtriton.ops.streams import SATURATION, quantize_reference

    ulp = 2.0**-4
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49]) * ulp
    assert quantize_reference(halves, 4).tolist() == [0, 2, 2, 0, -2, -2, 0]
    big = torch.tensor([2.0**40, -(2.0**40), float("inf"), float("-inf"), float("nan")])
    sat = int(SATURATION)
    assert quantize_reference(big, 4).tolist() == [sat, -sat, sat, -sat, sat]
    # float64 is rounded in float64 (float32 would lose the last bit here)
    assert quantize_reference(torch.tensor([1.0], dtype=torch.float64) + 2.0**-30, 30).item() == 2**30 + 1


def test_split_streams_match_the_plain_coupling():
    """streams="split": x = [x1 | x2] along the last dim, y = [y1 | y2] (float64, plain autograd)."""
    stack = ReversibleStack([ReversibleBlock(mlp(8), mlp(8)) for _ in range(3)], exact=False,
                            streams="split").double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)

    def plain():
        y1, y2 = stored_float_streams(list(stack), *x.chunk(2, dim=-1))
        return loss_of(torch.cat([y1, y2], dim=-1))

    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    want = grads_of(stack, x, plain)
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10


def test_eval_with_grad_keeps_only_the_final_streams():
    x = torch.randn(2, 16, DIM, requires_grad=True)
    kept = []
    for depth in (4, 16):
        stack = make_stack(depth, dtype=torch.float32).eval()
        kept.append(saved_bytes(lambda: stack(x), stack))
    assert 0 < kept[1] <= 1.05 * kept[0], kept


def test_overflow_names_the_block_and_a_frac_bits_that_fits():
    layers = [ReversibleBlock(mlp(DIM), mlp(DIM)) for _ in range(2)] + [ReversibleBlock(Explode(), mlp(DIM))]
    stack = ReversibleStack(layers)
    x = torch.randn(2, 3, DIM)
    with pytest.raises(OverflowError, match=r"F half of layer 2.*frac_bits <= \d+") as error:
        stack(x.requires_grad_()).sum().backward()
    fit = int(str(error.value).split("frac_bits <= ")[1].split()[0])
    ReversibleStack(layers, frac_bits=fit)(x)  # the suggestion works for this input
    with pytest.raises(OverflowError, match="input of layer 0"):
        stack(torch.full((2, 3, DIM), 1e4)).sum().backward()  # beyond 2**(29 - 16) = 8192 already at the input


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_non_deterministic_half_is_caught_by_the_checksum(schedule):
    layers = [ReversibleBlock(mlp(DIM), mlp(DIM)), WidenTokens(DIM, DIM), ReversibleBlock(mlp(DIM), mlp(DIM)),
              ReversibleBlock(mlp(DIM), Noisy(DIM)), ReversibleBlock(mlp(DIM), mlp(DIM))]
    stack = ReversibleStack(layers, schedule=schedule)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    with pytest.raises(RuntimeError, match="input of layer 3 .* not deterministic"):
        stack(x).sum().backward()


def test_compiled_model_treats_the_stack_as_one_eager_region():
    stack = make_stack(3, dtype=torch.float32)
    model = nn.Sequential(nn.Linear(DIM, DIM), stack, nn.Linear(DIM, 1))
    x = torch.randn(2, 3, DIM)
    compiled = torch.compile(model, backend="eager")
    compiled(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))


def test_import_revtriton_does_not_import_torch_dynamo_or_triton():
    """Issue 38: the stack's graph break (torch._disable_dynamo) imports torch._dynamo at its first
    call, not at import: that import was about 1.5 s of `import revtriton`'s 1.6 s after torch;
    Triton (0.15 s) is imported by the kernels' first use, its version read from its distribution."""
    script = ("import sys, revtriton, revtriton.models\n"
              "assert 'torch._dynamo' not in sys.modules and 'triton' not in sys.modules, "
              "[m for m in ('torch._dynamo', 'triton') if m in sys.modules]")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the interpreter's patch imports it)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("exact", [True, False])
def test_stream_pairs_with_different_shapes_or_dtypes_are_refused(exact):
    stack = make_stack(2, exact=exact)
    a = torch.randn(2, 3, DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match="x1 and x2 must have the same shape"):
        stack.forward_streams(a, a[:, :2])
    with pytest.raises(TypeError, match="x1 and x2 must have the same dtype"):
        stack.forward_streams(a, a.float())
    with pytest.raises(ValueError, match="y1 and y2 must have the same shape"):
        stack.inverse(a, a[:1])
    with pytest.raises(TypeError, match="y1 and y2 must have the same dtype"):
        stack.inverse(a, a.float())


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("depth", [1, 4])
def test_a_float_split_stack_keeps_only_its_output_alive_after_forward(schedule, depth):
    """Float streams kept for backward are the halves of the split output itself (RevTorch keeps its
    output the same way): after the forward only the output's bytes are alive, the gradients are
    plain autograd's, and an in-place edit of the output before backward is caught."""
    from revtriton import to_stored_activations
    from revtriton.profiling import LiveBytes

    stack = make_stack(depth, exact=False, streams="split", schedule=schedule)
    x = torch.randn(2, 5, 2 * DIM, dtype=torch.float64, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))  # the .grad buffers exist from here on
    with LiveBytes() as live:
        out = stack(x)
    assert live.live == out.numel() * out.element_size()
    del out
    twin = to_stored_activations(copy.deepcopy(stack))
    want = grads_of(twin, x, lambda: loss_of(twin(x)))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10
    out = stack(x)
    with torch.no_grad():
        out.add_(1.0)
    with pytest.raises(RuntimeError, match="streams a reversible segment's backward starts from were modified"):
        loss_of(out).backward()
