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


# sign is a runtime argument, not specialised (the JIT would make a value of 1 a constant): the
# forward (+1) and the inverse (-1) run the same compiled code.
@triton.jit(do_not_specialize=["sign"])
def exact_add_kernel(res_ptr, h_ptr, out_ptr, numel, frac_scale, sign, BLOCK: tl.constexpr):
    """out[i] = res[i] + sign * quantize(h[i]) for contiguous res (int32), h (float) and out (int32)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK  # 64-bit base: streams may pass 2^31 elements
    local = tl.arange(0, BLOCK)
    mask = local < numel - start
    res = tl.load(res_ptr + start + local, mask=mask, other=0)
    h = tl.load(h_ptr + start + local, mask=mask, other=0.0)
    if h_ptr.dtype.element_ty != tl.float64:  # float64 stays float64 (times a float32 power of two: exact)
        h = h.to(tl.float32)
    q = quantize(h, frac_scale)
    tl.store(out_ptr + start + local, res + sign * q, mask=mask)
