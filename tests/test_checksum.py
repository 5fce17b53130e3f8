"""The exact engine's recompute checksum: the one-pass Triton kernel (kernels/checksum.py, used on
CUDA) against the torch reference, bitwise, under the interpreter; and what it can see."""
import pytest
import torch

from revtriton.ops import dispatch
from revtriton.ops.streams import CHECKSUM_BLOCK, _checksum_weights, stream_checksum_reference, stream_checksum_triton

pytestmark = pytest.mark.skipif(not dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (conftest)")

INT32 = torch.iinfo(torch.int32)


def random_streams(*shape):
    """Full-range int32 values (products wrap) with the extremes planted."""
    s1 = torch.randint(INT32.min, INT32.max, shape, dtype=torch.int32)
    s2 = torch.randint(-2**29, 2**29, shape, dtype=torch.int32)
    extremes = torch.tensor([INT32.min, INT32.max, -1], dtype=torch.int32)
    s1.view(-1)[:3] = extremes[:s1.numel()]
    return s1, s2


@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 5, 33), (CHECKSUM_BLOCK,), (3 * CHECKSUM_BLOCK + 17,)])
def test_triton_checksum_is_bitwise_the_reference(seeded, shape):
    s1, s2 = random_streams(*shape)
    got, want = stream_checksum_triton(s1, s2), stream_checksum_reference(s1, s2)
    assert got.dtype == torch.int32 and torch.equal(got, want)


@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 5, 33), (3 * CHECKSUM_BLOCK + 17,)])
def test_cpu_checksum_is_the_wrapped_weighted_sum(seeded, shape):
    """The CPU reference takes int32 dot products: bitwise the elementwise definition, products and
    sum wrapping in int32, at the full range (and for a stream that is a non-contiguous view)."""
    s1, s2 = random_streams(*shape)
    s2 = torch.cat((s2, s2)).view(2, *shape)[1]  # (a view at an offset)
    weights = _checksum_weights(s1.numel(), s1.device)
    want = torch.stack([(s.reshape(-1) * weights).sum(dtype=torch.int32) for s in (s1, s2)])
    assert torch.equal(stream_checksum_reference(s1, s2), want)
    transposed = s1.reshape(-1, 1).expand(-1, 2).t()  # non-contiguous: reshape copies
    weights = _checksum_weights(transposed.numel(), s1.device)
    assert torch.equal(stream_checksum_reference(transposed, transposed.clone())[0],
                       (transposed.reshape(-1) * weights).sum(dtype=torch.int32))


def test_triton_checksum_sees_moved_values_and_empty_streams(seeded):
    s1, s2 = random_streams(4, 9, 8)
    base = stream_checksum_triton(s1, s2)
    rolled = stream_checksum_triton(s1.roll(1, dims=1), s2)  # token rows moved, same values
    assert rolled[0] != base[0] and rolled[1] == base[1]
    empty = torch.zeros(0, 3, dtype=torch.int32)
    assert torch.equal(stream_checksum_triton(empty, empty), torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("checksum", [stream_checksum_reference, stream_checksum_triton], ids=["torch", "triton"])
def test_checksum_sees_any_one_changed_element(seeded, checksum):
    """Every weight is odd, so a change of one element changes the sum mod 2**32, even a flip of its
    top bit alone (2**31 times an even weight would vanish), at even and odd positions."""
    s1, s2 = random_streams(2, 3, 5)
    base = checksum(s1, s2)
    for position in torch.randperm(s1.numel())[:6].tolist() + [0, 1]:
        for stream in (0, 1):
            changed = [s1.clone(), s2.clone()]
            changed[stream].view(-1)[position] ^= INT32.min  # the top bit flipped
            moved = checksum(*changed)
            assert moved[stream] != base[stream] and moved[1 - stream] == base[1 - stream], (position, stream)


@pytest.mark.parametrize("checksum", [stream_checksum_reference, stream_checksum_triton], ids=["torch", "triton"])
def test_checksum_sees_swapped_rows_of_equal_sums(seeded, checksum):
    """Issue 39: with weights linear in the position, swapping two rows whose sums are equal, at an
    even distance, left the checksum as it was (gradients off by 1.07, no error). Rows here: one row
    and a permutation of it (the same sum, other values), swapped with each other at distances 2
    and 4 rows and across a CHECKSUM_BLOCK boundary."""
    width = 64
    for trial, (rows, a, b) in enumerate([(8, 1, 3), (8, 2, 6), (2 * CHECKSUM_BLOCK // width, 60, 66)]):
        s1 = torch.randint(-2**20, 2**20, (rows, width), dtype=torch.int32)
        s1[b] = s1[a][torch.randperm(width)]
        assert s1[a].sum() == s1[b].sum() and not torch.equal(s1[a], s1[b])
        swapped = s1.clone()
        swapped[[a, b]] = s1[[b, a]]
        s2 = torch.zeros_like(s1)
        assert checksum(swapped, s2)[0] != checksum(s1, s2)[0], trial


def test_checksum_refuses_what_it_cannot_sum():
    with pytest.raises(TypeError, match="int32"):
        stream_checksum_reference(torch.zeros(3), torch.zeros(3))
    with pytest.raises(TypeError, match="one shape"):
        stream_checksum_triton(torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
