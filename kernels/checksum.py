"""Position-weighted checksum of two int32 residual streams in one pass (exact mode's recompute check).

    checksum_j = sum_i s_j[i] * w[i]  (mod 2**32, int32),   w[i] = mix(i) | 1,
    mix(i) = h * MIX with h = i * MULTIPLIER, h ^= h >> 16  (int32, wrapping; >> is arithmetic)

All arithmetic is int32 and wraps (two's complement), as torch's int32 multiply and sum do: a sum
mod 2**32 does not depend on the order of its terms, so the result does not depend on how the
programs split the work, and it is bitwise the torch reference's
(revtriton.ops.streams.stream_checksum_reference). Each weight is odd, so multiplying by it is a
bijection mod 2**32: changing any one element always changes the checksum. The weights are not
linear in the position (the xor-shift between two multiplies): with linear weights, moving a whole
row or block by an even distance changed the sum only by a multiple of the block's sum, so swapping
two rows of equal sums went unseen (revtriton.ops.streams.stream_checksum_reference says what is
caught now).
"""
import triton
import triton.language as tl


@triton.jit
def weighted_checksum_kernel(s1_ptr, s2_ptr, part_ptr, numel, multiplier, mix, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    h = offs.to(tl.int32) * multiplier  # numel < 2**31: the position fits an int32
    h = h ^ (h >> 16)
    weight = (h * mix) | 1
    a = tl.load(s1_ptr + offs, mask=mask, other=0)
    b = tl.load(s2_ptr + offs, mask=mask, other=0)
    tl.store(part_ptr + 2 * pid, tl.sum(a * weight, axis=0))
    tl.store(part_ptr + 2 * pid + 1, tl.sum(b * weight, axis=0))
