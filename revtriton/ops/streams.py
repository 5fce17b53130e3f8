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

import math
from dataclasses import dataclass

import torch

from .arguments import checked_int
from .launches import cdiv, unused_pointer

# Largest float32 below 2**31: the rounded half output saturates here instead of wrapping.
SATURATION = 2.0**31 - 128
# Streams must stay below 2**29 in magnitude. With two bits of headroom one range check of each
# new stream catches every overflow: if |res| < 2**29 and |q| <= SATURATION, then |res + q| >= 2**29
# whether the int32 add wrapped or not, and a saturated q (a huge or NaN half output) lands there too.
STREAM_LIMIT_BITS = 29


def extremes_out_of_range(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Device flags from streams' minima and maxima (tensors of one shape): some |X| >= 2**STREAM_LIMIT_BITS."""
    return (high >= 2**STREAM_LIMIT_BITS) | (low <= -(2**STREAM_LIMIT_BITS))


def out_of_range(stream: torch.Tensor) -> torch.Tensor:
    """Device flag: some |X| >= 2**STREAM_LIMIT_BITS (one pass, no host sync)."""
    low, high = torch.aminmax(stream)
    return extremes_out_of_range(low, high)


_powers_of_two: dict = {}


def power_of_two(exponent: int, dtype: torch.dtype = torch.float32):
    """``2**exponent`` as a 0-dim CPU tensor of ``dtype`` (cached), or a Python float while torch.compile
    traces. Multiplying by it gives the bits of multiplying by the Python float (a power of two is
    exact in every float dtype that holds it), without the conversion torch makes of a Python scalar at
    every call (about a microsecond of host time an op on a CPU; on CUDA a CPU 0-dim tensor is a scalar
    argument, as a Python number is)."""
    if torch.compiler.is_compiling():
        return 2.0**exponent
    key = (exponent, dtype)
    value = _powers_of_two.get(key)
    if value is None:
        value = _powers_of_two[key] = torch.tensor(2.0**exponent, dtype=dtype)
    return value


def check_frac_bits(frac_bits: int) -> int:
    return checked_int("frac_bits", frac_bits, 0, 30)


def quantize_reference(h: torch.Tensor, frac_bits: int) -> torch.Tensor:
    """round(h * 2**frac_bits) as int32, half to even, saturating; NaN saturates (so it is caught).

    One float buffer for the whole epilogue: scaled (a copy: ``h`` is left alone), rounded, saturated
    in place, then converted to int32 in place (float32 and int32 are both 4 bytes: each element is
    read and written at its own position, as in any elementwise in-place op)."""
    if h.dtype == torch.float64:
        scaled = h * (2.0**frac_bits)
    elif h.dtype == torch.float32:
        scaled = h.mul(power_of_two(frac_bits)).contiguous()
    else:  # a fresh float32 copy, scaled in place (the same float32 product as h.float() * 2**k)
        scaled = h.to(torch.float32, memory_format=torch.contiguous_format, copy=True).mul_(power_of_two(frac_bits))
    scaled.round_().nan_to_num_(nan=SATURATION).clamp_(-SATURATION, SATURATION)
    if scaled.dtype != torch.float32:
        return scaled.to(torch.int32)
    fixed = scaled.view(torch.int32)
    return fixed.copy_(scaled)


def to_fixed(x: torch.Tensor, frac_bits: int) -> torch.Tensor:
    """Float values -> int32 fixed-point stream."""
    return quantize_reference(x, frac_bits)


def from_fixed(stream: torch.Tensor, frac_bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int32 fixed-point stream -> float values (float32 unless asked otherwise)."""
    if dtype == torch.float64:  # exact in float64 (float32 holds 24 of the stream's 31 bits)
        return stream.double() * (2.0**-frac_bits)
    value = stream * power_of_two(-frac_bits)  # int32 * float32 scalar -> float32 in one pass
    return value if dtype == torch.float32 else value.to(dtype)


def stream_grad_dtype(value_dtype: torch.dtype) -> torch.dtype:
    """The dtype an exact stream's gradient travels in: float32 at least (float64 for float64)."""
    return torch.promote_types(torch.float32, value_dtype)


_zero_elements: dict = {}


def zero_element(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim zero of ``dtype`` on ``device``, cached: the one element of storage that the ports and
    exact streams' input leaves expand to their shape (nothing writes into it: a port's or a leaf's
    gradient is a tensor of its own). Fresh while torch.compile traces."""
    if torch.compiler.is_compiling():
        return torch.zeros((), dtype=dtype, device=device)
    key = (dtype, device)
    zero = _zero_elements.get(key)
    if zero is None:
        zero = _zero_elements[key] = torch.zeros((), dtype=dtype, device=device)
    return zero


def gradient_port(like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float tensor shaped like ``like`` that owns one element of storage (see module doc)."""
    return zero_element(dtype, like.device).expand(like.shape)


def function_outputs(ctx, stream: torch.Tensor, frac_bits: int | None, scaled: bool = False):
    """What a fused couple's autograd Function returns: the float stream, or the int32 stream and a port.

    A scaled coupling (``scaled``) returns a port beside a float stream too: the stream is
    ``scale * res + H(x)`` or ``(res - H(x)) / scale``, while the port's gradient goes to
    ``sign * H(x)`` unscaled (the engine scales the stream's own gradient), as couple_output's does."""
    if frac_bits is None and not scaled:
        return stream
    ctx.mark_non_differentiable(stream)
    return stream, gradient_port(stream, torch.float32 if frac_bits is not None else stream.dtype)


def couple_result(outputs, frac_bits: int | None, scaled: bool = False):
    """``(stream, port)`` from a fused couple Function's outputs; port is None when nothing requires grad."""
    stream, port = (outputs, outputs) if frac_bits is None and not scaled else outputs
    return stream, (port if port.requires_grad else None)


def port_gradient(grads, frac_bits: int | None, res_scale: float | None):
    """The gradient w.r.t. ``sign * H(x)`` in a fused couple Function's backward (``grads``, one per
    output of :func:`function_outputs`): the stream's, or the port's where there is one."""
    return grads[0] if frac_bits is None and res_scale is None else grads[1]


def residual_gradient(grads, frac_bits: int | None, sign: int, res_scale: float | None):
    """The gradient w.r.t. ``res`` of a fused couple Function, as couple_output's autograd gives it:
    float streams only; a scaled forward's port is ``scale * res + H(x)`` (times the scale), an
    inverse's ``res - H(x)`` (the division comes after, detached)."""
    if frac_bits is not None:
        return None
    if res_scale is None:
        return grads[0]
    grad = grads[1]
    return grad * res_scale if sign > 0 and grad is not None else grad


def exact_add_reference(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int,
                        scale: ResidualScale | None = None) -> torch.Tensor:
    """The exact epilogue in torch: ``res + sign * round(h * 2**frac_bits)`` in int32 (wraps).

    With a ``scale`` (2**-s): ``(res >> s) + q`` forward, ``((res - q) << s) | low`` inverse, as
    couple_output computes it (ResidualScale.apply / undo)."""
    q = quantize_reference(h, frac_bits)
    if scale is None:  # into q, a fresh tensor of the stream's shape: no other buffer
        return torch.add(res, q, out=q) if sign > 0 else torch.sub(res, q, out=q)
    if sign > 0:
        return scale.apply(res, frac_bits) + q
    return scale.undo(res - q, frac_bits)


EXACT_ADD_BLOCK = 4096
EXACT_ADD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def exact_add_triton(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int,
                     scale: ResidualScale | None = None) -> torch.Tensor:
    """The same epilogue in one Triton pass (kernels/couple.py): reads res and h once (and the
    dropped bits in a scaled inverse), writes the new int32 stream; bitwise equal to
    :func:`exact_add_reference`. No autograd (see ExactAdd)."""
    from revtriton.kernels import couple as kernels

    from . import dispatch  # dispatch.launch: counted, and recorded by revtriton.aot

    if res.dtype != torch.int32 or h.dtype not in EXACT_ADD_DTYPES or h.shape != res.shape or h.device != res.device:
        raise TypeError(f"exact_add_triton takes an int32 stream and a float16/bfloat16/float32/float64 half output "
                        f"of its shape and device, got {res.dtype} {tuple(res.shape)} on {res.device} and "
                        f"{h.dtype} {tuple(h.shape)} on {h.device}")
    check_frac_bits(frac_bits)
    scale = check_residual_scale(scale, sign, frac_bits, res)
    res, h = res.contiguous(), h.detach().contiguous()
    out = torch.empty(res.shape, dtype=torch.int32, device=res.device)
    numel = res.numel()
    if numel:
        _, shift, low_bits, plane = scale_launch_args(scale, sign, frac_bits, out)
        dispatch.launch(kernels.exact_add_kernel, (cdiv(numel, EXACT_ADD_BLOCK),), res, h, out, numel,
                        2.0**frac_bits, 1 if sign > 0 else -1, shift, low_bits, plane, BLOCK=EXACT_ADD_BLOCK,
                        SCALED=scale is not None, num_warps=8)
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


def exact_add(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int,
              scale: ResidualScale | None = None) -> torch.Tensor:
    """``res + sign * round(h * 2**frac_bits)`` in int32 (a scaled coupling: see exact_add_reference):
    one Triton pass on CUDA (six torch passes otherwise, more with a scale), the torch
    reference elsewhere; both give the same bits. No host sync."""
    if exact_add_uses_triton(res, h):
        return exact_add_triton(res, h, sign, frac_bits, scale)
    return exact_add_reference(res, h, sign, frac_bits, scale)


class ExactAdd(torch.autograd.Function):
    """int32 ``res + sign * round(h)`` with a straight-through gradient to ``h`` via a port (a scale
    changes the stream, not the port: its gradient goes to ``sign * h`` unscaled)."""

    @staticmethod
    def forward(ctx, res, h, sign, frac_bits, scale=None):
        ctx.sign = sign
        ctx.h_dtype = h.dtype
        out = exact_add(res, h, sign, frac_bits, scale)
        ctx.mark_non_differentiable(out)
        ctx.set_materialize_grads(False)  # the int32 stream gets no gradient: no zeros of its size in backward
        return out, gradient_port(res, stream_grad_dtype(h.dtype))

    @staticmethod
    def backward(ctx, grad_out, grad_port):
        if grad_port is None:
            return None, None, None, None, None
        grad_h = grad_port if ctx.sign > 0 else -grad_port
        return None, grad_h.to(ctx.h_dtype), None, None, None


def exact_couple_from_output(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int,
                             scale: ResidualScale | None = None):
    """Exact couple for a half whose float output ``h`` is already computed: ``(stream, port)``."""
    if res.dtype != torch.int32:
        raise TypeError(f"an exact residual stream must be int32, got {res.dtype}")
    if h.shape != res.shape:
        raise ValueError(f"half output shape {tuple(h.shape)} does not match the stream {tuple(res.shape)}")
    if not h.requires_grad:
        return exact_add(res, h, sign, frac_bits, scale), None
    if sign > 0:
        return ExactAdd.apply(res, h, sign, frac_bits, scale)
    return exact_add(res, h.detach(), sign, frac_bits, scale), inverse_port(h)


def inverse_port(h: torch.Tensor) -> torch.Tensor:
    """ExactAdd's port for an inverse couple (``sign`` -1: the engine's rebuild, run for every half
    of every backward), made without a Python autograd Function: ``-h``
    in the stream's gradient dtype by torch's own negation (its backward saves nothing and negates
    the port's gradient, then the cast rounds it to ``h``'s dtype: the bits of ExactAdd.backward),
    then the result's storage swapped for one zero element (``.data``: autograd keeps the node and
    the shape, not the values), so the port holds no stream-sized buffer. On a CPU about 50 us less
    a rebuilt half than ExactAdd's forward and backward in Python."""
    grad_dtype = stream_grad_dtype(h.dtype)
    port = torch.neg(h if h.dtype == grad_dtype else h.to(grad_dtype))
    port.data = zero_element(grad_dtype, h.device).expand(h.shape)
    return port


def couple_output(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int | None,
                  scale: ResidualScale | None = None):
    """Finish a couple from the half's float output ``h``: ``(stream, port)`` (the reference epilogue).

    With a ``scale`` (a scaled coupling, :class:`ResidualScale`) the forward computes
    ``scale * res + h`` and the inverse ``(res - h) / scale``; ``port`` still takes the gradient
    w.r.t. ``sign * h`` (the engine applies the scale to the stream's own gradient)."""
    if h.shape != res.shape:
        raise ValueError(
            f"a coupling half must keep the shape of its input: got {tuple(h.shape)}, expected {tuple(res.shape)}"
        )
    if scale is not None and sign > 0:
        res = scale.apply(res, frac_bits)
    if frac_bits is None:
        stream = res + h if sign > 0 else res - h
        port = stream if stream.requires_grad else None
    else:
        stream, port = exact_couple_from_output(res, h, sign, frac_bits)
    if scale is not None and sign < 0:
        stream = scale.undo(stream.detach(), frac_bits)
    return stream, port


def library_couple_output(res: torch.Tensor, h: torch.Tensor, sign: int, frac_bits: int | None,
                          scale: ResidualScale | None = None):
    """:func:`couple_output` as the library path of a half runs it (cuBLAS + SDPA, then this): an
    exact scaled couple in one exact_add pass (shift, rounded add and restored low bits: one
    Triton kernel on CUDA) instead of a shift, the add and the bit-plane unpacking in torch.
    Same stream and port as couple_output (the tests hold them bitwise equal); the scale checked
    as the fused candidates check it."""
    scale = check_residual_scale(scale, sign, frac_bits, res)
    if scale is None or frac_bits is None:
        return couple_output(res, h, sign, frac_bits, scale)
    if h.shape != res.shape:
        raise ValueError(
            f"a coupling half must keep the shape of its input: got {tuple(h.shape)}, expected {tuple(res.shape)}"
        )
    return exact_couple_from_output(res, h, sign, frac_bits, scale)


# ---------------------------------------------------------------- scaled couplings

# Exact streams scale by 2**-shift with shift <= MAX_SCALE_SHIFT: the bits kept per element per
# block are ``shift``, and past 16 a float coupling's 1 / scale amplification is beyond use anyway.
MAX_SCALE_SHIFT = 16


def scale_shift(scale: float) -> int:
    """``s`` with ``scale == 2**-s`` (0 <= s <= MAX_SCALE_SHIFT), as exact streams need; else ValueError."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale <= 1:
        mantissa, exponent = math.frexp(float(scale))
        if mantissa == 0.5 and -MAX_SCALE_SHIFT <= exponent - 1 <= 0:
            return 1 - exponent
    raise ValueError(f"exact streams scale a residual by 2**-s with s an int in [0, {MAX_SCALE_SHIFT}] (the bits "
                     f"the shift drops are kept to invert it), got {scale!r}; float streams take any scale > 0")


def check_scale(scale, exact: bool) -> float:
    """A coupling scale: a positive finite float (exact streams: a power of two 2**-s, see scale_shift)."""
    if exact:
        scale_shift(scale)
    elif (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
          or scale <= 0):
        raise ValueError(f"a coupling scale must be a finite float > 0, got {scale!r}")
    return float(scale)


def pack_low_bits(stream: torch.Tensor, bits: int) -> torch.Tensor:
    """The low ``bits`` bits of every element of an int32 stream, packed as bit planes: uint8
    ``[bits, ceil(numel / 8)]``, bit b of element e at ``packed[b, e // 8] >> (e % 8) & 1``
    (``bits / 8`` bytes per element: what a right shift by ``bits`` drops)."""
    flat = stream.reshape(-1)
    numel = flat.numel()
    padded = torch.zeros(cdiv(numel, 8) * 8, dtype=torch.int32, device=stream.device)
    padded[:numel] = flat
    weights = (1 << torch.arange(8, device=stream.device, dtype=torch.int32))
    planes = [((padded >> b) & 1).view(-1, 8).mul_(weights).sum(1, dtype=torch.int32) for b in range(bits)]
    if not planes:
        return torch.empty(0, padded.numel() // 8, dtype=torch.uint8, device=stream.device)
    return torch.stack(planes).to(torch.uint8)


def unpack_low_bits(packed: torch.Tensor, bits: int, shape) -> torch.Tensor:
    """int32 tensor of ``shape`` from :func:`pack_low_bits`' planes (the inverse of the packing)."""
    numel = math.prod(shape)
    positions = torch.arange(8, device=packed.device, dtype=torch.int32)
    low = torch.zeros(packed.shape[1] * 8, dtype=torch.int32, device=packed.device)
    for b in range(bits):
        plane = (packed[b].to(torch.int32)[:, None] >> positions) & 1
        low |= plane.reshape(-1) << b
    return low[:numel].view(shape)


@dataclass(frozen=True)
class ResidualScale:
    """The residual's factor in a scaled coupling (MEFT-style): ``y = value * res + H(x)``.

    Float streams multiply by ``value``, and the inverse divides (float error grows like
    ``1 / value`` per block: anchors bound it). Exact streams need ``value = 2**-shift``: the
    forward shifts the int32 stream right (floor of ``value * res`` on the grid) and keeps the
    ``shift`` bits it drops (``low_bits``, packed by :func:`pack_low_bits`); the inverse shifts back
    and restores them, so the inverse stays bitwise at any depth.
    """

    value: float
    low_bits: torch.Tensor | None = None  # exact inverse: the dropped bits of the forward's residual

    @property
    def shift(self) -> int:
        return scale_shift(self.value)

    def apply(self, res: torch.Tensor, frac_bits: int | None) -> torch.Tensor:
        """The forward's scaled residual: ``value * res``, or ``res >> shift`` on an exact stream."""
        if frac_bits is None:
            return res * self.value
        return res >> self.shift

    def dropped_bits(self, res: torch.Tensor) -> torch.Tensor:
        """What :meth:`apply` drops from an exact stream, packed (kept by the engine for the inverse)."""
        return pack_low_bits(res, self.shift)

    def undo(self, stream: torch.Tensor, frac_bits: int | None) -> torch.Tensor:
        """The inverse's residual from ``stream = value * res`` (after the half's output is removed)."""
        if frac_bits is None:
            return stream / self.value
        shift = self.shift
        if shift and self.low_bits is None:
            raise ValueError("the inverse of an exact scaled coupling needs the bits its forward dropped (low_bits)")
        restored = stream << shift
        return restored | unpack_low_bits(self.low_bits, shift, stream.shape) if shift else restored


def check_residual_scale(scale, sign: int, frac_bits: int | None, res: torch.Tensor) -> ResidualScale | None:
    """A couple's ``scale`` argument checked against its stream ``res`` (None: an unscaled couple).

    Float streams take any finite scale > 0, exact streams 2**-s; an exact inverse (sign -1) needs
    the bits its forward dropped: ``low_bits`` uint8 [s, ceil(res.numel() / 8)] on res's device
    (what ``scale.dropped_bits(res)`` returned in the forward). TypeError / ValueError otherwise."""
    if scale is None:
        return None
    if not isinstance(scale, ResidualScale):
        raise TypeError(f"scale must be a ResidualScale (ops.streams) or None, got {type(scale).__name__}")
    check_scale(scale.value, exact=frac_bits is not None)
    if frac_bits is None or sign > 0 or scale.shift == 0:
        return scale
    low = scale.low_bits
    if low is None:
        raise ValueError("the inverse of an exact scaled coupling needs the bits its forward dropped: "
                         "ResidualScale(value, low_bits=scale.dropped_bits(res)) kept from the forward")
    if not isinstance(low, torch.Tensor) or low.dtype != torch.uint8:
        raise TypeError(f"scale.low_bits must be a uint8 tensor (pack_low_bits), got "
                        f"{low.dtype if isinstance(low, torch.Tensor) else type(low).__name__}")
    planes = (scale.shift, -(-res.numel() // 8))
    if tuple(low.shape) != planes:
        raise ValueError(f"scale.low_bits has shape {tuple(low.shape)}; a {res.numel()}-element stream scaled by "
                         f"2**-{scale.shift} needs {planes} (one bit plane per dropped bit, 8 elements a byte)")
    if low.device != res.device:
        raise ValueError(f"scale.low_bits on {low.device} but the stream on {res.device}")
    return scale


def scale_launch_args(scale: ResidualScale | None, sign: int, frac_bits: int | None, placeholder: torch.Tensor):
    """The couple kernels' scale arguments ``(res_scale, shift, low_bits, plane)``: the float
    factor, the exact shift, and the dropped bits' planes (contiguous) with their length in bytes.
    Where no planes are read (unscaled, float, exact forward) ``low_bits`` is an unused pointer
    (:func:`ops.launches.unused_pointer` of ``placeholder``), of uint8 when scaled: the forward and
    the inverse then bind the same pointer type, so they compile one kernel."""
    if scale is None:
        return 1.0, 0, unused_pointer(placeholder), 0
    if frac_bits is None:
        return float(scale.value), 0, unused_pointer(placeholder, torch.uint8), 0
    shift = scale.shift
    if sign > 0 or shift == 0:
        return 1.0, shift, unused_pointer(placeholder, torch.uint8), 0
    low_bits = scale.low_bits.contiguous()
    return 1.0, shift, low_bits, low_bits.shape[1]


# ---------------------------------------------------------------- recompute checksum

# Odd multipliers: x -> x * C mod 2**32 is a bijection, so the weights spread; the xor-shift between
# them makes the weights non-linear in the position (see stream_checksum_reference).
CHECKSUM_MULTIPLIER = -1640531535  # 0x9E3779B1 (2**32 / golden ratio) as a signed int32
CHECKSUM_MIX = -2048144789  # 0x85EBCA6B (MurmurHash3's finaliser) as a signed int32
CHECKSUM_BLOCK = 4096


def _check_stream_pair(s1: torch.Tensor, s2: torch.Tensor):
    if s1.dtype != torch.int32 or s2.dtype != torch.int32 or s1.shape != s2.shape:
        raise TypeError(f"a checksum takes two int32 streams of one shape, got {s1.dtype} {tuple(s1.shape)} and "
                        f"{s2.dtype} {tuple(s2.shape)}")
    if s1.numel() >= 2**31:
        raise ValueError(f"a stream of {s1.numel()} elements: the checksum's int32 positions need < 2^31")


# Position weights of the reference checksum, per (element count, device): made once, not per call.
# Bounded (a few entries of at most CHECKSUM_CACHE_MAX_NUMEL elements, 16 MiB each): larger streams
# make theirs per call.
CHECKSUM_CACHE_MAX_NUMEL = 2**22
CHECKSUM_CACHE_ENTRIES = 4
_checksum_weights_cache: dict = {}


def _checksum_weights(numel: int, device: torch.device) -> torch.Tensor:
    """int32 [numel]: mix(position) | 1, wrapping (kernels/checksum.py; cached for small streams)."""
    key = (numel, device)
    weights = _checksum_weights_cache.get(key)
    if weights is None:
        h = torch.arange(numel, dtype=torch.int32, device=device).mul_(CHECKSUM_MULTIPLIER)
        weights = h.bitwise_xor_(h >> 16).mul_(CHECKSUM_MIX).bitwise_or_(1)
        if numel <= CHECKSUM_CACHE_MAX_NUMEL and not torch.compiler.is_compiling():
            while len(_checksum_weights_cache) >= CHECKSUM_CACHE_ENTRIES:
                _checksum_weights_cache.pop(next(iter(_checksum_weights_cache)))
            _checksum_weights_cache[key] = weights
    return weights


def stream_checksum_reference(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """int32 [2]: sum(s * w) mod 2**32 for each stream, w = mix(position) | 1 (kernels/checksum.py).

    What it catches: any one changed element, always (w is odd: a bijection mod 2**32). Values moved
    between positions (rows or blocks swapped, shifted), or several changed at once: the sum changes
    by sum_k (w[a_k] - w[b_k]) * change_k, a linear form whose coefficients are differences of
    pseudo-random odd weights, so it vanishes mod 2**32 only by chance (about one in 2**31, for data
    not built against the weights); with weights linear in the position it vanished for every
    swap of two equal-sum rows at an even distance (issue 39). Products and sums
    wrap in int32 (two's complement): an int32 sum is one vectorised pass where an int64 one
    widens every element (about 5x slower on a CPU). The weights are cached per element count and
    device. On a CPU one int32 dot product a stream (``torch.dot`` wraps as the elementwise products
    and their sum do; a test holds it to them at the full int32 range): no copy of the streams; on
    CUDA, which has no int32 dot, both streams in one buffer, weighted in place and summed per row
    (the sums wrap, so their order changes no bit)."""
    _check_stream_pair(s1, s2)
    weights = _checksum_weights(s1.numel(), s1.device)
    if s1.is_cpu:
        return torch.stack((torch.dot(s1.reshape(-1), weights), torch.dot(s2.reshape(-1), weights)))
    both = torch.stack((s1.reshape(-1), s2.reshape(-1)))
    return both.mul_(weights).sum(1, dtype=torch.int32)


def stream_checksum_triton(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The same checksum in one Triton pass over both streams (kernels/checksum.py), bitwise equal."""
    from revtriton.kernels import checksum as kernels

    from . import dispatch  # dispatch.launch, as every launcher (counted; recorded by revtriton.aot)

    _check_stream_pair(s1, s2)
    numel = s1.numel()
    if numel == 0:
        return torch.zeros(2, dtype=torch.int32, device=s1.device)
    s1, s2 = s1.contiguous(), s2.contiguous()
    programs = cdiv(numel, CHECKSUM_BLOCK)
    partials = torch.empty(programs, 2, dtype=torch.int32, device=s1.device)  # every program writes its row
    dispatch.launch(kernels.weighted_checksum_kernel, (programs,), s1, s2, partials, numel, CHECKSUM_MULTIPLIER,
                    CHECKSUM_MIX, BLOCK=CHECKSUM_BLOCK, num_warps=8)
    return partials.sum(0, dtype=torch.int32)


def stream_checksum(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The exact engine's recompute checksum: one Triton pass on CUDA (four torch passes
    otherwise), the torch reference elsewhere; both give the same bits. No host sync."""
    if s1.is_cuda:
        return stream_checksum_triton(s1, s2)
    return stream_checksum_reference(s1, s2)
