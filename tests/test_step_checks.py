"""Exact streams' checks as device flags, resolved at the first host point that must know
(engine.checks, issue 45), and every check a stack's plan caches noticing the change that
invalidates it between steps (engine.plan).

Errors: by the end of ``loss.backward()`` in an eager step; inside ``deferred_checks()`` (as in a
CUDA graph) by ``check_step()`` or by the optimizer's ``step()``, with the same message; no
optimizer step applies the gradients of a failed check.
"""
import copy

import pytest
import torch
from torch import nn

import revtriton
from revtriton import ReversibleBlock, ReversibleStack, to_stored_activations
from test_conditioning import Captures
from test_engine import Explode, Noisy, loss_of
from twins import DropPath, grads_of, mlp

DIM = 8
SCHEDULES = ("sequential", "pareprop")
OVERFLOW = r"the F half of layer 1 .*frac_bits <= \d+"
MISMATCH = r"input of layer 1 .* not deterministic"


@pytest.fixture(autouse=True)
def fresh_seed(seeded):
    return seeded


def healthy_stack(depth=3, schedule="sequential", **options):
    return ReversibleStack([ReversibleBlock(mlp(DIM), mlp(DIM)) for _ in range(depth)], schedule=schedule, **options)


def plant(stack, culprit: str):
    """Swap block 1's F half for a bad one between steps (the plan notices the swap)."""
    stack[1].f = Explode() if culprit == "overflow" else Noisy(DIM)
    return (OverflowError, OVERFLOW) if culprit == "overflow" else (RuntimeError, MISMATCH)


def step(stack, x):
    loss_of(stack(x)).backward()


# -- the errors: eager and deferred -------------------------------------------------------------------


@pytest.mark.parametrize("culprit", ["overflow", "nondeterministic"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_an_eager_step_raises_by_the_end_of_backward_and_a_deferred_one_at_check_step(culprit, schedule):
    stack = healthy_stack(schedule=schedule)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    step(stack, x)  # a good step first: its checks are cached and resolved
    error, message = plant(stack, culprit)
    with pytest.raises(error, match=message) as eager:
        step(stack, x)
    with revtriton.deferred_checks():
        step(stack, x)  # no host sync in the step, so nothing can be raised in it
        step(stack, x)  # a second step before the check: both are resolved by it
    with pytest.raises(error, match=message) as deferred:
        revtriton.check_step()
    assert str(deferred.value) == str(eager.value)
    revtriton.check_step()  # nothing left waiting


def test_a_forward_whose_backward_never_ran_is_checked_by_the_next_forward():
    stack = healthy_stack()
    plant(stack, "overflow")
    x = torch.randn(2, 3, DIM, requires_grad=True)
    stack(x)  # a graph recorded, its backward dropped: the overflow flag waits
    with pytest.raises(OverflowError, match=OVERFLOW):
        stack(x)


# -- no optimizer step applies the gradients of a failed check ------------------------------------------


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("culprit", ["overflow", "nondeterministic"])
def test_the_optimizer_refuses_the_gradients_of_a_failed_check(culprit, deferred):
    stack = healthy_stack()
    optimizer = torch.optim.SGD(stack.parameters(), lr=0.1)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    step(stack, x)
    optimizer.step()  # a good step works
    optimizer.zero_grad()
    healthy_half = stack[1].f
    error, message = plant(stack, culprit)
    if deferred:
        with revtriton.deferred_checks():
            step(stack, x)  # the failure waits on the device
    else:
        with pytest.raises(error, match=message):
            step(stack, x)  # raised, but the gradients were accumulated
    assert any(p.grad is not None for p in stack.parameters())
    before = [p.detach().clone() for p in stack.parameters()]
    if deferred:  # the step's pre-hook resolves the waiting check first
        with pytest.raises(error, match=message):
            optimizer.step()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) refused.*exact-stream check failed"):
        optimizer.step()  # again: still refused, the gradients are the failed ones
    assert all(torch.equal(a, b) for a, b in zip(before, stack.parameters()))
    # Replaced gradients go through: zero_grad (set_to_none, the default), then a good backward.
    stack[1].f = healthy_half
    optimizer.zero_grad()
    step(stack, x)
    optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, stack.parameters()))


# -- each cached check notices the change that invalidates it ---------------------------------------------

CAPTURED = "the {} half of layer {} uses a tensor from outside the stack that requires grad"


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_module_swapped_in_between_steps_is_walked_for_captured_tensors(exact, schedule):
    stack = healthy_stack(schedule=schedule, exact=exact)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    step(stack, x)
    step(stack, x)  # the walk's result is cached now
    half = Captures(DIM)
    half.condition = torch.randn(2, 1, DIM, requires_grad=True)
    stack[2].g = half
    with pytest.raises(RuntimeError, match=CAPTURED.format("G", 2)):
        step(stack, x)


@pytest.mark.parametrize("change", ["assigned", "replaced", "requires_grad_"])
@pytest.mark.parametrize("exact", [True, False])
def test_a_captured_tensor_that_starts_requiring_grad_between_steps_is_caught(exact, change):
    half = Captures(DIM)
    if change != "assigned":  # a captured tensor that needs no gradient is fine
        half.condition = torch.randn(2, 1, DIM)
    stack = ReversibleStack([ReversibleBlock(mlp(DIM), mlp(DIM)), ReversibleBlock(half, mlp(DIM))], exact=exact)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    if change == "assigned":  # the slot holds None at first: the half adds nothing
        half.forward = lambda x: half.inner(x) + (0 if half.condition is None else half.condition)
    step(stack, x)
    step(stack, x)
    if change == "requires_grad_":
        half.condition.requires_grad_()
    else:
        half.condition = torch.randn(2, 1, DIM, requires_grad=True)
    with pytest.raises(RuntimeError, match=CAPTURED.format("F", 1)):
        step(stack, x)


class WithExtra(nn.Module):
    """A half that uses a parameter added to it later, when there is one."""

    def __init__(self):
        super().__init__()
        self.inner = mlp(DIM)

    def forward(self, x):
        extra = getattr(self, "extra", None)
        return self.inner(x) if extra is None else self.inner(x) * extra


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_parameter_added_between_steps_is_the_halfs_own_and_version_checked(schedule):
    half = WithExtra()
    stack = ReversibleStack([ReversibleBlock(mlp(DIM), half), ReversibleBlock(mlp(DIM), mlp(DIM))], schedule=schedule)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    step(stack, x)
    half.extra = nn.Parameter(torch.rand(DIM) + 0.5)
    twin = to_stored_activations(copy.deepcopy(stack))
    got = grads_of(stack, x, lambda: loss_of(stack(x)))  # its own parameter: not a captured tensor
    want = grads_of(twin, x, lambda: loss_of(twin(x)))
    assert half.extra.grad is not None
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    out = loss_of(stack(x))
    with torch.no_grad():
        half.extra.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"parameter .*extra.* was modified in place"):
        out.backward()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dropout_switched_on_between_steps_is_probed_again_and_replays_bitwise(schedule):
    """The plan records which halves draw random numbers (no RNG state is read for the others): a
    dropout rate going from 0 to 0.1, or train / eval, must bring the probe back, else the rebuild
    would draw other masks (a checksum error in exact mode, wrong gradients in float)."""
    dropouts = [nn.Dropout(0.0) for _ in range(3)]
    drop_paths = [DropPath(nn.Sequential(mlp(DIM), dropout), 0.0) for dropout in dropouts]
    stack = ReversibleStack([ReversibleBlock(half, mlp(DIM)) for half in drop_paths], schedule=schedule).train()
    x = torch.randn(4, 3, DIM, requires_grad=True)
    step(stack, x)
    step(stack, x)  # probed: no half draws
    for setting in ("dropout", "drop_path", "eval", "train"):
        if setting == "dropout":
            for dropout in dropouts:
                dropout.p = 0.1
        elif setting == "drop_path":
            for drop_path in drop_paths:
                drop_path.p = 0.2
        else:
            stack.train(setting == "train")
        twin = to_stored_activations(copy.deepcopy(stack))
        seed = int(torch.randint(0, 2**31, ()))
        torch.manual_seed(seed)
        got = grads_of(stack, x, lambda: loss_of(stack(x)))
        torch.manual_seed(seed)
        want = grads_of(twin, x, lambda: loss_of(twin(x)))
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1])), setting
