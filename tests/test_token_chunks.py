"""Halves run by chunks of token rows: ``ReversibleStack(token_chunk=N)`` (revtriton.engine.rows, issue 36)."""
import pytest
import torch
from torch import nn

from revtriton import (LayerNormAttention, LayerNormMLP, ReversibleBlock, ReversibleStack, RMSNormAttention,
                       RMSNormSwiGLU)
from revtriton.engine.rows import RowChunks, row_chunks
from revtriton.halves.base import CouplingHalf, GenericHalf
from revtriton.ops.streams import ResidualScale
from revtriton.profiling import peak_memory
from twins import MODES, grads_of, max_rel_error, mlp, plain_forward, rounded_forward

DIM = 8
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_seed(seeded):
    return seeded


class RowsMLP(CouplingHalf):
    """An MLP half that declares its rows independent and records the rows of every call."""

    rows_independent = True

    def __init__(self, dim, hidden=None, dropout=0.0):
        super().__init__()
        self.inner = mlp(dim, hidden, dropout)
        self.rows_seen = []

    def forward(self, x):
        self.rows_seen.append(x.numel() // x.shape[-1])
        return self.inner(x)


def rows_stack(depth, chunk, exact, schedule="sequential", dtype=torch.float64, dropout=0.0, hidden=None):
    blocks = [ReversibleBlock(RowsMLP(DIM, hidden, dropout), RowsMLP(DIM, hidden, dropout)) for _ in range(depth)]
    return ReversibleStack(blocks, exact=exact, schedule=schedule, token_chunk=chunk).to(dtype)


def loss_of(out):
    return (out * torch.linspace(-1, 2, out.shape[-1], dtype=out.dtype)).square().sum()


def seen(stack):
    """Every half's recorded rows, then cleared."""
    rows = []
    for block in stack:
        for half in block.coupling_halves():
            rows.append(list(half.rows_seen))
            half.rows_seen.clear()
    return rows


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("depth", [2, 3])
def test_chunked_stack_gradients_match_plain_autograd(exact, schedule, depth):
    """15 rows in chunks of 4 (4, 4, 4, 3). Float streams against plain autograd, exact streams against
    the rounded model they compute; float64: the chunked GEMMs differ from the whole ones in the last
    bits at most, far below 1e-10 (an exact stream's grid point flips only where a value lies within
    1e-16 of a rounding boundary)."""
    stack = rows_stack(depth, 4, exact, schedule)
    x = torch.randn(3, 5, DIM, dtype=torch.float64, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    twin = (lambda: loss_of(rounded_forward(stack, x, 16))) if exact else (lambda: loss_of(plain_forward(stack, x)))
    want = grads_of(stack, x, twin)
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_forward_rebuild_and_inverse_run_the_same_chunks(schedule):
    """Every pass splits the rows at the same multiples of token_chunk: an exact stack's rebuild adds back
    what its forward added only if each chunk is computed as it was."""
    stack = rows_stack(2, 4, True, schedule)
    x = (torch.randn(3, 5, DIM, dtype=torch.float64) * 2**16).round() / 2**16  # on the streams' grid
    x.requires_grad_()
    y1, y2 = stack.forward_streams(x, x)
    assert seen(stack) == [[4, 4, 4, 3]] * 4
    (y1 * y2).sum().backward()
    assert seen(stack) == [[4, 4, 4, 3]] * 4
    x1, x2 = stack.inverse(y1.detach(), y2.detach())
    assert torch.equal(x1, x) and torch.equal(x2, x)
    assert seen(stack) == [[4, 4, 4, 3]] * 4
    with torch.no_grad():
        stack(x)
    assert seen(stack) == [[4, 4, 4, 3]] * 4
    stack.token_chunk = 15  # as many rows as there are: whole
    stack(x).sum().backward()
    assert seen(stack) == [[15, 15]] * 4


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_draws_are_replayed_chunk_by_chunk(schedule):
    """Dropout in a chunked half, exact streams: the rebuild redraws each chunk's mask as the forward drew
    it (the backward's checksum compares every rebuilt stream with the forward's: a differing mask would
    raise) and the gradients are the rounded model's under the same draws: the input's bitwise, the
    parameters' summed chunk by chunk (float64: the order of a 15-row sum moves the last bits only)."""
    stack = rows_stack(3, 4, True, schedule, dropout=0.3).train()
    x = torch.randn(3, 5, DIM, dtype=torch.float64, requires_grad=True)
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    # The twin runs each half on the same chunks (the halves draw per call): the masks are the forward's.
    for block in stack:
        for half in block.coupling_halves():
            half.forward = chunked(half.forward, 4)
    torch.manual_seed(seed)
    want = grads_of(stack, x, lambda: loss_of(rounded_forward(stack, x, 16)))
    assert torch.equal(got[0], want[0])
    assert max_rel_error(got[1], want[1]) <= 1e-12


def chunked(forward, rows):
    def run(x):
        flat = x.reshape(-1, x.shape[-1])
        return torch.cat([forward(flat[i:i + rows]) for i in range(0, flat.shape[0], rows)]).view_as(x)
    return run


def test_which_halves_run_by_chunks():
    x = torch.randn(2, 9, 16)
    mlp_half = LayerNormMLP(16, 32)
    assert row_chunks(mlp_half, x, 8).bounds == [(0, 8), (8, 16), (16, 18)]
    assert row_chunks(RMSNormSwiGLU(16, 32), x, 8) is not None
    assert row_chunks(mlp_half, x, None) is None  # no token_chunk
    assert row_chunks(mlp_half, x, 18) is None  # no more rows than a chunk
    assert row_chunks(mlp_half, x, 8, scale=ResidualScale(0.5)) is None  # a scaled coupling
    drop_path = LayerNormMLP(16, 32, drop_path=0.2)
    assert row_chunks(drop_path.train(), x, 8) is None  # a per-sample draw
    assert row_chunks(drop_path.eval(), x, 8) is not None
    attention = LayerNormAttention(16, 2)  # tokens see each other, samples do not: whole samples a chunk
    assert row_chunks(attention, x, 9) == RowChunks([(0, 9), (9, 18)], (9, 16), 2)
    assert row_chunks(attention, x, 18) is None
    assert row_chunks(attention, x[:1], 8) is None  # one sample, shorter (9 tokens) than its width (16)
    # A sample longer than a chunk and than its width: the half in head groups, as many as the chunk asks
    # (ceil(17 / 9) = 2), at most the kv heads, a divisor of them.
    long = torch.randn(2, 17, 16)
    assert row_chunks(attention, long, 9) == RowChunks([(0, 17), (17, 34)], (17, 16), 2, parts=2)
    assert row_chunks(attention, long[:1], 9) == RowChunks([(0, 17)], (17, 16), 1, parts=2)
    assert row_chunks(attention, long[:1], 17) is None  # one sample that fits
    assert row_chunks(attention, long[:1], 2).parts == 2  # 9 asked, 2 heads
    assert row_chunks(RMSNormAttention(16, 4), long[:1], 6).parts == 2  # 3 asked: 2 divides the 4 heads
    assert row_chunks(RMSNormAttention(16, 4, kv_heads=2), long[:1], 1).parts == 2  # a kv head a group at most
    assert row_chunks(RMSNormAttention(16, 4, kv_heads=1), long[:1], 1) is None
    assert row_chunks(LayerNormAttention(16, 2, drop_path=0.2).train(), long[:1], 8) is None  # a draw a call
    assert row_chunks(LayerNormAttention(16, 2, drop_path=0.2).eval(), long[:1], 8).parts == 2
    assert row_chunks(GenericHalf(nn.Linear(16, 16)), x, 8) is None  # undeclared

    class Conditioned(RowsMLP):
        def forward(self, x, cond=None):
            return super().forward(x)

    assert row_chunks(Conditioned(16), x, 8, cond=torch.ones(2, 16)) is None
    assert row_chunks(Conditioned(16), x, 8) is not None
    conditioned = SamplesHalf(16, conditioned=True)
    assert row_chunks(conditioned, x, 8, cond=torch.ones(2, 16)) is not None  # it splits its conditioning
    assert row_chunks(conditioned, x, 8, cond=torch.ones(3, 16)) is None  # ... where it can
    conditioned.cond_samples = None
    assert row_chunks(conditioned, x, 8, cond=torch.ones(2, 16)) is None


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_transformer_halves_by_chunks_match_the_whole_stack(exact, schedule):
    """The transformer halves (CPU reference path): the MLP by 5 rows, attention a sample at a time."""
    def build(chunk):
        torch.manual_seed(1)
        blocks = [ReversibleBlock(LayerNormAttention(16, 2, causal=True), LayerNormMLP(16, 64)) for _ in range(3)]
        return ReversibleStack(blocks, exact=exact, schedule=schedule, token_chunk=chunk).double()

    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    whole, by_chunks = build(None), build(5)
    want = grads_of(whole, x, lambda: loss_of(whole(x)))
    got = grads_of(by_chunks, x, lambda: loss_of(by_chunks(x)))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-12


def test_sequential_peak_falls_with_the_chunk():
    """MLP halves 32x as wide as the streams, 512 rows: whole, a half's hidden activations (three of
    [512, 256] float32, 512 KiB each, in its rebuild and backward) dwarf the streams (16 KiB); in chunks of
    32 rows they are 32 KiB each, so the step's peak falls to well under half."""
    x = torch.randn(4, 128, DIM)

    def peak(chunk):
        torch.manual_seed(0)
        stack = rows_stack(2, chunk, True, dtype=torch.float32, hidden=32 * DIM)

        def step():
            stack(x.requires_grad_()).sum().backward()

        step()
        return peak_memory(step)

    whole, chunks = peak(None), peak(32)
    assert chunks <= 0.4 * whole, (whole, chunks)


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_each_chunks_input_gradient_goes_straight_into_the_engines_gradient(schedule, monkeypatch):
    """The sequential step subtracts each chunk's input gradient from the block's other gradient (the
    engine's own buffer) at once, so no stream-sized gradient is put together; PaReprop, whose gradients
    run after the whole rebuild, puts them together."""
    from revtriton.engine import segment

    put = []
    real = segment._put_rows
    monkeypatch.setattr(segment, "_put_rows", lambda *args: put.append(args[2]) or real(*args))
    stack = rows_stack(2, 4, False, schedule)
    x = torch.randn(3, 5, DIM, dtype=torch.float64, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    assert (len(put) == 0) == (schedule == "sequential"), put
    want = grads_of(stack, x, lambda: loss_of(plain_forward(stack, x)))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10


def test_gradients_of_another_layout_are_not_written_through_a_copy():
    """The streams' gradients as autograd hands them may have any strides (here transposed): a chunk's
    input gradient is subtracted in place only from a contiguous one (a reshape of another is a copy)."""
    from revtriton.models.common import stored_float_streams

    stack = rows_stack(2, 4, False)
    x1, x2 = (torch.randn(3, 5, DIM, dtype=torch.float64, requires_grad=True) for _ in range(2))
    g1, g2 = (torch.randn(5, 3, DIM, dtype=torch.float64).transpose(0, 1) for _ in range(2))
    torch.autograd.backward(stack.forward_streams(x1, x2), (g1, g2))
    got = [x1.grad, x2.grad] + [p.grad for p in stack.parameters()]
    x1.grad = x2.grad = None
    stack.zero_grad(set_to_none=True)
    torch.autograd.backward(stored_float_streams(list(stack), x1, x2), (g1, g2))
    want = [x1.grad, x2.grad] + [p.grad for p in stack.parameters()]
    assert max_rel_error(got, want) <= 1e-10


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_a_parameters_gradient_hooks_fire_once_with_the_whole_gradient(schedule):
    """Each chunk adds to a parameter's gradient; its accumulation hooks (DDP's reducer,
    ``register_post_accumulate_grad_hook``: an optimizer step in backward) fire once a backward, with
    the gradient of every chunk in (tests/test_distributed.py runs DDP itself)."""
    assert_hooks_fire_once_with_the_whole_gradient(rows_stack(2, 4, False, schedule),
                                                   torch.randn(3, 5, DIM, dtype=torch.float64, requires_grad=True))


def assert_hooks_fire_once_with_the_whole_gradient(stack, x):
    """Every parameter's accumulation hook fires once in a step, with its final gradient: plain autograd's."""
    seen = {}
    for p in stack.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.setdefault(p, []).append(p.grad.clone()))
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    assert len(seen) == len(list(stack.parameters())) and all(len(g) == 1 for g in seen.values())
    assert all(torch.equal(seen[p][0], p.grad) for p in stack.parameters())
    want = grads_of(stack, x, lambda: loss_of(plain_forward(stack, x)))
    assert max_rel_error(got[1], want[1]) <= 1e-10


def test_backward_hooks_see_the_gradients_of_a_chunked_block():
    """A block with a full backward pre-hook: G's chunks run their backward after the hook (with its
    gradient), not at their rebuild."""
    stack = rows_stack(2, 4, False)
    x = torch.randn(3, 5, DIM, dtype=torch.float64, requires_grad=True)
    want = grads_of(stack, x, lambda: loss_of(stack(x)))
    stack[1].register_full_backward_pre_hook(lambda module, grads: tuple(2 * g for g in grads))
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    assert max_rel_error([got[0]] + got[1], [2 * want[0]] + [2 * g for g in want[1]]) <= 1e-12


class SamplesHalf(CouplingHalf):
    """A half whose tokens see each other (each row gets its sample's mean), samples independent;
    records the samples of every call. ``conditioned``: adds a per-sample conditioning row."""

    samples_independent = True

    def __init__(self, dim, conditioned=False):
        super().__init__()
        self.inner, self.conditioned, self.samples_seen = mlp(dim), conditioned, []

    def forward(self, x, cond=None):
        self.samples_seen.append(x.shape[0])
        h = self.inner(x + x.mean(dim=1, keepdim=True))
        return h if cond is None else h * cond[:, None, :]

    @property
    def takes_cond(self):
        return self.conditioned

    def cond_samples(self, cond, start, stop, samples):
        return cond[start:stop] if cond.shape[0] == samples else None


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("conditioned", [False, True], ids=["plain", "conditioned"])
def test_halves_by_samples_match_plain_autograd(exact, schedule, conditioned):
    """5 samples of 3 tokens, token_chunk 7: two samples a chunk (2, 2, 1), the conditioning split with
    them (its gradient every chunk's); float64 against plain autograd / the rounded model."""
    blocks = [ReversibleBlock(SamplesHalf(DIM, conditioned), RowsMLP(DIM)) for _ in range(3)]
    stack = ReversibleStack(blocks, exact=exact, schedule=schedule, token_chunk=7).double()
    x = torch.randn(5, 3, DIM, dtype=torch.float64, requires_grad=True)
    cond = (1 + 0.3 * torch.randn(5, DIM, dtype=torch.float64)).requires_grad_() if conditioned else None
    got = grads_of(stack, x, lambda: loss_of(stack(x, cond=cond)))
    got_cond = None if cond is None else cond.grad.clone()
    assert [block.f.samples_seen for block in stack] == [[2, 2, 1] * 2] * 3  # forward, rebuild
    if cond is not None:
        cond.grad = None
    twin = (lambda: rounded_forward(stack, x, 16, cond)) if exact else (lambda: plain_forward(stack, x, cond))
    want = grads_of(stack, x, lambda: loss_of(twin()))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10
    if cond is not None:
        assert max_rel_error([got_cond], [cond.grad]) <= 1e-10


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_token_chunk_must_be_a_positive_int(bad):
    with pytest.raises((TypeError, ValueError), match="token_chunk"):
        ReversibleStack([ReversibleBlock(RowsMLP(DIM), RowsMLP(DIM))], token_chunk=bad)


@pytest.mark.parametrize("exact", MODES)
def test_the_fused_kernels_by_chunks_match_the_whole_fused_stack(exact):
    """The Triton halves (the interpreter, force_triton) on chunks: the MLP by 4 of 15 rows (a last chunk of
    3), the attention a sample at a time (causal, RoPE, grouped-query): each chunk shape its own launch
    plan and bound runner. Against the same fused stack run whole, float32: the kernels' sums over other
    row counts and the parameters' chunk-by-chunk sums move the last bits (float streams: 1e-5 relative,
    about 100 ulps; 4.7e-7 the worst of 12 seeds); on exact streams a half output within that rounding of
    a grid midpoint also lands on the neighbouring grid point, 2**-16 away (1e-4; 5.2e-6 the worst of 12
    seeds). An exact rebuild is checked bitwise by the backward's checksum."""
    from revtriton.ops import dispatch

    def build(chunk):
        torch.manual_seed(3)
        blocks = [ReversibleBlock(RMSNormAttention(32, 2, kv_heads=1), RMSNormSwiGLU(32, 48)) for _ in range(2)]
        return ReversibleStack(blocks, exact=exact, token_chunk=chunk)

    x = torch.randn(3, 5, 32, requires_grad=True)
    with dispatch.force_triton():
        whole, by_chunks = build(None), build(4)
        want = grads_of(whole, x, lambda: loss_of(whole(x)))
        got = grads_of(by_chunks, x, lambda: loss_of(by_chunks(x)))
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= (1e-4 if exact else 1e-5)


# -- a sample longer than a chunk: the attention half in head groups -------------------------------------


def attention_weights(dim, heads, kv_heads, bias, dtype=torch.float64):
    head_dim = dim // heads
    qkv_rows = (heads + 2 * kv_heads) * head_dim

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype)

    return (rand(dim) + 1, rand(dim) if bias else None, rand(qkv_rows, dim) / dim ** 0.5,
            rand(qkv_rows) if bias else None, rand(dim, dim) / dim ** 0.5, rand(dim) if bias else None)


@pytest.mark.parametrize("heads,kv_heads,parts", [(4, 4, 2), (4, 4, 4), (8, 4, 2), (8, 2, 2), (6, 3, 3)])
@pytest.mark.parametrize("norm,bias,rope", [("layer", True, None), ("rms", False, 10000.0)])
def test_head_groups_sum_to_the_half(heads, kv_heads, parts, norm, bias, rope):
    """H = the sum over head groups (ops.attention.head_group), the out projection's bias in the first:
    float64, causal, grouped-query (a group keeps each q head with its kv head), values and gradients up
    to the sum's rounding (1e-12 relative)."""
    from revtriton.ops.attention import head_group, norm_attention_reference

    weights = [None if w is None else w.requires_grad_() for w in attention_weights(48, heads, kv_heads, bias)]
    options = dict(heads=heads, kv_heads=kv_heads, causal=True, rope_theta=rope, norm=norm, eps=1e-6)
    x = torch.randn(2, 7, 48, dtype=torch.float64, requires_grad=True)
    leaves = [x] + [w for w in weights if w is not None]
    probe = torch.randn(2, 7, 48, dtype=torch.float64)
    whole = norm_attention_reference(x, *weights, **options)
    want = torch.autograd.grad((whole * probe).sum(), leaves)
    summed = sum(norm_attention_reference(x, *w, **o) for w, o in (head_group(weights, options, p, parts)
                                                                   for p in range(parts)))
    got = torch.autograd.grad((summed * probe).sum(), leaves)
    assert max_rel_error([summed], [whole]) <= 1e-12
    assert max_rel_error(got, want) <= 1e-12


def test_head_groups_are_divisors_of_the_kv_heads():
    from revtriton.ops.attention import head_group, head_group_parts

    assert [head_group_parts(12, wanted, 768, 768) for wanted in (1, 2, 5, 8, 12, 100)] == [1, 2, 4, 6, 12, 12]
    assert head_group_parts(4, 3, 64, 64) == 2 and head_group_parts(1, 8, 64, 64) == 1
    # Samples shorter than their width: a group's weight-sized gradient outweighs what the groups save.
    assert head_group_parts(12, 8, 767, 768) == 1
    weights = attention_weights(16, 4, 2, True)
    for part, parts in ((0, 3), (2, 2), (-1, 2)):
        with pytest.raises(ValueError, match="head group"):
            head_group(weights, dict(heads=4, kv_heads=2), part, parts)


def counting_parts(monkeypatch):
    """Count the calls of the attention halves' part_output (a test that means head groups runs them)."""
    calls = []
    real = RMSNormAttention.part_output

    def count(self, part, parts, x):
        calls.append((part, parts, tuple(x.shape)))
        return real(self, part, parts, x)

    monkeypatch.setattr(RMSNormAttention, "part_output", count)
    monkeypatch.setattr(LayerNormAttention, "part_output", count)
    return calls


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("depth", [2, 3])
def test_attention_in_head_groups_matches_plain_autograd(exact, schedule, depth, monkeypatch):
    """Samples of 17 tokens, token_chunk 4: each attention half in 2 head groups of its 4 (2 kv heads, so 2
    at most: each group a kv head and its two q heads; GQA, RoPE, causal), a sample a chunk, the MLP by
    4 rows. Float64 against plain autograd / the rounded model: the parts' sum rounds as the whole
    GEMM's does not, in the last bits; an exact stream's grid point flips only where a value lies within
    that of a rounding boundary (the forward and its rebuild round the same sum: the backward's checksum
    holds them bitwise equal, the inverse too)."""
    calls = counting_parts(monkeypatch)
    torch.manual_seed(2)
    blocks = [ReversibleBlock(RMSNormAttention(16, 4, kv_heads=2), RMSNormSwiGLU(16, 24)) for _ in range(depth)]
    stack = ReversibleStack(blocks, exact=exact, schedule=schedule, token_chunk=4).double()
    x = torch.randn(2, 17, 16, dtype=torch.float64, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    # forward and rebuild: each block's F in 2 parts, a sample at a time
    assert calls == [(p, 2, (1, 17, 16)) for _ in range(2 * depth) for _ in range(2) for p in range(2)]
    twin = (lambda: loss_of(rounded_forward(stack, x, 16))) if exact else (lambda: loss_of(plain_forward(stack, x)))
    want = grads_of(stack, x, twin)
    assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10
    if exact:
        xq = (x.detach() * 2**16).round() / 2**16
        y1, y2 = stack.forward_streams(xq, xq)
        x1, x2 = stack.inverse(y1, y2)
        assert torch.equal(x1, xq) and torch.equal(x2, xq)


def test_head_groups_are_taken_only_where_a_sample_is_longer_than_a_chunk(monkeypatch):
    """A chunk that holds a sample keeps the half whole, and so does a sample shorter than its width; a
    half whose drop-path draws is never split (its row scale is drawn per call)."""
    calls = counting_parts(monkeypatch)
    short = torch.randn(2, 9, 16, requires_grad=True)
    ReversibleStack([ReversibleBlock(LayerNormAttention(16, 2), LayerNormMLP(16, 32))], token_chunk=4)(
        short).sum().backward()
    x = torch.randn(2, 17, 16, requires_grad=True)
    for chunk in (17, 34, None):
        stack = ReversibleStack([ReversibleBlock(LayerNormAttention(16, 2), LayerNormMLP(16, 32))], token_chunk=chunk)
        stack(x).sum().backward()
    assert calls == []
    stack = ReversibleStack([ReversibleBlock(LayerNormAttention(16, 2, drop_path=0.3), LayerNormMLP(16, 32))],
                            token_chunk=4).train()
    stack(x).sum().backward()
    assert calls == []
    stack.eval()(x).sum().backward()
    assert len(calls) == 2 * 2 * 2  # forward and rebuild, 2 samples, 2 parts


def test_a_long_samples_peak_falls_with_head_groups():
    """One sample of 512 tokens, attention 64 wide with 8 heads, an MLP no wider than the stream. Whole, the
    peak is F's backward: its qkv projection and their gradients, SDPA's output and its gradient (about
    five of a stream's 128 KiB) on about nine stream-sized buffers of the step. In 8 head groups
    (token_chunk 64) a group's are an eighth of those, and the peak moves to a group's norm backward
    (the norm's input gradient and two buffers of its own): two streams lower (measured 1,812 -> 1,553
    KiB, torch 2.13); the bound, 1.5 streams, fails for the half run whole."""
    x = torch.randn(1, 512, 64)

    def peak(chunk):
        torch.manual_seed(0)
        blocks = [ReversibleBlock(LayerNormAttention(64, 8, causal=True), LayerNormMLP(64, 64)) for _ in range(2)]
        stack = ReversibleStack(blocks, exact=False, token_chunk=chunk)

        def step():
            stack(x.requires_grad_()).sum().backward()

        step()
        return peak_memory(step)

    whole, groups = peak(None), peak(64)
    assert groups <= whole - 1.5 * x.numel() * 4, (whole, groups)


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_head_groups_fire_each_parameters_hooks_once_with_the_whole_gradient(schedule):
    """Each head group adds to the parameters' gradients (a group's graph reaches the out projection's
    bias only in the last group); the accumulation hooks (DDP's reducer) fire once a backward, with every
    group's and every sample's gradient in."""
    torch.manual_seed(4)
    blocks = [ReversibleBlock(LayerNormAttention(16, 4), LayerNormMLP(16, 24)) for _ in range(2)]
    stack = ReversibleStack(blocks, exact=False, schedule=schedule, token_chunk=4).double()
    assert_hooks_fire_once_with_the_whole_gradient(stack, torch.randn(2, 17, 16, dtype=torch.float64,
                                                                      requires_grad=True))
