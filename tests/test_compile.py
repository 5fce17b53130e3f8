"""Regional torch.compile of the halves inside a stack (issue 38 point 3): every built-in half
compiled with ``half.compile()`` runs compiled code (Dynamo's counters show graphs) and gives the
gradients of the uncompiled stack bit for bit (``aot_eager``: AOTAutograd's forward and backward
graphs, torch's own kernels), float and exact streams, with drop-path and ``nn.Dropout`` drawing.

What broke it: the engine probes a half's first forward under the RNG routing of engine.replay,
then a TorchDispatchMode: Dynamo skipped a frame it met under one and kept skipping that code for the
rest of the process (the TorchFunctionMode of today it traces, breaking its graphs at the generators).
A half that runs compiled code is never routed (engine.plan ``runs_compiled_code``); a built-in half
compiled in place couples through its compiled forward.
"""
import pytest
import torch
from torch import nn

from revtriton import (Adapter, LayerNormAttention, LayerNormMLP, ReversibleBlock, ReversibleStack,
                       RMSNormAttention, RMSNormSwiGLU)
from twins import MODES, grads_of

torch_dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

DIM, HEADS, HIDDEN = 16, 2, 32


def blocks(drop=0.0):
    """One block per pair of built-in halves (Adapter beside a generic half), ``drop``: drop-path
    of the transformer halves and an ``nn.Dropout`` after the generic half."""
    generic = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.Dropout(drop))
    return [ReversibleBlock(LayerNormAttention(DIM, HEADS, drop_path=drop), LayerNormMLP(DIM, HIDDEN, drop_path=drop)),
            ReversibleBlock(RMSNormAttention(DIM, HEADS, kv_heads=1), RMSNormSwiGLU(DIM, HIDDEN, drop_path=drop)),
            ReversibleBlock(Adapter(DIM, 8), generic)]


def twins(seed, exact, drop):
    """(a stack, its copy with every half compiled in place), equal weights (the adapter's zero
    up projection made nonzero, so gradients pass through it)."""
    torch.manual_seed(seed)
    eager = ReversibleStack(blocks(drop), exact=exact)
    nn.init.normal_(eager[2].f.up.weight, std=0.1)
    compiled = ReversibleStack(blocks(drop), exact=exact)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled:
        for half in block.coupling_halves():
            half.compile(backend="aot_eager")
    return eager, compiled


def step_grads(stack, x, seed):
    torch.manual_seed(seed)  # the same draws in both twins (each half's masks are a plain run's)
    return grads_of(stack, x, lambda: stack(x).square().sum())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch_dynamo.reset()
    counters.clear()
    yield
    torch_dynamo.reset()


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("drop", [0.0, 0.2], ids=["no-draws", "drop-path+dropout"])
def test_every_builtin_half_compiled_in_place_runs_compiled_and_matches_eager(seeded, exact, drop, monkeypatch):
    from revtriton.engine import replay

    eager, compiled = twins(seeded, exact, drop)
    x = torch.randn(2, 4, DIM, requires_grad=True)
    want = step_grads(eager, x, seeded)
    routings = []

    class CountedRouting(replay._RoutedToHalf):
        def __init__(self, half):
            super().__init__(half)
            routings.append(self)

    monkeypatch.setattr(replay, "_RoutedToHalf", CountedRouting)
    for _ in range(2):  # the first step probes how each half draws, the second runs as planned
        got = step_grads(compiled, x, seeded)
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert counters["stats"]["unique_graphs"] >= 6, dict(counters["stats"])  # six half classes
    assert not routings  # no compiled half under the routing mode (Dynamo would break its graphs there)


def test_a_half_compiled_after_its_first_step_then_runs_compiled(seeded):
    """The plan sees ``module.compile()`` (its signature reads each module's compiled call): a half
    probed as drawing with no generator (``nn.Dropout``, routed) is probed again, unrouted."""
    torch.manual_seed(seeded)
    generic = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.Dropout(0.2))
    stack = ReversibleStack([ReversibleBlock(LayerNormMLP(DIM, HIDDEN), generic)])
    x = torch.randn(2, 4, DIM, requires_grad=True)
    want = step_grads(stack, x, seeded)
    stack[0].g.compile(backend="aot_eager")  # the GenericHalf around it (torch.nn's own module classes
    # compiled in place compile nothing: Dynamo skips their frames as torch's)
    got = step_grads(stack, x, seeded)
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_a_half_wrapping_a_torch_compiled_module_is_not_routed():
    from revtriton.engine.plan import runs_compiled_code

    inner = nn.Linear(DIM, DIM)
    assert not runs_compiled_code(nn.Sequential(inner))
    assert runs_compiled_code(nn.Sequential(torch.compile(inner, backend="eager")))
    half = LayerNormMLP(DIM, HIDDEN)
    half.norm.compile(backend="eager")
    assert runs_compiled_code(half)


def test_a_half_wrapped_by_torch_compile_is_told_to_compile_in_place():
    """torch.compile(half) returns a wrapper whose attributes are the half's: the engine would call
    the half's own, uncompiled couple(). Said at once, with what to do."""
    with pytest.warns(UserWarning, match=r"torch.compile\(LayerNormMLP.*half.compile\(\)"):
        ReversibleBlock(torch.compile(LayerNormMLP(DIM, HIDDEN), backend="eager"), LayerNormMLP(DIM, HIDDEN))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compiled plain module becomes a GenericHalf around the wrapper: compiled
        ReversibleBlock(LayerNormMLP(DIM, HIDDEN), torch.compile(nn.Linear(DIM, DIM), backend="eager"))
