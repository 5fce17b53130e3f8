"""The exact couple epilogue in one elementwise pass: ``out = res + sign * round(h * 2**k)`` (int32).

The library path of a half (cuBLAS GEMMs + SDPA) ends with a float output ``h``; exact streams
round it to the fixed-point grid and add it as an integer. In torch that is about seven passes
over stream-sized tensors (scale, round, nan_to_num, clamp, cast, add); here it is one read of
``res`` and ``h`` and one write of the new stream.

Bitwise the torch reference (revtriton.ops.streams.exact_add_reference) for every input:
- h is computed in float32 (float16 / bfloat16 / float32 inputs) or float64 (float64 inputs),
  as ``quantize_reference`` does; multiplying by 2**k is exact (or overflows to inf, as in torch);
- rounding is half to even (torch.round) in exact float steps: floor, the fraction, and the parity
  of the floor, no libdevice (rint is not available under the interpreter, and these steps are
  exact in float32 and float64 alike, fused multiply-adds included);
- NaN saturates to +SATURATION, +-inf and huge values clamp to +-SATURATION (2**31 - 128, the
  largest float32 below 2**31), then the exact conversion to int32;
- the add wraps in int32 (two's complement), as torch's int32 add does; sign is +1 or -1 and
  ``sign * q`` never overflows because |q| <= SATURATION.

A scaled coupling (``SCALED``, scale 2**-shift; ops.streams.ResidualScale) shifts the residual in
the same pass: the forward writes ``(res >> shift) + q`` (arithmetic shift, the floor of the
scaled value, as torch's ``>>``), the inverse ``((res - q) << shift) | low``, ``low`` being the
bits the forward dropped, read from bit planes (ops.streams.pack_low_bits). Both directions are
one compiled kernel (a runtime branch on sign), as the unscaled forward and inverse are.
"""
import triton
import triton.language as tl

SATURATION = tl.constexpr(2147483520.0)  # 2**31 - 128 (ops.streams.SATURATION)


@triton.jit
def round_half_even(v):
    """Nearest integer, ties to even (torch.round), exact in float32 and float64; inf and NaN pass.

    Compiled for sm_90 / sm_80 (PTX read): floor is ``cvt.rmi.ftz`` and ``diff`` fuses into
    ``fma(h, scale, -r)``; both give the same integers (the product is exact, and a flushed
    negative subnormal floors to -0 with diff < 0.5, the same 0 as floor -1 with diff 1)."""
    r = tl.floor(v)
    diff = v - r  # exact: v and its floor are within one unit
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0  # 0 or 1 for finite r, exact (inf gives NaN: not up)
    up = (diff > 0.5) | ((diff == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def quantize(h, frac_scale):
    """round(h * 2^k) as int32: ties to even, saturated, NaN -> +SATURATION (ops.streams.quantize_reference).

    ``h`` is float32 or float64 (the caller casts float16 / bfloat16 to float32 first)."""
    v = round_half_even(h * frac_scale)
    v = tl.where(v != v, SATURATION, v)
    v = tl.minimum(tl.maximum(v, -SATURATION), SATURATION)
    return v.to(tl.int32)


@triton.jit
def restore_low_bits(shifted, low_bits_ptr, start, row_length, rows_left, cols_left, plane, shift,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``shifted | low`` for a [BLOCK_M, BLOCK_N] int32 tile whose element (m, n) sits at flat
    position ``start + m * row_length + n`` of a contiguous stream (valid where m < rows_left and
    n < cols_left), ``low`` being the ``shift`` low bits a scaled forward dropped, read from
    ``shift`` bit planes of ``plane`` bytes each (ops.streams.pack_low_bits: bit b of element e
    is bit ``e % 8`` of byte ``b * plane + e // 8``).

    Per plane, each group of 8 consecutive elements of a row is served by the two bytes it may
    straddle (one when the row starts on a byte), read as a 16-bit window shifted by the row's bit
    offset and unpacked in registers: 2 byte loads per 8 elements, not one per element. The tile
    is OR-ed in a [rows, groups, 8] view in the loads' layout and converted back once: per-element
    loads OR-ed into a GEMM accumulator's layout took 255 registers and a stack frame on sm_90
    (128 x 128 tile, 8 warps), this path 184 (the unscaled exact epilogue: 209). The row mask is
    rebuilt here from ``rows_left``: a GEMM's own row mask, taken into this layout, stayed live
    across its main loop (a predicate spilled to the stack, sm_80, triton 3.6)."""
    rows = tl.arange(0, BLOCK_M)
    groups = tl.arange(0, BLOCK_N // 8)
    positions = tl.arange(0, 8)
    row_first = (start % 8).to(tl.int32) + rows * row_length  # bits from byte start // 8 to each row
    row_bit = row_first & 7
    offsets = (row_first >> 3)[:, None] + groups[None, :]
    row_mask = rows < rows_left
    low_mask = row_mask[:, None] & (groups * 8 < cols_left)[None, :]
    high_mask = (row_mask & (row_bit > 0))[:, None] & (groups[None, :] * 8 + 8 - row_bit[:, None] < cols_left)
    plane_ptr = low_bits_ptr + start // 8
    out = tl.reshape(shifted, (BLOCK_M, BLOCK_N // 8, 8))
    for b in range(0, shift):
        low_byte = tl.load(plane_ptr + offsets, mask=low_mask, other=0).to(tl.int32)  # uint8: zero-extended
        high_byte = tl.load(plane_ptr + offsets + 1, mask=high_mask, other=0).to(tl.int32)
        window = (low_byte | (high_byte << 8)) >> row_bit[:, None]  # bit k: element 8 * group + k
        out |= ((window[:, :, None] >> positions[None, None, :]) & 1) << b
        plane_ptr += plane
    return tl.reshape(out, (BLOCK_M, BLOCK_N))


# sign (and the scale's shift and plane size) are runtime arguments, not specialised (the JIT
# would make a value of 1 a constant): the forward (+1) and the inverse (-1) run the same
# compiled code, at every shift.
@triton.jit(do_not_specialize=["sign", "shift", "plane"])
def exact_add_kernel(res_ptr, h_ptr, out_ptr, numel, frac_scale, sign, shift, low_bits_ptr, plane,
                     BLOCK: tl.constexpr, SCALED: tl.constexpr):
    """out[i] = res[i] + sign * quantize(h[i]) for contiguous res (int32), h (float) and out (int32);
    ``SCALED``: the scaled coupling's shift (see the module doc; ``low_bits_ptr`` is read only by
    the inverse)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK  # 64-bit base: streams may pass 2^31 elements
    local = tl.arange(0, BLOCK)
    mask = local < numel - start
    res = tl.load(res_ptr + start + local, mask=mask, other=0)
    h = tl.load(h_ptr + start + local, mask=mask, other=0.0)
    if h_ptr.dtype.element_ty != tl.float64:  # float64 stays float64 (times a float32 power of two: exact)
        h = h.to(tl.float32)
    q = quantize(h, frac_scale)
    if not SCALED:
        out = res + sign * q
    elif sign > 0:  # a runtime branch: the scaled forward and inverse are one compiled kernel
        out = (res >> shift) + q
    else:  # the block as one row of the stream
        shifted = tl.reshape((res - q) << shift, (1, BLOCK))
        out = tl.reshape(restore_low_bits(shifted, low_bits_ptr, start, BLOCK, 1, numel - start, plane, shift,
                                          1, BLOCK), (BLOCK,))
    tl.store(out_ptr + start + local, out, mask=mask)
