"""Conditioning tensors (issue 13, item 2): ``stack(x, cond=c)`` hands ``c`` to every half whose
forward takes a ``cond`` argument (the adaLN / DiT pattern), with ``c``'s gradient summed over all
blocks; a half that captures a tensor requiring grad from outside the stack gets a clear error.

Oracles: the stored-activation twin of the same stack (``to_stored_activations``, same weights),
bitwise in exact mode and in float64 in float mode. Fresh random inputs (conftest's seed).
"""
import copy

import pytest
import torch
from torch import nn

from revtriton import ReversibleBlock, ReversibleStack
from revtriton.models import to_stored_activations
from revtriton.ops.streams import from_fixed, to_fixed
from test_engine import WidenTokens, loss_of
from revtriton.schedules import SCHEDULES
from twins import MODES, max_rel_error, mlp

DIM = 8
pytestmark = pytest.mark.usefixtures("seeded")  # fresh random inputs in every test (conftest)


class AdaLN(nn.Module):
    """A DiT-style half: the conditioning sets the norm's shift and scale and gates the output."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.ada = nn.Linear(dim, 3 * dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, cond):
        shift, scale, gate = self.ada(cond).chunk(3, -1)
        return gate * self.mlp(self.norm(x) * (1 + scale) + shift)


class TwoConditions(nn.Module):
    """A half taking a tuple (timestep embedding, class embedding)."""

    def __init__(self, dim):
        super().__init__()
        self.inner = mlp(dim)
        self.t = nn.Linear(dim, dim)

    def forward(self, x, cond):
        t, y = cond
        return self.inner(x + self.t(t)) * torch.tanh(y)


def dtype_of(exact):
    return torch.float32 if exact else torch.float64


def conditioned_blocks(depth):
    # F takes the conditioning; G does in even blocks only (a half without a cond argument gets none).
    return [ReversibleBlock(AdaLN(DIM), AdaLN(DIM) if i % 2 == 0 else mlp(DIM)) for i in range(depth)]


def stack_of(layers, exact, schedule="sequential", **options):
    return ReversibleStack(layers, exact=exact, schedule=schedule, **options).to(dtype_of(exact))


def twin_of(stack):
    return to_stored_activations(copy.deepcopy(stack))


def grads(model, embedding, x, t, **options):
    """Gradients of x, of the embedding that computes the conditioning and of the model's parameters."""
    for m in (model, embedding):
        m.zero_grad(set_to_none=True)
    x.grad = None
    loss_of(model(x, cond=embedding(t), **options)).backward()
    return [x.grad, *(p.grad for p in embedding.parameters()), *(p.grad for p in model.parameters())]


def assert_same(got, want, exact):
    assert all((a is None) == (b is None) for a, b in zip(got, want))
    if exact:
        assert all(a is None or torch.equal(a, b) for a, b in zip(got, want))
    else:
        assert max_rel_error(got, want) <= 1e-10


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_cond_gradients_equal_the_twin(exact, schedule, depth):
    stack = stack_of(conditioned_blocks(depth), exact, schedule)
    embedding = nn.Linear(DIM, DIM).to(dtype_of(exact))
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    t = torch.randn(2, 1, DIM, dtype=dtype_of(exact))
    got = grads(stack, embedding, x, t)
    want = grads(twin_of(stack), embedding, x, t)
    assert all(g is not None for g in got)
    assert_same(got, want, exact)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [2, 3])
def test_cond_gradients_sum_over_segments_and_anchors(exact, schedule, depth):
    # Two segments (a stage transition between them) and anchors: each segment's node adds its part.
    layers = conditioned_blocks(depth) + [WidenTokens(DIM, DIM)] + conditioned_blocks(depth)
    stack = stack_of(layers, exact, schedule, anchor_every=2)
    embedding = nn.Linear(DIM, DIM).to(dtype_of(exact))
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    t = torch.randn(2, 1, DIM, dtype=dtype_of(exact))
    got, want = grads(stack, embedding, x, t), grads(twin_of(stack), embedding, x, t)
    if exact:
        # Bitwise but for the embedding's gradients: each segment's node sums its own blocks' parts and
        # autograd adds the two sums, where the twin adds every part in turn (float32, another order).
        assert max_rel_error(got[1:3], want[1:3]) <= 1e-5
        got, want = got[:1] + got[3:], want[:1] + want[3:]
    assert_same(got, want, exact)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_frozen_stack_gives_cond_its_gradient(exact, schedule, depth):
    """Input without grad and no trainable block: only the conditioning needs a gradient (it used to get none)."""
    stack = stack_of(conditioned_blocks(depth), exact, schedule).requires_grad_(False)
    embedding = nn.Linear(DIM, DIM).to(dtype_of(exact))
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact))
    t = torch.randn(2, 1, DIM, dtype=dtype_of(exact))
    loss_of(stack(x, cond=embedding(t))).backward()
    got = [p.grad.clone() for p in embedding.parameters()]
    embedding.zero_grad(set_to_none=True)
    loss_of(twin_of(stack)(x, cond=embedding(t))).backward()
    assert_same(got, [p.grad for p in embedding.parameters()], exact)
    assert all(p.grad is None for p in stack.parameters())


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [2, 3])
def test_grad_of_cond_leaves_parameters_alone(exact, schedule, depth):
    stack = stack_of(conditioned_blocks(depth), exact, schedule)
    twin = twin_of(stack)
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    c = torch.randn(2, 1, DIM, dtype=dtype_of(exact), requires_grad=True)
    got = torch.autograd.grad(loss_of(stack(x, cond=c)), [c, x])
    want = torch.autograd.grad(loss_of(twin(x, cond=c)), [c, x])
    assert all(p.grad is None for p in stack.parameters())
    assert_same(list(got), list(want), exact)
    # backward(inputs=[c]) fills c.grad only
    loss_of(stack(x, cond=c)).backward(inputs=[c])
    assert x.grad is None and all(p.grad is None for p in stack.parameters())
    assert_same([c.grad], [got[0]], exact)


@pytest.mark.parametrize("exact", MODES)
def test_a_tuple_of_conditions_each_gets_its_gradient(exact):
    stack = stack_of([ReversibleBlock(TwoConditions(DIM), TwoConditions(DIM)) for _ in range(3)], exact)
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    cond = [torch.randn(2, 1, DIM, dtype=dtype_of(exact), requires_grad=True) for _ in range(2)]
    got = torch.autograd.grad(loss_of(stack(x, cond=tuple(cond))), [x, *cond])
    want = torch.autograd.grad(loss_of(twin_of(stack)(x, cond=tuple(cond))), [x, *cond])
    assert_same(list(got), list(want), exact)


@pytest.mark.parametrize("exact", MODES)
def test_inverse_and_streams_take_the_conditioning(exact):
    stack = stack_of(conditioned_blocks(3), exact)
    x1, x2 = (torch.randn(2, 3, DIM, dtype=dtype_of(exact)) for _ in range(2))
    c = torch.randn(2, 1, DIM, dtype=dtype_of(exact))
    y1, y2 = stack.forward_streams(x1, x2, cond=c)
    r1, r2 = stack.inverse(y1, y2, cond=c)
    if exact:  # bitwise: the input's values on the grid, and int32 streams in and out
        assert torch.equal(r1, from_fixed(to_fixed(x1, 16), 16)) and torch.equal(r2, from_fixed(to_fixed(x2, 16), 16))
        s1, s2 = to_fixed(x1, 16), to_fixed(x2, 16)
        f1, f2 = stack.inverse(*stack.forward_streams(s1, s2, cond=c), cond=c)
        assert torch.equal(f1, s1) and torch.equal(f2, s2)
    else:
        assert max_rel_error([r1, r2], [x1, x2]) <= 1e-10
    # The conditioning matters: without the same one the inverse does not give the input back.
    w1, _ = stack.inverse(y1, y2, cond=c + 1)
    assert not torch.allclose(w1, r1)


def test_overflow_hint_runs_the_float_model_with_the_conditioning():
    stack = ReversibleStack(conditioned_blocks(2))
    x = torch.randn(2, 3, DIM)
    c = torch.randn(2, 1, DIM)
    with pytest.raises(OverflowError, match=r"frac_bits <= \d+ fits this input"):
        stack(x * 1e4, cond=c).sum().backward()


def test_cond_modified_in_place_before_backward_raises():
    stack = ReversibleStack(conditioned_blocks(2))
    c = torch.randn(2, 1, DIM, requires_grad=True)
    cond = c * 1.0
    y = stack(torch.randn(2, 3, DIM), cond=cond)
    with torch.no_grad():
        cond.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_of(y).backward()


def test_bad_cond_gets_a_clear_error():
    x = torch.randn(2, 3, DIM)
    with pytest.raises(ValueError, match="no half of the stack takes it.*def forward\\(self, x, cond\\)"):
        ReversibleStack([ReversibleBlock(mlp(DIM), mlp(DIM))])(x, cond=torch.randn(2, 1, DIM))
    with pytest.raises(TypeError, match="cond must be a tensor or a tuple of tensors"):
        ReversibleStack(conditioned_blocks(1))(x, cond=[1.0])


# -- a half capturing a tensor that requires grad ----------------------------------------------------


class Captures(nn.Module):
    """A half adding a tensor set as an attribute (the DiT pattern without cond=)."""

    def __init__(self, dim):
        super().__init__()
        self.inner = mlp(dim)
        self.condition = None

    def forward(self, x):
        return self.inner(x) + self.condition


def captured(kind, dtype):
    if kind == "leaf":  # (an nn.Parameter set as an attribute would become one of the half's own)
        return torch.randn(2, 1, DIM, dtype=dtype, requires_grad=True)
    embedding = nn.Linear(DIM, DIM).to(dtype)
    return embedding(torch.randn(2, 1, DIM, dtype=dtype))


@pytest.mark.parametrize("kind", ["nonleaf", "leaf"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_captured_tensor_requiring_grad_is_named_in_backward(exact, schedule, depth, kind):
    """At depth 1 this used to pass silently, from depth 2 it crashed in autograd; the half is named."""
    half = Captures(DIM)
    layers = [ReversibleBlock(mlp(DIM), mlp(DIM)) for _ in range(depth - 1)] + [ReversibleBlock(mlp(DIM), half)]
    stack = stack_of(layers[::-1], exact, schedule)  # the capturing block first: rebuilt last
    half.condition = captured(kind, dtype_of(exact))
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"the G half of layer 0 uses a tensor from outside the stack that "
                                           r"requires grad.*stack\(x, cond=c\)"):
        loss_of(stack(x)).backward()
    with pytest.raises(RuntimeError, match="the G half of layer 0 uses a tensor from outside"):
        torch.autograd.grad(loss_of(stack(x)), x)


@pytest.mark.parametrize("kind", ["nonleaf", "leaf"])
@pytest.mark.parametrize("exact", MODES)
def test_a_frozen_stack_names_a_captured_tensor_at_forward(exact, kind):
    """A frozen stack records no graph, so the captured tensor used to get no gradient, silently."""
    half = Captures(DIM)
    stack = stack_of([ReversibleBlock(mlp(DIM), mlp(DIM)), ReversibleBlock(half, mlp(DIM))], exact)
    stack.requires_grad_(False)
    half.condition = captured(kind, dtype_of(exact))
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact))
    with pytest.raises(RuntimeError, match="the F half of layer 1 uses a tensor from outside the stack"):
        stack(x)
    with torch.no_grad():  # no gradient wanted: nothing to report
        stack(x)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
def test_a_captured_tensor_without_grad_is_fine(exact, schedule):
    half = Captures(DIM)
    stack = stack_of([ReversibleBlock(half, mlp(DIM)) for _ in range(1)] + conditioned_blocks(2), exact, schedule)
    half.condition = torch.randn(2, 1, DIM, dtype=dtype_of(exact))
    embedding = nn.Linear(DIM, DIM).to(dtype_of(exact))
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    t = torch.randn(2, 1, DIM, dtype=dtype_of(exact))
    assert_same(grads(stack, embedding, x, t), grads(twin_of(stack), embedding, x, t), exact)
