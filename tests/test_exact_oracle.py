"""Exact streams against an oracle that shares no code with the library (tests/oracle.py), and
the edges of the streams' range: overflow and NaN in each half at each block position, rows at
the range bound, constant and zero rows through the stack (issue 21)."""
import pytest
import torch
from torch import nn

import oracle
from revtriton import ReversibleBlock, ReversibleStack
from test_engine import DtypeProbe, loss_of
from twins import grads_of, mlp, rounded_forward

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def make_halves(depth, dim, dtype):
    halves = [(mlp(dim), mlp(dim)) for _ in range(depth)]
    for f, g in halves:
        for p in (*f.parameters(), *g.parameters()):
            with torch.no_grad():
                p.add_(0.1 * torch.randn_like(p))  # non-trivial norm parameters too
    return [(f.to(dtype), g.to(dtype)) for f, g in halves]


def stack_of(halves, **options):
    return ReversibleStack([ReversibleBlock(f, g) for f, g in halves], **options)


def oracle_grads(halves, stack, x, frac_bits=16):
    return grads_of(stack, x, lambda: loss_of(oracle.rounded_output(halves, x, frac_bits).float()))


def assert_bitwise(got, want):
    (gx, gp), (wx, wp) = got, want
    assert gx.dtype == wx.dtype and torch.equal(gx, wx), (gx - wx).abs().max()
    assert len(gp) == len(wp)
    for n, (a, b) in enumerate(zip(gp, wp)):
        assert a is not None and a.dtype == b.dtype, n
        assert torch.equal(a, b), (n, (a.double() - b.double()).abs().max().item())


# --------------------------------------------------------------------------------------------
# The oracle's own rounding rule, against hand-worked values


def test_oracle_rounding_rule_by_hand():
    k = 3  # grid step 1/8
    h = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49, 0.51, 7.0, -7.25]) / 8
    want = [0, 2, 2, 0, -2, -2, 0, 1, 7, -7]
    assert oracle.grid_integers(h, k, None).tolist() == want
    assert oracle.grid_integers(h.to(torch.bfloat16), k, None).tolist() == want  # exact in bf16 too
    with pytest.raises(oracle.OracleOverflow):
        oracle.grid_integers(torch.tensor([float("nan")]), k, "here")
    with pytest.raises(oracle.OracleOverflow):
        oracle.grid_integers(torch.tensor([2.0**26]), k, "here")  # 2**29 grid steps
    assert oracle.grid_integers(torch.tensor([2.0**26 - 1 / 8], dtype=torch.float64), k, None).item() == 2**29 - 1


# --------------------------------------------------------------------------------------------
# Engine and stored-activation twin against the oracle, bitwise


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_exact_stack_equals_independent_oracle_bitwise(seeded, dtype, schedule):
    """Output, input gradient and every parameter gradient equal the oracle's bitwise, for models
    held in fp32, bf16, fp16 and fp64 (halves see the model dtype, stream grads travel in fp32 /
    fp64). The library's own stored-activation twin must equal the oracle too."""
    halves = make_halves(4, 8, dtype)
    stack = stack_of(halves, schedule=schedule)
    # fp64 streams get values up to ~1e3 (~2**26 grid steps): more bits than float32 holds.
    scale = 300.0 if dtype == torch.float64 else 2.0
    x = (scale * torch.randn(2, 5, 8, dtype=torch.float64)).to(dtype).requires_grad_(True)
    with torch.no_grad():
        out, want_out = stack(x), oracle.rounded_output(halves, x)
    assert out.dtype == dtype and torch.equal(out, want_out)
    want = oracle_grads(halves, stack, x)
    assert_bitwise(grads_of(stack, x, lambda: loss_of(stack(x).float())), want)
    assert_bitwise(grads_of(stack, x, lambda: loss_of(rounded_forward(stack, x, 16).float())), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d).split(".")[1])
def test_int32_streams_equal_the_oracle_and_invert(seeded, dtype):
    """int32 in, int32 out: the halves take the parameters' dtype; the integers are the oracle's."""
    halves = make_halves(3, 8, dtype)
    stack = stack_of(halves)
    s1 = torch.randint(-(2**20), 2**20, (2, 3, 8), dtype=torch.int32)
    s2 = torch.randint(-(2**20), 2**20, (2, 3, 8), dtype=torch.int32)
    y1, y2 = stack.forward_streams(s1, s2)
    w1, w2 = oracle.integer_streams(halves, s1, s2, 16, dtype)
    assert y1.dtype == torch.int32 and torch.equal(y1.long(), w1) and torch.equal(y2.long(), w2)
    r1, r2 = stack.inverse(y1, y2)
    assert torch.equal(r1, s1) and torch.equal(r2, s2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_halves_see_the_model_dtype_and_ports_carry_fp32(seeded, dtype):
    """Like test_exact_float64_keeps_float64_precision for 16-bit models: each half's input and the
    gradient reaching its output have the model dtype; the exact couple's gradient port (the
    stream's gradient) is fp32."""
    probes = [DtypeProbe(mlp(8).to(dtype)) for _ in range(6)]
    stack = ReversibleStack([ReversibleBlock(probes[2 * i], probes[2 * i + 1]) for i in range(3)])
    x = torch.randn(2, 3, 8, dtype=dtype, requires_grad=True)
    loss_of(stack(x).float()).backward()
    assert all(p.seen == {("input", dtype), ("grad", dtype)} for p in probes)
    assert x.grad.dtype == dtype
    res = torch.randint(-(2**20), 2**20, (2, 3, 8), dtype=torch.int32)
    _, port = stack[0].g.couple(res, torch.randn(2, 3, 8, dtype=dtype, requires_grad=True), 1, 16)
    assert port.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# Range edges: overflow and NaN in each half at each position, rows at the bound


class Explode(nn.Module):
    def forward(self, x):
        return x * 1e6 + 1e6


class MakeNaN(nn.Module):
    def forward(self, x):
        return x + float("nan")


class Constant(nn.Module):
    """H(x) = c for every element (with a gradient path through x)."""

    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x * 0.0 + self.c


DEPTH = 3


@pytest.mark.parametrize("bad", ["overflow", "nan"])
@pytest.mark.parametrize("half", ["F", "G"])
@pytest.mark.parametrize("position", range(DEPTH))
def test_overflow_and_nan_are_caught_in_each_half_at_each_block(seeded, bad, half, position):
    halves = make_halves(DEPTH, 8, torch.float32)
    culprit = Explode() if bad == "overflow" else MakeNaN()
    f, g = halves[position]
    halves[position] = (culprit, g) if half == "F" else (f, culprit)
    x = torch.randn(2, 3, 8)
    assert oracle.first_overflow(halves, x) == (position, half)  # the oracle agrees where it happens
    for grad in (False, True):
        stack = stack_of(halves)
        with pytest.raises(OverflowError, match=f"the {half} half of layer {position} "):
            stack(x.clone().requires_grad_(grad)).sum().backward()  # resolved as the backward ends
    s = torch.randint(-(2**20), 2**20, (2, 3, 8), dtype=torch.int32)
    with pytest.raises(OverflowError, match=f"the {half} half of layer {position} "):
        stack.forward_streams(s, s.clone())


def test_guards_report_the_first_failed_check_in_the_order_added():
    """Range checks keep only each stream's extremes and compare them with the bound once, after
    the plain flags: the label reported is still that of the first failed check in the order the
    checks were added, whichever kind it is; an empty stream has nothing to overflow."""
    from revtriton.engine.guards import ForwardGuards

    limit = 2**29
    fits = torch.full((2, 3), limit - 1, dtype=torch.int32)
    high, low = fits.clone(), -fits
    high[1, 2], low[0, 1] = limit, -limit
    empty = torch.zeros(0, 4, dtype=torch.int32)

    def first(*checks):
        guards = ForwardGuards()
        for label, check in checks:
            if isinstance(check, tuple):
                guards.add_range(label, *check)
            else:
                guards.add(label, torch.tensor(check))
        failure = guards.first_failure()
        assert guards.first_failure() is None  # nothing kept for a second look
        return failure

    assert first(("a", False), ("b", (fits, -fits)), ("c", (empty,))) is None
    assert first(("a", False), ("b", (fits, high)), ("c", True)) == "b"
    assert first(("a", False), ("b", (fits,)), ("c", True), ("d", (low,))) == "c"
    assert first(("a", (low,)), ("b", True)) == "a"
    assert first(("a", (fits,)), ("b", False), ("c", (empty, low)), ("d", (high,))) == "c"


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("half", ["F", "G"])
def test_streams_at_the_range_bound(seeded, sign, half):
    """|X| = 2**29 - 1 fits, |X| = 2**29 is an overflow: at the input and in either half (float64
    values, which hold every grid point of the range)."""
    k, step, f64 = 16, 2.0**-16, torch.float64
    bound = 2.0 ** (29 - k)  # 8192
    inside = (sign * (bound - step) * torch.ones(2, 3, 8, dtype=f64)).requires_grad_(True)
    stack = stack_of([(Constant(0.0), Constant(0.0))])  # halves that keep the streams where they are
    loss_of(stack(inside)).backward()
    assert torch.isfinite(inside.grad).all()
    with pytest.raises(OverflowError, match="input of layer 0"):
        stack(sign * bound * torch.ones(2, 3, 8, dtype=f64)).sum().backward()
    # A half that lands its stream on the last value inside, then exactly on the bound.
    # Both streams start at sign * bound / 2 (on the grid); the other half moves its stream inwards.
    start = sign * bound / 2 * torch.ones(2, 3, 8, dtype=f64)
    for extra, fits in ((-step, True), (0.0, False)):
        outward, inward = Constant(sign * (bound / 2 + extra)), Constant(-sign * bound / 4)
        halves = [(outward, inward)] if half == "F" else [(inward, outward)]
        assert oracle.first_overflow(halves, start) == (None if fits else (0, half))
        stack = stack_of(halves)
        if fits:
            y1, y2 = stack.forward_streams(start, start)
            want1, want2, _, _ = oracle.rounded_streams(halves, start, start)
            assert torch.equal(y1, want1) and torch.equal(y2, want2)
            assert max(y1.abs().max(), y2.abs().max()).item() == bound - step
        else:
            with pytest.raises(OverflowError, match=f"the {half} half of layer 0 "):
                sum(y.sum() for y in stack.forward_streams(start, start)).backward()


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_constant_and_zero_rows_through_the_stack(seeded, schedule):
    """Rows with zero variance (constant and all-zero tokens) pass the norms with their eps: finite
    outputs and gradients, equal to the oracle bitwise."""
    halves = make_halves(3, 8, torch.float32)
    x = torch.randn(3, 4, 8)
    x[0, 1] = 0.0
    x[1, 2] = 1.5
    x[2] = -2.25  # a whole sample of constant rows
    x.requires_grad_(True)
    stack = stack_of(halves, schedule=schedule)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    assert torch.isfinite(got[0]).all() and all(torch.isfinite(p).all() for p in got[1])
    assert_bitwise(got, oracle_grads(halves, stack, x))
