"""Couples bound to their call signature (issue 44 step 5): a half's repeated call runs through a
runner that ops.dispatch.run_bound kept at the first call of its key (no checks, no dispatch, no
plan lookup). It must give the bits of the checked path, and a change of anything the signature or
the choice is made of must be seen at the next call, as the checked path sees it.

Each result here is compared with the checked path's on the same inputs: the runners dropped (the
first call takes the checked path), so "bound" and "checked" differ only in the route taken.
"""
import copy
import pickle

import pytest
import torch
from torch import nn

from revtriton import LayerNormAttention, LayerNormMLP, RMSNormAttention, RMSNormSwiGLU
from revtriton.ops import attention, backend, dispatch, mlp
from revtriton.ops.streams import to_fixed

from launch_plans import strided_copy

DIM, HIDDEN, HEADS, TOKENS = 32, 48, 2, 5
HALVES = {
    "LayerNormMLP": lambda: LayerNormMLP(DIM, HIDDEN),
    "RMSNormSwiGLU": lambda: RMSNormSwiGLU(DIM, HIDDEN),
    "LayerNormAttention": lambda: LayerNormAttention(DIM, HEADS, causal=True),
    "RMSNormAttention": lambda: RMSNormAttention(DIM, HEADS, kv_heads=1),
}
PATHS = {"reference": lambda: dispatch.force_triton(False), "fused": lambda: dispatch.force_triton(True)}


@pytest.fixture
def dispatched(monkeypatch):
    """Counts the couples that took the checked path (through run_op); returns the list."""
    taken = []
    for module in (mlp, attention):
        real = module.run_op
        monkeypatch.setattr(module, "run_op", lambda op, *a, _real=real, **k: taken.append(op) or _real(op, *a, **k))
    return taken


def inputs(batch=2, exact=False, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, TOKENS, DIM, generator=gen, dtype=dtype)
    res = torch.randn(batch, TOKENS, DIM, generator=gen, dtype=dtype)
    return (to_fixed(res, 16) if exact else res), x


def call(half, res, x, sign=1, frac_bits=None, grad=False):
    """The couple's outputs, and with ``grad`` (a rebuild: sign -1 in the engine) its backward's
    gradients w.r.t. x and every parameter that needs one."""
    if not grad:
        with torch.no_grad():
            stream, port = half.couple(res, x, sign, frac_bits)
        assert port is None
        return [stream]
    x = x.detach().requires_grad_()
    half.zero_grad(set_to_none=True)
    stream, port = half.couple(res, x, sign, frac_bits)
    port.backward(torch.linspace(-1, 1, port.numel()).view(port.shape).to(port.dtype))
    return [stream, x.grad] + [p.grad for p in half.parameters()]


def checked(half, *args, **options):
    dispatch.forget_runners()
    return call(half, *args, **options)


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b), (a, b)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", HALVES)
def test_a_bound_couple_gives_the_checked_paths_bits(name, path, dispatched):
    """Forward (float and exact streams) and the rebuild with its backward: the second and third
    calls of a signature run bound (no dispatch) and equal the checked first call bitwise."""
    torch.manual_seed(0)
    half = HALVES[name]()
    with PATHS[path]():
        for exact, grad in ((False, False), (True, False), (False, True)):
            res, x = inputs(exact=exact)
            frac_bits = 16 if exact else None
            sign = -1 if grad else 1
            want = checked(half, res, x, sign, frac_bits, grad=grad)
            dispatched.clear()
            for _ in range(2):
                assert_same(call(half, res, x, sign, frac_bits, grad=grad), want)
            assert dispatched == [], "a repeated call took the checked path"


def _replace_weight(half):
    half.fc1.weight = nn.Parameter(torch.randn_like(half.fc1.weight))


def _replace_module(half):
    half.fc2 = nn.Linear(HIDDEN, DIM)


def _freeze(half):
    half.fc1.weight.requires_grad_(False)


def _eps(half):
    half.eps = 0.5


def _activation(half):
    half.activation = "relu"


CHANGES = {  # what a user does between two steps: (change the half, change the inputs)
    "weight replaced": (_replace_weight, None),
    "module replaced": (_replace_module, None),
    "weights updated in place": (lambda half: half.fc1.weight.data.mul_(2), None),
    "frozen weight": (_freeze, None),
    "eps": (_eps, None),
    "activation": (_activation, None),
    "float64": (lambda half: half.double(), lambda res, x: (res.double(), x.double())),
    "more rows": (None, lambda res, x: (torch.cat([res, res]), torch.cat([x, x.flip(0)]))),
    "strided input": (None, lambda res, x: (res, strided_copy(x.flip(0)))),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("change", CHANGES)
def test_a_change_between_calls_is_seen_by_the_next_call(change, path):
    """The rebuild and its backward, bound at the first call; then a change: the next call equals
    the checked path's after the change (and differs from the first call's result: the change
    matters)."""
    change_half, change_inputs = CHANGES[change]
    torch.manual_seed(0)
    half = LayerNormMLP(DIM, HIDDEN)
    res, x = inputs()
    with PATHS[path]():
        before = call(half, res, x, -1, None, grad=True)
        call(half, res, x, -1, None, grad=True)  # bound
        if change_half is not None:
            change_half(half)
        if change_inputs is not None:
            res, x = change_inputs(res, x)
        got = call(half, res, x, -1, None, grad=True)
        want = checked(half, res, x, -1, None, grad=True)
    assert_same(got, want)
    assert any(a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b)
               for a, b in zip(got, before))


def test_the_dispatch_state_is_seen_by_the_next_call(dispatched):
    """force_triton, the backend override (context and environment), backend.reset() and a
    candidate registered: each decides where the next call runs, bound or not."""
    torch.manual_seed(0)
    half = LayerNormMLP(DIM, HIDDEN)
    res, x = inputs()

    def launches():
        with dispatch.count_launches() as counted:
            call(half, res, x)
        return counted.total()

    assert launches() == launches() == 0  # the reference on CPU
    with dispatch.force_triton():
        assert launches() == launches() == 3
        with backend.use_backend("torch"):
            assert launches() == 0
        assert launches() == 3
        dispatched.clear()
        backend.reset()
        assert launches() == 3 and dispatched == ["norm_mlp"]
        backend.register_candidate("norm_mlp", "fake", mlp._norm_mlp_torch)
        try:
            dispatched.clear()
            assert launches() == 3 and dispatched == ["norm_mlp"]
        finally:
            backend.unregister_candidate("norm_mlp", "fake")
    assert launches() == 0


def test_the_environment_override_is_seen_by_the_next_call(monkeypatch):
    torch.manual_seed(0)
    half = LayerNormMLP(DIM, HIDDEN)
    res, x = inputs()
    with dispatch.force_triton():
        for _ in range(2):
            with dispatch.count_launches() as counted:
                call(half, res, x)
            assert counted.total() == 3
        monkeypatch.setenv(backend.ENV_BACKEND, "torch")
        with dispatch.count_launches() as counted:
            call(half, res, x)
        assert counted.total() == 0


def test_grad_mode_autocast_and_drawing_take_their_own_paths(dispatched):
    """Grad mode on with nothing requiring grad, autocast, and drop-path while training (each call
    draws: never bound) all run as the checked path does."""
    torch.manual_seed(0)
    half = LayerNormMLP(DIM, HIDDEN).requires_grad_(False)
    res, x = inputs()
    with dispatch.force_triton():
        want = checked(half, res, x)
        for _ in range(2):  # grad mode on, nothing requires grad: no port, the same bits
            stream, port = half.couple(res, x, 1, None)
            assert port is None and torch.equal(stream, want[0])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = checked(half, res, x)
            assert_same(call(half, res, x), want)
        half.drop_path = 0.5
        half.train()
        results = []
        for _ in range(2):
            torch.manual_seed(3)
            dispatched.clear()
            results.append(call(half, res, x))
            assert dispatched == ["norm_mlp"]
        assert_same(results[0], results[1])
        half.eval()
        dispatched.clear()
        call(half, res, x)
        call(half, res, x)
        assert dispatched == ["norm_mlp"]


def test_a_half_pickles_and_copies_after_bound_calls():
    """Runners are kept by dispatch, not on the half: a half pickles and copies as before, and its
    copies share the original's runners (a runner is a function of its key alone)."""
    torch.manual_seed(0)
    half = RMSNormAttention(DIM, HEADS, kv_heads=1)
    res, x = inputs()
    with dispatch.force_triton():
        want = call(half, res, x)
        call(half, res, x)
        for other in (pickle.loads(pickle.dumps(half)), copy.deepcopy(half)):
            assert_same(call(other, res, x), want)


def test_halves_of_other_widths_and_blocks_of_a_model_share_runners_only_by_key(dispatched):
    """Every block of a model shares one runner per signature; a half of another width gets its own."""
    torch.manual_seed(0)
    halves = [LayerNormMLP(DIM, HIDDEN) for _ in range(3)]
    res, x = inputs()
    with dispatch.force_triton():
        dispatch.forget_runners()
        want = [checked(h, res, x) for h in halves]
        dispatched.clear()
        assert all(call(h, res, x)[0].equal(w[0]) for h, w in zip(halves, want)) and dispatched == []
        wide = LayerNormMLP(DIM, 2 * HIDDEN)
        call(wide, res, x)
        assert dispatched == ["norm_mlp"]


@pytest.mark.parametrize("path", PATHS)
def test_weights_unfrozen_between_calls_get_their_gradients(path):
    """Grad mode on, the input needs no gradient (a stack's first block): a frozen half needs no
    graph, the same half unfrozen does, and the next call must build it."""
    torch.manual_seed(0)
    half = RMSNormSwiGLU(DIM, HIDDEN).requires_grad_(False)
    res, x = inputs()
    with PATHS[path]():
        for _ in range(2):
            assert half.couple(res, x, 1, None)[1] is None
        half.requires_grad_(True)
        stream, port = half.couple(res, x, 1, None)
        port.sum().backward()
        got = [stream] + [p.grad for p in half.parameters()]
        half.zero_grad(set_to_none=True)
        dispatch.forget_runners()
        stream, port = half.couple(res, x, 1, None)
        port.sum().backward()
        want = [stream] + [p.grad for p in half.parameters()]
    assert all(g is not None for g in got)
    assert_same(got, want)


@pytest.mark.parametrize("path", PATHS)
def test_a_couple_that_transforms_its_tensors_is_not_bound_and_tensor_options_are_each_calls(path, dispatched):
    """run_bound binds only the run_op call its couple made on the caller's very tensors: a couple
    that hands run_op another tensor (here a doubled weight) stays checked. Options holding a tensor
    (a row scale) are each call's: never kept."""
    torch.manual_seed(0)
    half = LayerNormMLP(DIM, HIDDEN)
    res, x = inputs()
    weights, options = half.weights(), half.options()

    def doubled(res, x, sign, frac_bits, norm_weight, norm_bias, w1, *rest, **options):
        return mlp.norm_mlp_couple(res, x, sign, frac_bits, norm_weight, norm_bias, 2 * w1, *rest, **options)

    with PATHS[path](), torch.no_grad():
        first = dispatch.run_bound(doubled, res, x, 1, None, weights, options)[0]
        for _ in range(2):
            assert torch.equal(dispatch.run_bound(doubled, res, x, 1, None, weights, options)[0], first)
        scales = [torch.rand(2, TOKENS), torch.rand(2, TOKENS)]
        dispatched.clear()
        got = [dispatch.run_bound(mlp.norm_mlp_couple, res, x, 1, None, weights, dict(options, row_scale=s))[0]
               for s in scales]
        assert dispatched == ["norm_mlp"] * 2
        want = [mlp.norm_mlp_couple(res, x, 1, None, *weights, **options, row_scale=s)[0] for s in scales]
    assert_same(got, want)
    assert not torch.equal(got[0], got[1])  # each call's row scale, not the first's
