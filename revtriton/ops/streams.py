"""Residual streams: the couple epilogue in torch, float or fixed point ("exact").

Exact streams: value = X * 2**-frac_bits with X int32.

A half's output h is rounded to the grid (round half to even) and added as an integer,
so ``(res + q) - q == res`` bitwise and the inverse is exact at any depth. Gradients pass
straight through the rounding: autograd sees ``out = res + sign * h`` in value space.

Autograd cannot differentiate integer tensors, so an exact couple returns two things: the
int32 stream and a *gradient port*, a float tensor of the stream's shape with no storage of
its own (a stride-0 view of one element). ``torch.autograd.backward(port, g)`` sends ``g``
(the gradient w.r.t. the output's value) to ``sign * h``.
"""
from __future__ import annotations

import torch

# Largest float32 below 2**31: the rounded half output saturates here instead of wrapping.
SATURATION = 2.0**31 - 128
# Streams must stay below 2**29 in magnitude. With two bits of headroom one range check of each
# new stream catches every overflow: if |res| < 2**29 and |q| <= SATURATION, then |res + q| >= 2**29
# whether the int32 add wrapped or not, and a saturated q (a huge or NaN half output) lands there too.
STREAM_LIMIT_BITS = 29


def out_of_range(stream: torch.Tensor) -> torch.Tensor:
    """Device flag: some |X| >= 2**STREAM_LIMIT_BITS (one pass, no host sync)."""
    low, high = torch.aminmax(stream)
    return (high >= 2**STREAM_LIMIT_BITS) | (low <= -(2**STREAM_LIMIT_BITS))


def check_frac_bits(frac_bits: int) -> int:
    if not isinstance(frac_bits, int) or isinstance(frac_bits, bool) or not 0 <= frac_bits <= 30:
        raise ValueError(f"frac_bits must be an int in [0, 30], got {frac_bits!r}")
    return frac_bits


def quantize_reference(h: torch.Tensor, frac_bits: int) -> torch.Tensor:
    """round(h * 2**frac_bits) as int32, half to even, saturating; NaN saturates (so it is caught)."""
    scaled = (h if h.dtype == torch.float64 else h.float()) * (2.0**frac_bits)
    return scaled.round_().nan_to_num_(nan=SATURATION).clamp_(-SATURATION, SATURATION).to(torch.int32)


def to_fixed(x: torch.Tensor, frac_bits: int) -> torch.Tensor:
    """Float values -> int32 fixed-point stream."""
    return quantize_reference(x, frac_bits)


def from_fixed(stream: torch.Tensor, frac_bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int32 fixed-point stream -> float values (float32 unless asked otherwise)."""
    if dtype == torch.float64:  # exact in float64 (float32 holds 24 of the stream's 31 bits)
        return stream.double() * (2.0**-frac_bits)
    value = stream * (2.0**-frac_bits)  # int32 * python float -> float32 in one pass (a power of 2)
    return value if dtype == torch.float32 else value.to(dtype)


def stream_grad_dtype(value_dtype: torch.dtype) -> torch.dtype:
    """The dtype an exact stream's gradient travels in: float32 at least (float64 for float64)."""
    return torch.promote_types(torch.float32, value_dtype)


def gradient_port(like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float tensor shaped like ``like`` that owns one element of storage (see module doc)."""
    return torch.zeros((), dtype=dtype, device=like.device).expand(like.shape)


def function_outputs(ctx, stream: torch.Tensor, frac_bits: int | None):
    """What a fused couple's autograd Function returns: the float stream, or the int32 stream and a port."""
    if frac_bits is None:
        return stream
    ctx.mark_non_differentiable(stream)
    return stream, gradient_port(stream)


def couple_result(outputs, frac_bits: int | None):
    """``(stream, port)`` from a fused couple Function's outputs; port is None when nothing requires grad."""
    stream, port = (outputs, outputs) if frac_bits is None else outputs
    return stream, (port if port.requires_grad else None)


def exact_add_reference(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int) -> torch.Tensor:
    """The exact epilogue in torch: ``res + sign * round(h * 2**frac_bits)`` in int32 (wraps)."""
    q = quantize_reference(h, frac_bits)
    return res + q if sign > 0 else res - q


EXACT_ADD_BLOCK = 4096
EXACT_ADD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def exact_add_triton(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int) -> torch.Tensor:
    """The same epilogue in one Triton pass (kernels/couple.py): reads res and h once, writes the
    new int32 stream; bitwise equal to :func:`exact_add_reference`. No autograd (see ExactAdd)."""
    from revtriton.kernels import couple as kernels

    from . import dispatch  # dispatch.launch: counted, and recorded by revtriton.aot

    if res.dtype != torch.int32 or h.dtype not in EXACT_ADD_DTYPES or h.shape != res.shape or h.device != res.device:
        raise TypeError(f"exact_add_triton takes an int32 stream and a float16/bfloat16/float32/float64 half output "
                        f"of its shape and device, got {res.dtype} {tuple(res.shape)} on {res.device} and "
                        f"{h.dtype} {tuple(h.shape)} on {h.device}")
    check_frac_bits(frac_bits)
    res, h = res.contiguous(), h.detach().contiguous()
    out = torch.empty(res.shape, dtype=torch.int32, device=res.device)
    numel = res.numel()
    if numel:
        dispatch.launch(kernels.exact_add_kernel, (-(-numel // EXACT_ADD_BLOCK),), res, h, out, numel,
                        2.0**frac_bits, 1 if sign > 0 else -1, BLOCK=EXACT_ADD_BLOCK, num_warps=8)
    return out


def exact_add_uses_triton(res: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether :func:`exact_add` runs the Triton kernel: for CUDA tensors (one device, a float
    dtype the kernel reads) when Triton is installed, not while torch.compile traces; the torch
    reference on CPU. Tests monkeypatch this to run the kernel on CPU tensors under the interpreter."""
    if not (res.is_cuda and h.device == res.device and h.dtype in EXACT_ADD_DTYPES and res.dtype == torch.int32):
        return False
    if torch.compiler.is_compiling():
        return False
    from . import dispatch

    return dispatch.triton_available()


def exact_add(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int) -> torch.Tensor:
    """``res + sign * round(h * 2**frac_bits)`` in int32: one Triton pass on CUDA (about seven torch
    passes otherwise), the torch reference elsewhere; both give the same bits. No host sync."""
    if exact_add_uses_triton(res, h):
        return exact_add_triton(res, h, sign, frac_bits)
    return exact_add_reference(res, h, sign, frac_bits)


class ExactAdd(torch.autograd.Function):
    """int32 ``res + sign * round(h)`` with a straight-through gradient to ``h`` via a port."""

    @staticmethod
    def forward(ctx, res, h, sign, frac_bits):
        ctx.sign = sign
        ctx.h_dtype = h.dtype
        out = exact_add(res, h, sign, frac_bits)
        ctx.mark_non_differentiable(out)
        return out, gradient_port(res, stream_grad_dtype(h.dtype))

    @staticmethod
    def backward(ctx, grad_out, grad_port):
        grad_h = grad_port if ctx.sign > 0 else -grad_port
        return None, grad_h.to(ctx.h_dtype), None, None


def exact_couple_from_output(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int):
    """Exact couple for a half whose float output ``h`` is already computed: ``(stream, port)``."""
    if res.dtype != torch.int32:
        raise TypeError(f"an exact residual stream must be int32, got {res.dtype}")
    if h.shape != res.shape:
        raise ValueError(f"half output shape {tuple(h.shape)} does not match the stream {tuple(res.shape)}")
    if h.requires_grad:
        return ExactAdd.apply(res, h, sign, frac_bits)
    return exact_add(res, h, sign, frac_bits), None


def couple_output(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int | None):
    """Finish a couple from the half's float output ``h``: ``(stream, port)`` (the reference epilogue)."""
    if h.shape != res.shape:
        raise ValueError(
            f"a coupling half must keep the shape of its input: got {tuple(h.shape)}, expected {tuple(res.shape)}"
        )
    if frac_bits is None:
        stream = res + h if sign > 0 else res - h
        return stream, (stream if stream.requires_grad else None)
    return exact_couple_from_output(res, h, sign, frac_bits)


# ---------------------------------------------------------------- recompute checksum

# An odd multiplier (2**32 / golden ratio): x -> x * C mod 2**32 is a bijection, so the weights spread.
CHECKSUM_MULTIPLIER = -1640531535  # 0x9E3779B1 as a signed int32
CHECKSUM_BLOCK = 4096


def _check_stream_pair(s1: torch.Tensor, s2: torch.Tensor):
    if s1.dtype != torch.int32 or s2.dtype != torch.int32 or s1.shape != s2.shape:
        raise TypeError(f"a checksum takes two int32 streams of one shape, got {s1.dtype} {tuple(s1.shape)} and "
                        f"{s2.dtype} {tuple(s2.shape)}")
    if s1.numel() >= 2**31:
        raise ValueError(f"a stream of {s1.numel()} elements: the checksum's int32 positions need < 2^31")


def stream_checksum_reference(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """int64 [2]: sum(s * w) for each stream, w = (position * CHECKSUM_MULTIPLIER) | 1 in int32.

    Position-sensitive (moving values between positions changes it, where a plain sum would not);
    the products wrap in int32 (two's complement), the sums accumulate in int64 (exact)."""
    _check_stream_pair(s1, s2)
    positions = torch.arange(s1.numel(), dtype=torch.int32, device=s1.device)
    weights = (positions * CHECKSUM_MULTIPLIER).bitwise_or_(1).view(s1.shape)
    return torch.stack([(s1 * weights).sum(), (s2 * weights).sum()])


def stream_checksum_triton(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The same checksum in one Triton pass over both streams (kernels/checksum.py), bitwise equal."""
    from revtriton.kernels import checksum as kernels

    from . import dispatch  # dispatch.launch, as every launcher (counted; recorded by revtriton.aot)

    _check_stream_pair(s1, s2)
    numel = s1.numel()
    if numel == 0:
        return torch.zeros(2, dtype=torch.int64, device=s1.device)
    s1, s2 = s1.contiguous(), s2.contiguous()
    programs = -(-numel // CHECKSUM_BLOCK)
    partials = torch.empty(programs, 2, dtype=torch.int64, device=s1.device)  # every program writes its row
    dispatch.launch(kernels.weighted_checksum_kernel, (programs,), s1, s2, partials, numel, CHECKSUM_MULTIPLIER,
                    BLOCK=CHECKSUM_BLOCK, num_warps=8)
    return partials.sum(0)


def stream_checksum(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The exact engine's recompute checksum: one Triton pass on CUDA (about eight torch passes
    otherwise), the torch reference elsewhere; both give the same bits. No host sync."""
    if s1.is_cuda:
        return stream_checksum_triton(s1, s2)
    return stream_checksum_reference(s1, s2)
