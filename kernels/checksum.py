"""Position-weighted checksum of two int32 residual streams in one pass (exact mode's recompute check).

    checksum_j = sum_i wrap32(s_j[i] * w[i])  (int64),   w[i] = wrap32(i * MULTIPLIER) | 1

The weights come from the element index in registers (nothing stored); products wrap to int32
(two's complement, as torch's int32 multiply does) and each program writes its int64 partial sums.
Integer sums are exact, so the result does not depend on how the programs split the work: it is
bitwise the torch reference's (revtriton.ops.streams.stream_checksum_reference).
"""
import triton
import triton.language as tl


@triton.jit
def wrap_int32(v):
    """An int64 value reduced to the int32 it wraps to (two's complement), kept in int64."""
    return ((v + 2147483648) & 4294967295) - 2147483648


@triton.jit
def weighted_checksum_kernel(s1_ptr, s2_ptr, part_ptr, numel, multiplier, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    weight = wrap_int32(offs * multiplier) | 1
    a = tl.load(s1_ptr + offs, mask=mask, other=0).to(tl.int64)
    b = tl.load(s2_ptr + offs, mask=mask, other=0).to(tl.int64)
    tl.store(part_ptr + 2 * pid, tl.sum(wrap_int32(a * weight), axis=0))
    tl.store(part_ptr + 2 * pid + 1, tl.sum(wrap_int32(b * weight), axis=0))
