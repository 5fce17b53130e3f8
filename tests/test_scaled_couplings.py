"""Scaled couplings (issue 14): ``y1 = a * x1 + F(x2)``, ``y2 = b * x2 + G(y1)``, optionally swapped.

Float streams against plain autograd written out here (float64); exact streams against the integer
model written out here (the forward) and the stored-activation twin (gradients, bitwise), at depth
48; the bits kept per block against their packed size; the inverse; bad inputs.
"""
import copy

import pytest
import torch
from torch import nn

from revtriton import ReversibleBlock, ReversibleStack, to_stored_activations
from revtriton.ops.streams import (ResidualScale, from_fixed, pack_low_bits, quantize_reference, to_fixed,
                                   unpack_low_bits)
from twins import mlp

pytestmark = pytest.mark.usefixtures("seeded")

DIM, TOKENS, BATCH = 8, 5, 2
FRAC_BITS = 16


def scaled_blocks(depth, shifts=(3, 0), swap=True, dim=DIM):
    """Blocks whose scales cycle through 2**-shift pairs: (3, 0), (0, 2), ... per block."""
    blocks = []
    for i in range(depth):
        s1, s2 = shifts if i % 2 == 0 else shifts[::-1]
        blocks.append(ReversibleBlock(mlp(dim), mlp(dim), scale1=2.0**-s1, scale2=2.0**-s2, swap=swap))
    return blocks


def plain_autograd(blocks, x1, x2):
    """The scaled couplings with plain autograd, written out (the float oracle)."""
    for block in blocks:
        c = block.coupling
        y1 = c.scale1 * x1 + block.f(x2)
        y2 = c.scale2 * x2 + block.g(y1)
        x1, x2 = (y2, y1) if c.swap else (y1, y2)
    return x1, x2


def integer_model(blocks, s1, s2, k=FRAC_BITS):
    """The exact streams' forward written out: shift right, add the rounded half output."""
    for block in blocks:
        c = block.coupling
        shift1, shift2 = (round(-torch.log2(torch.tensor(a)).item()) for a in (c.scale1, c.scale2))
        y1 = (s1 >> shift1) + quantize_reference(block.f(from_fixed(s2, k)), k)
        y2 = (s2 >> shift2) + quantize_reference(block.g(from_fixed(y1, k)), k)
        s1, s2 = (y2, y1) if c.swap else (y1, y2)
    return s1, s2


def gradients(model, x, weights):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    (model(x) * weights).sum().backward()
    return [x.grad] + [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]


# -- bit packing --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 3, 7, 16])
def test_packed_low_bits_round_trip_in_bits_over_8_bytes_per_element(bits):
    stream = torch.randint(-(2**30), 2**30, (3, 7, 5), dtype=torch.int32)  # 105 elements: not a multiple of 8
    packed = pack_low_bits(stream, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (bits, 14)  # ceil(105 / 8) bytes per bit plane
    assert torch.equal(unpack_low_bits(packed, bits, stream.shape), stream & ((1 << bits) - 1))


def test_exact_residual_scale_restores_the_stream_only_with_the_dropped_bits():
    stream = torch.randint(-(2**28), 2**28, (4, 9), dtype=torch.int32)
    scale = ResidualScale(2.0**-5)
    shifted = scale.apply(stream, FRAC_BITS)
    assert torch.equal(shifted, torch.div(stream, 32, rounding_mode="floor"))  # floor of the scaled value
    restored = ResidualScale(2.0**-5, scale.dropped_bits(stream)).undo(shifted, FRAC_BITS)
    assert torch.equal(restored, stream)
    with pytest.raises(ValueError, match="low_bits"):
        scale.undo(shifted, FRAC_BITS)


# -- float streams ------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 4, 5])
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("schedule,anchor_every", [("sequential", 0), ("pareprop", 0), ("sequential", 2)])
def test_float_gradients_match_plain_autograd_in_float64(depth, swap, schedule, anchor_every):
    blocks = scaled_blocks(depth, swap=swap)
    stack = ReversibleStack(blocks, exact=False, schedule=schedule, anchor_every=anchor_every,
                            readout="second").double()
    x = torch.randn(BATCH, TOKENS, DIM, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(BATCH, TOKENS, DIM, dtype=torch.float64)
    got = gradients(stack, x, weights)

    def oracle(x):
        return plain_autograd(list(stack), x, x)[1]

    want = gradients(_Oracle(stack, oracle), x, weights)
    assert torch.allclose(stack(x), oracle(x), rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-10 * max(b.abs().max().item(), 1.0)


class _Oracle(nn.Module):
    """``fn`` as a module over the stack's parameters (so gradients() reads the same ones)."""

    def __init__(self, stack, fn):
        super().__init__()
        self.stack, self.fn = stack, fn

    def forward(self, x):
        return self.fn(x)


def test_float_inverse_divides_by_the_scales():
    # Three blocks amplify rounding by 2**15 (float64: ~1e-11 here); six would reach 2**30, ~1e-8, too
    # close to the bound for random inputs.
    with pytest.warns(UserWarning, match="amplifies rounding by up to 2\\*\\*15"):
        stack = ReversibleStack(scaled_blocks(3, shifts=(4, 1)), exact=False).double()
    x1, x2 = (torch.randn(BATCH, TOKENS, DIM, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        r1, r2 = stack.inverse(*stack.forward_streams(x1, x2))
    assert (r1 - x1).abs().max() < 1e-8 and (r2 - x2).abs().max() < 1e-8


# -- exact streams ------------------------------------------------------------------------------


def test_exact_forward_is_the_shift_and_add_integer_model():
    stack = ReversibleStack(scaled_blocks(5, shifts=(7, 1)), exact=True)
    s1, s2 = (to_fixed(torch.randn(BATCH, TOKENS, DIM), FRAC_BITS) for _ in range(2))
    with torch.no_grad():
        got = stack.forward_streams(s1, s2)
        want = integer_model(list(stack), s1, s2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("depth,schedule", [(48, "sequential"), (48, "pareprop"), (7, "sequential")])
def test_exact_gradients_are_bitwise_the_stored_activation_twins_at_depth(depth, schedule):
    # The rebuild must restore every block's input bit for bit, or the engine's checksum raises.
    stack = ReversibleStack(scaled_blocks(depth, shifts=(5, 2)), exact=True, schedule=schedule, readout="second")
    twin = to_stored_activations(copy.deepcopy(stack))
    x = torch.randn(BATCH, TOKENS, DIM)
    weights = torch.randn(BATCH, TOKENS, DIM)
    assert torch.equal(stack(x), twin(x))
    for a, b in zip(gradients(stack, x, weights), gradients(twin, x, weights)):
        assert torch.equal(a, b)


def saved_bytes(stack, x):
    """Bytes of the tensors the stack's forward saves for its backward (its whole memory cost)."""
    sizes = []

    def pack(t):
        sizes.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stack(x.requires_grad_())
    return sum(sizes)


@pytest.mark.parametrize("shift", [1, 3, 6])
def test_exact_bytes_kept_per_block_are_the_packed_dropped_bits(shift):
    depth, dim, tokens = 6, 32, 64
    x = torch.randn(2, tokens, dim)
    plain = ReversibleStack([ReversibleBlock(mlp(dim), mlp(dim)) for _ in range(depth)])
    scaled = ReversibleStack([ReversibleBlock(mlp(dim), mlp(dim), scale1=2.0**-shift, swap=True)
                              for _ in range(depth)])
    extra_per_block = (saved_bytes(scaled, x) - saved_bytes(plain, x)) / depth
    packed = shift * x.numel() / 8  # one scaled stream, shift bits per element
    print(f"shift {shift}: {extra_per_block:.0f} bytes kept per block, packed size {packed:.0f}")
    assert packed <= extra_per_block <= 2 * packed


def test_exact_inverse_from_outputs_alone_refuses_a_scaled_coupling():
    stack = ReversibleStack(scaled_blocks(2), exact=True)
    s1, s2 = (to_fixed(torch.randn(2, DIM), FRAC_BITS) for _ in range(2))
    with pytest.raises(ValueError, match="scaled coupling on exact streams"):
        stack.inverse(*stack.forward_streams(s1, s2))


class ScaleUnawareHalf(nn.Module):
    """A duck-typed half whose couple knows nothing of scales: the engine scales around it."""

    def __init__(self, dim):
        super().__init__()
        self.net = mlp(dim)

    def forward(self, x):
        return self.net(x)

    def couple(self, res, x, sign, frac_bits=None):
        from revtriton.ops.streams import couple_output

        return couple_output(res, self.net(x), sign, frac_bits)


@pytest.mark.parametrize("exact", [True, False])
def test_halves_without_a_scale_parameter_are_scaled_around_their_couple(exact):
    blocks = [ReversibleBlock(ScaleUnawareHalf(DIM), ScaleUnawareHalf(DIM), scale1=0.25, scale2=0.5, swap=True)
              for _ in range(3)]
    stack = ReversibleStack(blocks, exact=exact, readout="first")
    twin = to_stored_activations(copy.deepcopy(stack))
    if not exact:
        stack, twin = stack.double(), twin.double()
    dtype = torch.float32 if exact else torch.float64
    x, weights = torch.randn(BATCH, TOKENS, DIM, dtype=dtype), torch.randn(BATCH, TOKENS, DIM, dtype=dtype)
    for a, b in zip(gradients(stack, x, weights), gradients(twin, x, weights)):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-10, atol=1e-12)


# -- readout and bad inputs ---------------------------------------------------------------------


@pytest.mark.parametrize("readout", ["first", "second", "mean"])
def test_readout_picks_the_stream(readout):
    stack = ReversibleStack(scaled_blocks(3), exact=False, readout=readout).double()
    x = torch.randn(BATCH, TOKENS, DIM, dtype=torch.float64)
    y1, y2 = stack.forward_streams(x, x)
    want = {"first": y1, "second": y2, "mean": (y1 + y2) * 0.5}[readout]
    assert torch.equal(stack(x), want)


@pytest.mark.parametrize("scale", [0.1, 3.0, 2.0**-17])
def test_exact_stacks_refuse_scales_that_are_not_a_power_of_two_they_can_invert(scale):
    with pytest.raises(ValueError, match=r"layer 0 .*2\*\*-s"):
        ReversibleStack([ReversibleBlock(mlp(DIM), mlp(DIM), scale1=scale)], exact=True)
    ReversibleStack([ReversibleBlock(mlp(DIM), mlp(DIM), scale1=scale)], exact=False)  # float streams take it


@pytest.mark.parametrize("kwargs,match", [
    (dict(scale1=0.0), "finite float > 0"), (dict(scale2=-0.5), "finite float > 0"),
    (dict(scale1=float("nan")), "finite float > 0"), (dict(swap="yes"), "swap must be a bool"),
])
def test_bad_couplings_raise(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ReversibleBlock(mlp(DIM), mlp(DIM), **kwargs)


def test_bad_readout_raises():
    with pytest.raises(ValueError, match="readout must be one of"):
        ReversibleStack([ReversibleBlock(mlp(DIM), mlp(DIM))], readout="last")


def test_float_stacks_warn_when_scales_amplify_past_2_to_the_12_between_anchors():
    def blocks():
        return [ReversibleBlock(mlp(DIM), mlp(DIM), scale1=2.0**-5) for _ in range(3)]  # 15 bits in all

    with pytest.warns(UserWarning, match=r"amplifies rounding by up to 2\*\*15"):
        ReversibleStack(blocks(), exact=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ReversibleStack(blocks(), exact=False, anchor_every=2)  # 10 bits between anchors
        ReversibleStack(blocks(), exact=True)  # bitwise: nothing amplifies
