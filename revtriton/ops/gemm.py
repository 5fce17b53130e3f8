"""Launchers of the GEMM and row kernels (kernels/gemm.py, kernels/norm.py), with references; the
norm's own row kernels (normalize, norm backward) are ops/norm_rows.py's.

Shared by the fused norm+MLP half (ops/fused_mlp.py) and the fused norm+attention half.
Every launcher checks its input (TypeError / ValueError with the reason), allocates, and
launches through ``dispatch.launch`` (so ``count_launches`` sees it). Matrices are 2-D
``[rows, cols]``; rows are tokens (flatten ``[..., d]`` with ``reshape(-1, d)`` first). A weight
is an nn.Linear weight ``[out, in]``. GEMM operands are raw: both in the operand dtype (bf16 /
fp16 under autocast, else the weights' dtype; fp32 runs as IEEE fp32, no TF32, like torch), with
nothing applied to them per tile: the norm runs once per row (``norm_rows.normalize``), gradients are
scaled and cast once (:func:`scale_rows`). Accumulation and statistics are fp32.

Forward
    linear(a, weight, bias=None, *, activation=None, weight_up=None, save_preact=False,
           out_dtype=None) -> (out, preact or None)
        out = act(a @ weight.T + bias); "swiglu" needs ``weight_up``: out = silu(a W^T) * (a U^T).
        ``save_preact`` also returns the pre-activation (SwiGLU: [gate | up], 2*out columns).
    linear_couple(a, weight, bias, res, sign, *, frac_bits=None, row_scale=None, scale=None) -> stream
        h = (a @ weight.T + bias) * row_scale[:, None]; float mode (frac_bits None):
        stream = res + sign * h in res's dtype; exact mode: res int32,
        stream = res + sign * round_half_even(h * 2^frac_bits) (saturated, int32 add).
        ``scale`` (streams.ResidualScale, a scaled coupling) in the same epilogue: float
        scale * res + h / (res - h) / scale; exact (res >> s) + q / ((res - q) << s) | low bits.
Backward
    scale_rows(g, *, alpha=1.0, row_scale=None, out_dtype=None, col_sums=False, store=True)
        -> (alpha * row_scale[:, None] * g in out_dtype or None, Partials of its column sums or None)
    linear_act_bwd(grad, weight, preact, *, activation, col_sums=False) -> (d_preact, Partials or None)
        (grad @ weight) * act'(preact) in grad's dtype; "swiglu": preact is [gate | up] and the
        result [d gate | d up]; ``col_sums``: the bias gradient's partial sums from the epilogue.
    linear_input_grad(grad, weight, *, weight2=None, out_dtype=torch.float32) -> grad @ weight
        with ``weight2``: grad[:, :H] @ weight + grad[:, H:] @ weight2 (grad has 2H columns).
    linear_weight_grad(grad, inp, *, out_dtype=torch.float32, split_k=None, pending=None) -> dW
        dW = grad.T @ inp. When the output tiles cannot fill the GPU, K (the tokens) is split
        deterministically: fp32 partials, then a reduction in a fixed order (immediately, or
        appended to ``pending`` for :func:`reduce_partials` to run with the others).
    reduce_partials(*partials): every pending reduction of a backward (norm_rows' too), four per launch.

References: ``*_reference`` beside each launcher, same arguments, pure torch.

Kernels: one JIT GEMM (kernels/gemm.py) autotuned through three wrappers with their own config
lists (``fused_gemm_kernel``; ``fused_gemm_dual_kernel`` for SwiGLU's dual accumulator,
``fused_gemm_act_grad_kernel`` for its gradient and exact GELU's), keyed on power-of-two
buckets of M and K, N and the variant flags. Whether the
pre-activation is saved is a runtime flag (not specialised by the JIT), so a no-grad forward and
its with-grad recompute run the same compiled kernel with the same config and agree bitwise.
The static model (revtriton/aot.py, perf/static.py) compiles these launches ahead of time.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import dispatch
from .launches import cdiv, unused_pointer
from .reference import activation_reference
from .streams import ResidualScale, check_frac_bits, check_residual_scale, exact_add_reference, scale_launch_args
from .tma import ensure_descriptor_allocator, matrix_strides_tma_ready, tma_aligned

from revtriton.kernels import gemm as gemm_kernels  # kernels/ (revtriton/__init__.py maps it in a checkout)
from revtriton.kernels import norm as norm_kernels
from revtriton.kernels.configs import next_power_of_2, norm_num_warps

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATION_CODES = {None: gemm_kernels.ACT_NONE, "gelu_tanh": gemm_kernels.ACT_GELU_TANH,
                    "gelu": gemm_kernels.ACT_GELU, "relu": gemm_kernels.ACT_RELU, "swiglu": gemm_kernels.ACT_SWIGLU}
NORMS = ("layer", "rms")
MAX_NORM_DIM = 16384  # a row kernel keeps a whole row in registers
COL_SUM_ROWS = 64  # kernels/gemm.py: rows of C per column-sum partial row
MAX_BLOCK_M = 128
REDUCTIONS_PER_LAUNCH = 4  # kernels/norm.py sum_partials_kernel: a half's bias, norm and split-K partials
DEFAULT_SMS = 132  # H100 SXM: split-K decisions when no GPU is there to ask (the interpreter)
INTERPRETER_PERSISTENT_PROGRAMS = 3


# ---------------------------------------------------------------- checks

def _check_matrix(t, name, *, dtypes=FLOAT_DTYPES, rows=None, cols=None, unit_col_stride=False):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype {t.dtype} not supported (expected one of {dtypes})")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, expected {rows}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} has {t.shape[1]} columns, expected {cols}")
    if unit_col_stride and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dim, got strides {t.stride()}")
    if t.numel() and t.shape[0] > 1 and t.stride(0) == 0 or (t.numel() and t.shape[1] > 1 and t.stride(1) == 0):
        raise ValueError(f"{name} is a broadcast (stride-0) view: materialize it first, strides {t.stride()}")


def _check_vector(t, name, length, *, dtypes=FLOAT_DTYPES):
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor of length {length}, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.shape[0] != length:
        raise ValueError(f"{name} has length {t.shape[0]}, expected {length}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype {t.dtype} not supported (expected one of {dtypes})")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_same_device(*named):
    devices = {t.device for _, t in named if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError("tensors on different devices: " + ", ".join(
            f"{n}={t.device}" for n, t in named if isinstance(t, torch.Tensor)))


def _check_row_scale(row_scale, rows):
    _check_vector(row_scale, "row_scale", rows)


def as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., dim] -> [M, dim] as the launchers take it: unit column stride, no stride-0 (broadcast)
    rows; a view when the layout already fits, else a contiguous copy."""
    t = t.reshape(-1, dim)
    if (dim > 1 and t.stride(1) != 1) or (t.shape[0] > 1 and t.stride(0) == 0):
        t = t.contiguous()
    return t


def row_operand(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` [..., dim] as a launch reads it: itself when contiguous (a launch takes its address and
    the row stride its launch object worked out from the [M, dim] view, which a contiguous tensor
    shares: the reshape costs about 3.6 us of a couple's host time), else :func:`as_rows`."""
    return t if t.is_contiguous() else as_rows(t, dim)


# ---------------------------------------------------------------- partial sums

@dataclass
class Partials:
    """A pending deterministic reduction: ``out.view(-1)[n] = sum_p part[p, n]`` (fp32 partials)."""
    part: torch.Tensor  # [P, N] fp32, contiguous
    out: torch.Tensor  # N elements, contiguous, any float dtype

    @property
    def rows(self) -> int:
        return self.part.shape[0]


def reduce_partials_reference(*partials):
    """The kernel's order: rows p = 0, 1, ... added one after the other in fp32."""
    for p in partials:
        if p is not None:
            acc = torch.zeros(p.part.shape[1], dtype=torch.float32, device=p.part.device)
            for row in p.part:
                acc = acc + row
            p.out.view(-1).copy_(acc)


def reduce_partials(*partials):
    """Run every given reduction (None entries skipped), four per launch, each in a fixed order."""
    jobs = [p for p in partials if p is not None and p.out.numel()]
    for first in range(0, len(jobs), REDUCTIONS_PER_LAUNCH):
        group = jobs[first:first + REDUCTIONS_PER_LAUNCH]
        widest = max(p.part.shape[1] for p in group)
        block = 1024 if not dispatch.interpreter_enabled() else 4096
        args = []
        for p in group + [group[0]] * (REDUCTIONS_PER_LAUNCH - len(group)):
            args += [p.part, p.out, p.part.shape[0], p.part.shape[1]]
        dispatch.launch(norm_kernels.sum_partials_kernel, (cdiv(widest, block),), *args,
                        JOBS=len(group), BLOCK_N=block, num_warps=4)


def row_partial_programs(rows: int) -> int:
    """Programs of a row kernel that writes partial sums: a function of the row count only (a
    fixed summation order). The interpreter runs programs one after the other, so it gets few."""
    return max(1, min(rows, 8 if dispatch.interpreter_enabled() else 512))


# ---------------------------------------------------------------- the GEMM launch

class GemmLaunch:
    """One launch of kernels.gemm's GEMM with what depends only on the call's signature worked out
    once: the kernel variant, its grid, its constexpr switches, its scalar arguments and whether the
    strides allow tensor descriptors. Built from the operands' metadata (A [M, K] and B [K, N] read
    through the given strides; C [M, N] with ``c_strides``, or the [split_k, M, N] fp32 partials),
    then called with each call's tensors: the forward plans (ops/fused_mlp.py,
    ops/fused_attention.py) keep one per launch, so a repeated call does none of this again."""

    __slots__ = ("kernel", "grid", "sizes", "aux_stride", "res_stride", "epilogue", "tail", "has_scale",
                 "scale_args", "tma_possible", "second_k_offset", "meta", "meta_tma")

    def __init__(self, a, a_strides, b, b_strides, c_strides, M, N, K, *, b2=None, bias=None,
                 row_scale=None, aux_stride=None, store_aux=False, res_stride=None, col_sum=None, alpha=1.0, sign=1,
                 frac_bits=0, dual_b=False, second_k=False, split_k=1, k_per_split=0, act=None, act_bwd=None,
                 residual=0, scale=None):
        stride_am, stride_ak = a_strides
        stride_bk, stride_bn = b_strides
        stride_cm, stride_cn = (N, 1) if split_k > 1 else c_strides  # split-K: the partial buffer
        self.sizes = (M, N, K, k_per_split, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn)
        self.aux_stride = 0 if aux_stride is None else aux_stride  # rows of the aux / residual tiles
        self.res_stride = 0 if res_stride is None else res_stride
        self.epilogue = (float(alpha), int(sign), float(2.0 ** frac_bits))
        self.tail = (int(bool(store_aux)), next_power_of_2(M), next_power_of_2(K))
        # The coupling scale's arguments: its factor and shift are the scale's; its dropped bits
        # (an exact inverse) are each call's, so a scaled launch asks streams.scale_launch_args again.
        self.has_scale = scale is not None
        self.scale_args = (sign, None if residual == gemm_kernels.RES_FLOAT else frac_bits)
        # The sm_90 configs load tiles by TMA when every operand can be described (16-bit operands;
        # B is seen as [N, K]); the pointer path otherwise, and on sm_80. The strides decide here, the
        # base addresses at each call.
        size = a.element_size()
        self.tma_possible = size == 2 and matrix_strides_tma_ready(size, stride_am, stride_ak) and \
            matrix_strides_tma_ready(size, stride_bn, stride_bk)
        self.second_k_offset = K * stride_ak if second_k else None
        device = a.device

        def grid(meta):
            tiles = cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
            return (persistent_programs(tiles, device) if meta["PERSISTENT"] else tiles, split_k)

        self.grid = grid
        if dual_b:
            self.kernel = gemm_kernels.fused_gemm_dual_kernel
        elif act_bwd in ("swiglu", "gelu"):
            self.kernel = gemm_kernels.fused_gemm_act_grad_kernel
        else:
            self.kernel = gemm_kernels.fused_gemm_kernel
        self.meta, self.meta_tma = (dict(
            DUAL_B=dual_b, SECOND_K=second_k, SPLIT_K=split_k,
            TMA_READY=tma, A_K_MAJOR=tma and stride_ak == 1, B_K_MAJOR=tma and stride_bk == 1,
            ALIGNED_8=tma and _aligned_8_only(
                M, N, K, stride_am * stride_ak, stride_bk * stride_bn, stride_cm,
                16 if aux_stride is None else aux_stride, 16 if res_stride is None else res_stride),
            HAS_BIAS=bias is not None,
            ACT=ACTIVATION_CODES[act], ACT_BWD=ACTIVATION_CODES[act_bwd], COL_SUM=col_sum is not None,
            HAS_ROW_SCALE=row_scale is not None, RESIDUAL=residual, RES_SCALED=scale is not None,
            INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        ) for tma in (False, True))

    def _tma(self, a, b, b2) -> bool:
        """Whether this call's operands can be described (their strides could: the base addresses)."""
        return tma_aligned(a) and tma_aligned(b) and (b2 is None or tma_aligned(b2)) and (
            self.second_k_offset is None or tma_aligned(a, self.second_k_offset))

    def __call__(self, a, b, c, *, b2=None, bias=None, row_scale=None, aux=None, res=None, col_sum=None, scale=None):
        # Unused pointers: null pointers of c's dtype (a fixed choice per variant keeps the tuning key
        # and the compiled kernel those of the launch that passes a tensor there).
        unused = unused_pointer(c)
        if self.has_scale:
            scale_args = scale_launch_args(scale, *self.scale_args, c)
        else:
            scale_args = (1.0, 0, unused, 0)
        tma = self.tma_possible and self._tma(a, b, b2)
        if tma:
            ensure_descriptor_allocator(a.device)
        dispatch.launch(
            self.kernel, self.grid,
            a, b, unused if b2 is None else b2, c, *self.sizes,
            unused if bias is None else bias, unused if row_scale is None else row_scale,
            unused if aux is None else aux, self.aux_stride, unused if res is None else res, self.res_stride,
            unused if col_sum is None else col_sum, *self.epilogue, *scale_args, *self.tail,
            **(self.meta_tma if tma else self.meta))
        return c


def _launch_gemm(a, a_strides, b, b_strides, c, M, N, K, *, b2=None, bias=None, row_scale=None, aux=None,
                 res=None, col_sum=None, scale=None, **switches):
    """One launch of kernels.gemm.fused_gemm_kernel: A [M, K] and B [K, N] read through strides
    (a :class:`GemmLaunch` built and called once)."""
    tensors = dict(b2=b2, bias=bias, row_scale=row_scale, col_sum=col_sum, scale=scale)
    launch = GemmLaunch(a, a_strides, b, b_strides, c.stride(), M, N, K,
                        aux_stride=None if aux is None else aux.stride(0),
                        res_stride=None if res is None else res.stride(0), **tensors, **switches)
    return launch(a, b, c, aux=aux, res=res, **tensors)


def _aligned_8_only(*sizes) -> bool:
    """Every size a multiple of 8 and one not of 16: only then does the kernel's ALIGNED_8 hint tell the
    compiler what the JIT's own specialisation (multiples of 16) does not (no extra compiled variant
    otherwise). The operands' strides are passed as their products with the unit one; the output's,
    the aux and the residual tiles' as their row strides (their columns are unit-stride; 16, which
    changes nothing, when absent)."""
    return all(n % 8 == 0 for n in sizes) and any(n % 16 for n in sizes)


def as_operand(w, dtype):
    """``w`` in the GEMM operand dtype: itself when it already is (``Tensor.to`` costs about a
    microsecond of argument parsing even when it changes nothing; the fused couples call it for every
    weight of every call)."""
    return w if w.dtype == dtype else w.to(dtype)


def _weight_as_b(weight):
    """An nn.Linear weight [N, K] read as B = weight.T [K, N]: (tensor, (stride_k, stride_n))."""
    return weight, (weight.stride(1), weight.stride(0))


def _check_operands(a, weight, name="a"):
    """Raw GEMM operands share one float dtype (the operand dtype)."""
    if a.dtype != weight.dtype:
        raise TypeError(f"{name} dtype {a.dtype} != weight dtype {weight.dtype}: GEMM operands are raw, cast "
                        f"them to one operand dtype first (normalize / scale_rows write it)")


# ---------------------------------------------------------------- forward GEMMs

def _activation(h, activation):
    return h if activation is None else activation_reference(h, activation)


def linear_reference(a, weight, bias=None, *, activation=None, weight_up=None, save_preact=False, out_dtype=None):
    out_dtype = weight.dtype if out_dtype is None else out_dtype
    z = (a.float() @ weight.float().t() + (0 if bias is None else bias.float())).to(out_dtype)
    if activation == "swiglu":
        up = (a.float() @ weight_up.float().t()).to(out_dtype)
        out = (F.silu(z.float()).to(out_dtype).float() * up.float()).to(out_dtype)
        return out, (torch.cat([z, up], dim=1) if save_preact else None)
    return _activation(z.float(), activation).to(out_dtype), (z if save_preact else None)


def _check_forward_gemm(a, weight, bias):
    """Checks shared by the forward GEMM launchers; returns (M, K, N)."""
    _check_matrix(weight, "weight")
    _check_matrix(a, "a", cols=weight.shape[1])
    _check_operands(a, weight)
    _check_vector(bias, "bias", weight.shape[0])
    return a.shape[0], a.shape[1], weight.shape[0]


class LinearLaunch:
    """:func:`linear` for one signature: its checks at construction, then called with each call's
    ``(a, weight, bias, weight_up)`` of that signature."""

    launcher = "linear"  # the public launcher it is (aot.recording_launches names launches by it)
    __slots__ = ("rows", "cols", "out_dtype", "device", "preact_cols", "save_preact", "gemm")

    def __init__(self, a, weight, bias=None, *, activation=None, weight_up=None, save_preact=False, out_dtype=None):
        M, K, N = _check_forward_gemm(a, weight, bias)
        if activation not in ACTIVATION_CODES:
            raise ValueError(f"activation must be one of {tuple(ACTIVATION_CODES)}, got {activation!r}")
        if (activation == "swiglu") != (weight_up is not None):
            raise ValueError("activation='swiglu' and weight_up go together")
        if weight_up is not None:
            _check_matrix(weight_up, "weight_up", rows=N, cols=K)
            if weight_up.dtype != weight.dtype or weight_up.stride() != weight.stride():
                raise TypeError("weight_up must have the dtype and strides of weight")
            if bias is not None:
                raise ValueError("the SwiGLU GEMM takes no bias")
        _check_same_device(("a", a), ("weight", weight), ("weight_up", weight_up), ("bias", bias))
        out_dtype = weight.dtype if out_dtype is None else out_dtype
        if out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"out_dtype {out_dtype} not supported")
        self.rows, self.cols, self.out_dtype, self.device = M, N, out_dtype, a.device
        self.save_preact = save_preact
        self.preact_cols = 2 * N if weight_up is not None else N
        b, b_strides = _weight_as_b(weight)
        # The aux pointer is always `out`-typed, saved or not: forward and recompute share one tuning key.
        self.gemm = None if M == 0 or N == 0 else GemmLaunch(
            a, a.stride(), b, b_strides, (N, 1), M, N, K, b2=weight_up, bias=bias,
            aux_stride=self.preact_cols if save_preact else N, store_aux=save_preact, dual_b=weight_up is not None,
            act=activation)

    def __call__(self, a, weight, bias=None, weight_up=None):
        out = torch.empty(self.rows, self.cols, dtype=self.out_dtype, device=self.device)
        preact = None
        if self.save_preact:
            preact = torch.empty(self.rows, self.preact_cols, dtype=self.out_dtype, device=self.device)
        if self.gemm is not None:
            self.gemm(a, weight, out, b2=weight_up, bias=bias, aux=preact if self.save_preact else out)
        return out, preact


def linear(a, weight, bias=None, *, activation=None, weight_up=None, save_preact=False, out_dtype=None):
    """act(a @ weight.T + bias) in one launch; see the module doc."""
    launch = LinearLaunch(a, weight, bias, activation=activation, weight_up=weight_up, save_preact=save_preact,
                          out_dtype=out_dtype)
    return launch(a, weight, bias, weight_up)


def linear_couple_reference(a, weight, bias, res, sign, *, frac_bits=None, row_scale=None, scale=None):
    h = a.float() @ weight.float().t() + (0 if bias is None else bias.float())
    if row_scale is not None:
        h = h * row_scale.float()[:, None]
    if frac_bits is not None:
        return exact_add_reference(res, h, sign, frac_bits, scale)
    if scale is None:
        return (res.float() + sign * h).to(res.dtype)
    if sign > 0:  # the scale's semantics live in streams.ResidualScale
        return (scale.apply(res.float(), None) + h).to(res.dtype)
    return scale.undo(res.float() - h, None).to(res.dtype)


class LinearCoupleLaunch:
    """:func:`linear_couple` for one signature: its checks at construction, then called with each
    call's ``(a, weight, bias, res, row_scale, scale)`` of that signature."""

    launcher = "linear_couple"  # the public launcher it is (aot.recording_launches names launches by it)
    __slots__ = ("out_shape", "out_dtype", "device", "gemm")

    def __init__(self, a, weight, bias, res, sign, *, frac_bits=None, row_scale=None,
                 scale: ResidualScale | None = None, out_shape: tuple | None = None):
        """``out_shape``: the output stream's shape, [M, N] by default; the couples give their
        residual's [..., N] (rows in order: no view of the output afterwards)."""
        M, K, N = _check_forward_gemm(a, weight, bias)
        out_shape = (M, N) if out_shape is None else tuple(int(n) for n in out_shape)
        if not out_shape or out_shape[-1] != N or math.prod(out_shape) != M * N:
            raise ValueError(f"out_shape {out_shape} does not hold the [{M}, {N}] output")
        _check_row_scale(row_scale, M)
        if sign not in (1, -1):
            raise ValueError(f"sign must be +1 or -1, got {sign!r}")
        if frac_bits is None:
            _check_matrix(res, "res", rows=M, cols=N, unit_col_stride=True)
            residual = gemm_kernels.RES_FLOAT
        else:
            check_frac_bits(frac_bits)
            _check_matrix(res, "res", dtypes=(torch.int32,), rows=M, cols=N, unit_col_stride=True)
            residual = gemm_kernels.RES_EXACT
        _check_same_device(("a", a), ("weight", weight), ("bias", bias), ("res", res), ("row_scale", row_scale))
        check_residual_scale(scale, sign, frac_bits, res)
        self.out_shape, self.out_dtype, self.device = out_shape, res.dtype, res.device
        b, b_strides = _weight_as_b(weight)
        self.gemm = None if M == 0 or N == 0 else GemmLaunch(
            a, a.stride(), b, b_strides, (N, 1), M, N, K, bias=bias, row_scale=row_scale, res_stride=res.stride(0),
            sign=sign, frac_bits=0 if frac_bits is None else frac_bits, residual=residual, scale=scale)

    def __call__(self, a, weight, bias, res, row_scale=None, scale: ResidualScale | None = None):
        out = torch.empty(*self.out_shape, dtype=self.out_dtype, device=self.device)
        if self.gemm is not None:
            self.gemm(a, weight, out, bias=bias, row_scale=row_scale, res=res, scale=scale)
        return out


def linear_couple(a, weight, bias, res, sign, *, frac_bits=None, row_scale=None, scale: ResidualScale | None = None):
    """res + sign * (a @ weight.T + bias) * row_scale, float or exact, in one launch; with a
    ``scale`` (a scaled coupling) the residual is scaled in the same epilogue (module doc)."""
    launch = LinearCoupleLaunch(a, weight, bias, res, sign, frac_bits=frac_bits, row_scale=row_scale, scale=scale)
    return launch(a, weight, bias, res, row_scale, scale)


# ---------------------------------------------------------------- backward: scale, GEMMs

def scale_rows_reference(g, *, alpha=1.0, row_scale=None, out_dtype=None, col_sums=False, store=True):
    s = g.float() * alpha
    if row_scale is not None:
        s = s * row_scale.float()[:, None]
    out_dtype = g.dtype if out_dtype is None else out_dtype
    sums = s.sum(0) if col_sums else None
    return (s.to(out_dtype) if store else None), sums


class ScaleRowsLaunch:
    """:func:`scale_rows` for one signature: its checks at construction, then called with each
    call's ``(g, row_scale)``."""

    launcher = "scale_rows"  # (aot.recording_launches names launches by it)
    __slots__ = ("rows", "dim", "out_dtype", "sums_dtype", "device", "store", "col_sums", "programs", "args", "meta")

    def __init__(self, g, *, alpha=1.0, row_scale=None, out_dtype=None, col_sums=False, store=True, sums_dtype=None):
        _check_matrix(g, "g", unit_col_stride=True)
        M, D = g.shape
        _check_row_scale(row_scale, M)
        if D > MAX_NORM_DIM:
            raise ValueError(f"row kernels hold a row in registers: dim {D} > {MAX_NORM_DIM}")
        if not store and not col_sums:
            raise ValueError("scale_rows with store=False needs col_sums=True")
        _check_same_device(("g", g), ("row_scale", row_scale))
        self.rows, self.dim, self.device = M, D, g.device
        self.out_dtype = g.dtype if out_dtype is None else out_dtype
        self.sums_dtype = sums_dtype or torch.float32
        self.store, self.col_sums = store, col_sums
        programs = row_partial_programs(M)
        rows_per_program = math.ceil(M / programs) if M else 0
        self.programs = math.ceil(M / rows_per_program) if M else 0
        block_n = next_power_of_2(D)
        self.args = (M, D, rows_per_program, g.stride(0), D if store else 0, float(alpha))  # out: a fresh [M, D]
        self.meta = dict(HAS_ROW_SCALE=row_scale is not None, STORE=store, COL_SUM=col_sums, BLOCK_N=block_n,
                         num_warps=norm_num_warps(block_n))

    def __call__(self, g, row_scale=None):
        M, D = self.rows, self.dim
        out = torch.empty(M, D, dtype=self.out_dtype, device=self.device) if self.store else None
        partials = None
        if self.col_sums:
            result = torch.empty(D, dtype=self.sums_dtype, device=self.device)
            if M == 0:
                result.zero_()
            else:
                partials = Partials(torch.empty(self.programs, D, dtype=torch.float32, device=self.device), result)
        if M == 0 or D == 0:
            return out, partials
        unused = unused_pointer(g)
        dispatch.launch(norm_kernels.scale_rows_kernel, (self.programs,), g, unused if out is None else out,
                        unused if row_scale is None else row_scale, unused if partials is None else partials.part,
                        *self.args, **self.meta)
        return out, partials


def scale_rows(g, *, alpha=1.0, row_scale=None, out_dtype=None, col_sums=False, store=True, sums_dtype=None):
    """(alpha * row_scale[:, None] * g in out_dtype, or None without ``store``; with ``col_sums``,
    the Partials of the scaled rows' column sums (a bias gradient, sums_dtype)); one launch."""
    return ScaleRowsLaunch(g, alpha=alpha, row_scale=row_scale, out_dtype=out_dtype, col_sums=col_sums, store=store,
                           sums_dtype=sums_dtype)(g, row_scale)


def _activation_grad_reference(z, activation):
    z = z.detach().float().requires_grad_(True)
    with torch.enable_grad():
        y = _activation(z, activation)
        (g,) = torch.autograd.grad(y.sum(), z)
    return g


def linear_act_bwd_reference(grad, weight, preact, *, activation, col_sums=False):
    g = grad.float() @ weight.float()
    if activation == "swiglu":
        n = weight.shape[1]
        zg, zu = preact[:, :n].float(), preact[:, n:].float()
        sig = torch.sigmoid(zg)
        out = torch.cat([g * zu * sig * (1 + zg * (1 - sig)), g * F.silu(zg)], 1).to(grad.dtype)
    else:
        out = (g * _activation_grad_reference(preact, activation)).to(grad.dtype)
    return out, (out.float().sum(0) if col_sums else None)


class LinearActBwdLaunch:
    """:func:`linear_act_bwd` for one signature: its checks at construction, then called with each
    call's ``(grad, weight, preact)``."""

    launcher = "linear_act_bwd"  # (aot.recording_launches names launches by it)
    __slots__ = ("rows", "hidden", "width", "dtype", "sums_dtype", "device", "col_sums", "gemm")

    def __init__(self, grad, weight, preact, *, activation, col_sums=False, sums_dtype=None):
        _check_matrix(weight, "weight")
        N_out, H = weight.shape
        _check_matrix(grad, "grad", cols=N_out)
        _check_operands(grad, weight, "grad")
        M = grad.shape[0]
        if activation not in ("gelu_tanh", "gelu", "relu", "swiglu"):
            raise ValueError(f"activation must be gelu_tanh, gelu, relu or swiglu, got {activation!r}")
        if col_sums and activation == "swiglu":
            raise ValueError("the SwiGLU GEMM has no bias: col_sums does not apply")
        width = 2 * H if activation == "swiglu" else H
        _check_matrix(preact, "preact", dtypes=(grad.dtype,), rows=M, cols=width, unit_col_stride=True)
        _check_same_device(("grad", grad), ("weight", weight), ("preact", preact))
        self.rows, self.hidden, self.width, self.dtype, self.device = M, H, width, grad.dtype, grad.device
        self.sums_dtype = sums_dtype or torch.float32
        self.col_sums = col_sums
        # B = weight [N_out, H] read as [K = N_out, N = H]: no transpose.
        self.gemm = None if M == 0 or H == 0 else GemmLaunch(
            grad, grad.stride(), weight, (weight.stride(0), weight.stride(1)), (width, 1), M, H, N_out,
            aux_stride=preact.stride(0), act_bwd=activation, col_sum=True if col_sums else None)

    def __call__(self, grad, weight, preact):
        M, H = self.rows, self.hidden
        out = torch.empty(M, self.width, dtype=self.dtype, device=self.device)
        partials = col_sum_buffer = None
        if self.col_sums:
            result = torch.empty(H, dtype=self.sums_dtype, device=self.device)
            if M == 0:
                result.zero_()
            else:
                rows = cdiv(M, COL_SUM_ROWS)
                part = torch.empty(rows + MAX_BLOCK_M // COL_SUM_ROWS - 1, H, dtype=torch.float32, device=self.device)
                partials = Partials(part[:rows], result)
                col_sum_buffer = part
        if self.gemm is not None:
            self.gemm(grad, weight, out, aux=preact, col_sum=col_sum_buffer)
        return out, partials


def linear_act_bwd(grad, weight, preact, *, activation, col_sums=False, sums_dtype=None):
    """(grad @ weight) * act'(preact) in one launch (the dH GEMM); ``col_sums``: the Partials of
    its column sums (the bias gradient of the layer whose pre-activation this is)."""
    launch = LinearActBwdLaunch(grad, weight, preact, activation=activation, col_sums=col_sums, sums_dtype=sums_dtype)
    return launch(grad, weight, preact)


def linear_input_grad_reference(grad, weight, *, weight2=None, out_dtype=torch.float32):
    g = grad.float()
    if weight2 is None:
        out = g @ weight.float()
    else:
        h = weight.shape[0]
        out = g[:, :h] @ weight.float() + g[:, h:] @ weight2.float()
    return out.to(out_dtype)


class LinearInputGradLaunch:
    """:func:`linear_input_grad` for one signature: its checks at construction, then called with
    each call's ``(grad, weight, weight2)``."""

    launcher = "linear_input_grad"  # (aot.recording_launches names launches by it)
    __slots__ = ("rows", "cols", "inner", "out_dtype", "device", "gemm")

    def __init__(self, grad, weight, *, weight2=None, out_dtype=torch.float32):
        _check_matrix(weight, "weight")
        H, D = weight.shape
        _check_matrix(grad, "grad", cols=2 * H if weight2 is not None else H)
        _check_operands(grad, weight, "grad")
        if weight2 is not None:
            _check_matrix(weight2, "weight2", rows=H, cols=D)
            if weight2.dtype != weight.dtype or weight2.stride() != weight.stride():
                raise TypeError("weight2 must have the dtype and strides of weight")
        M = grad.shape[0]
        _check_same_device(("grad", grad), ("weight", weight), ("weight2", weight2))
        self.rows, self.cols, self.inner, self.out_dtype, self.device = M, D, H, out_dtype, grad.device
        self.gemm = None if M == 0 or D == 0 or H == 0 else GemmLaunch(
            grad, grad.stride(), weight, (weight.stride(0), weight.stride(1)), (D, 1), M, D, H, b2=weight2,
            second_k=weight2 is not None)

    def __call__(self, grad, weight, weight2=None):
        out = torch.empty(self.rows, self.cols, dtype=self.out_dtype, device=self.device)
        if self.rows == 0 or self.cols == 0:
            return out
        if self.inner == 0:
            return out.zero_()
        return self.gemm(grad, weight, out, b2=weight2)


def linear_input_grad(grad, weight, *, weight2=None, out_dtype=torch.float32):
    """grad @ weight (+ grad[:, H:] @ weight2), one launch; weight is [H, D] (the layer's [out, in])."""
    return LinearInputGradLaunch(grad, weight, weight2=weight2, out_dtype=out_dtype)(grad, weight, weight2)


def linear_weight_grad_reference(grad, inp, *, out_dtype=torch.float32, split_k=None, pending=None):
    return (grad.float().t() @ inp.float()).to(out_dtype)


def sm_count(device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_SMS


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(tiles: int, device) -> int:
    """Programs of a persistent GEMM launch: one per SM (none idle when there are fewer tiles).
    The interpreter runs programs one after the other, so it gets three: each walks several tiles."""
    return min(tiles, INTERPRETER_PERSISTENT_PROGRAMS if dispatch.interpreter_enabled() else sm_count(device))


def split_k_plan(m: int, n: int, k: int, sms: int) -> tuple[int, int]:
    """(splits, k per split) for a weight-gradient GEMM [m, n] over k tokens: split K only when the
    128 x 128 output tiles cannot fill half the SMs, in 256-deep multiples (every BLOCK_K divides it)."""
    tiles = cdiv(m, 128) * cdiv(n, 128)
    if 2 * tiles >= sms or k < 2048:
        return 1, k
    splits = min(cdiv(sms, tiles), k // 1024, 8)
    per_split = cdiv(cdiv(k, splits), 256) * 256
    return cdiv(k, per_split), per_split


class LinearWeightGradLaunch:
    """:func:`linear_weight_grad` for one signature (split-K decided with it): its checks at
    construction, then called with each call's ``(grad, inp)``."""

    launcher = "linear_weight_grad"  # (aot.recording_launches names launches by it)
    __slots__ = ("rows", "cols", "tokens", "out_dtype", "device", "splits", "gemm")

    def __init__(self, grad, inp, *, out_dtype=torch.float32, split_k=None):
        _check_matrix(grad, "grad")
        M, N_out = grad.shape
        _check_matrix(inp, "inp", rows=M)
        _check_operands(grad, inp, "grad")
        width = inp.shape[1]
        _check_same_device(("grad", grad), ("inp", inp))
        self.rows, self.cols, self.tokens, self.out_dtype, self.device = N_out, width, M, out_dtype, grad.device
        if split_k is None:
            splits, per_split = split_k_plan(N_out, width, M, sm_count(grad.device))
        else:
            if not isinstance(split_k, int) or split_k < 1:
                raise ValueError(f"split_k must be a positive int, got {split_k!r}")
            per_split = cdiv(cdiv(M, split_k), 16) * 16  # any size is correct; 256 is faster
            splits = cdiv(M, per_split) if M else 1
        self.splits = splits
        # A = grad.T [N_out, M], B = inp [M, width]: K runs over tokens.
        self.gemm = None if N_out == 0 or width == 0 or M == 0 else GemmLaunch(
            grad, (grad.stride(1), grad.stride(0)), inp, (inp.stride(0), inp.stride(1)), (width, 1), N_out, width, M,
            split_k=splits, k_per_split=per_split if splits > 1 else 0)

    def __call__(self, grad, inp, pending=None):
        dw = torch.empty(self.rows, self.cols, dtype=self.out_dtype, device=self.device)
        if self.rows == 0 or self.cols == 0:
            return dw
        if self.tokens == 0:
            return dw.zero_()
        if self.splits == 1:
            return self.gemm(grad, inp, dw)
        part = torch.empty(self.splits, self.rows * self.cols, dtype=torch.float32, device=self.device)
        self.gemm(grad, inp, part)
        job = Partials(part, dw)
        if pending is None:
            reduce_partials(job)
        else:
            pending.append(job)
        return dw


def linear_weight_grad(grad, inp, *, out_dtype=torch.float32, split_k=None, pending=None):
    """dW = grad.T @ inp [N_out, width] over the M token rows; see the module doc for split-K."""
    return LinearWeightGradLaunch(grad, inp, out_dtype=out_dtype, split_k=split_k)(grad, inp, pending)
