"""Production shapes and the launches the fused halves make at them (meta tensors, no compute).

Each :class:`Model` is one transformer width the static model judges (8192 tokens a step, bf16
operands under autocast, fp32 stream values). :func:`half_launches` runs one fused coupling half
(norm + MLP or norm + attention) through the library's own ops on ``meta`` tensors, the way the
engine calls it, and returns the kernel launches of each phase:

    forward     no-grad couple  res + F(x)                  (the block's forward)
    recompute   with-grad couple res - F(x)                 (the engine's rebuild in backward)
    backward    the half's gradient, incl. weight and norm gradients

A model with a ``coupling_scale`` couples as a scaled (MEFT-style) block: ``scale * res + F(x)``
forward, ``(res - F(x)) / scale`` in the rebuild, the scale in the couple GEMM's epilogue (exact
streams: a shift, and the rebuild reads the dropped bits' planes).
"""
from __future__ import annotations

import dataclasses

import torch

from revtriton import aot
from revtriton.ops import fused_attention, fused_mlp
from revtriton.ops.streams import ResidualScale, scale_shift

from .roofline import HALVES, PHASES  # noqa: F401 (the same names for both models)

FRAC_BITS = 16


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    dim: int
    hidden: int
    heads: int
    kv_heads: int
    activation: str        # "gelu_tanh" / "gelu" / "relu" (LayerNorm MLP with biases) or "swiglu" (RMSNorm)
    causal: bool
    seq: int
    batch: int
    rope: bool = False
    drop_path: bool = False  # training with stochastic depth: a per-row scale in the couple epilogue
    production: bool = True  # False: extra variants compiled for coverage, not in the roofline table
    halves: tuple = ("mlp", "attention")
    coupling_scale: float | None = None  # a scaled coupling's residual factor (2**-s: exact streams too)
    packed: bool = False  # packed / padded rows: segments and per-row RoPE positions in the attention kernels
    autocast: bool = True  # False: fp32 operands (a model trained without autocast)

    @property
    def norm(self) -> str:
        return "rms" if self.activation == "swiglu" else "layer"

    @property
    def tokens(self) -> int:
        return self.seq * self.batch

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# 8192 tokens a step (ViT: 41 images of 197 tokens = 8077, not a multiple of 16, as in training).
PRODUCTION = (
    Model("vit_b", 768, 3072, 12, 12, "gelu_tanh", False, 197, 41, drop_path=True),
    Model("gpt2", 768, 3072, 12, 12, "gelu_tanh", True, 1024, 8),
    Model("vit_l", 1024, 4096, 16, 16, "gelu_tanh", False, 197, 41, drop_path=True),
    Model("llama7b", 4096, 11008, 32, 32, "swiglu", True, 4096, 2, rope=True),
    Model("llama3_8b", 4096, 14336, 32, 8, "swiglu", True, 8192, 1, rope=True),
)
# Other activations the MLP half supports, at ViT-B width; a model width with K % 16 != 0; scaled
# couplings (the scale in the couple epilogue) at ViT-B's and LLaMA-7B's couples.
COVERAGE = (
    Model("vit_b_gelu", 768, 3072, 12, 12, "gelu", False, 197, 41, drop_path=True, production=False),
    Model("vit_b_relu", 768, 3072, 12, 12, "relu", False, 197, 41, production=False),
    Model("odd_width", 1000, 4000, 8, 8, "gelu_tanh", False, 256, 32, production=False, halves=("mlp",)),
    Model("vit_b_scaled", 768, 3072, 12, 12, "gelu_tanh", False, 197, 41, drop_path=True, production=False,
          coupling_scale=0.5),
    Model("llama7b_scaled", 4096, 11008, 32, 32, "swiglu", True, 4096, 2, rope=True, production=False,
          halves=("mlp",), coupling_scale=2.0**-3),
    Model("llama7b_packed", 4096, 11008, 32, 32, "swiglu", True, 4096, 2, rope=True, production=False,
          halves=("attention",), packed=True),
)
MODELS = {m.name: m for m in PRODUCTION + COVERAGE}
# fp32 operands (no autocast) at every attention head-dim bucket (80: padded to 128) and both MLP
# kinds (SwiGLU; exact GELU's erf gradient), for the shared-memory fit of the kernels' fp32 configs
# (``python -m perf.static --fp32-fit``; not gated otherwise: fp32 is a correctness path, not a tuned one).
FP32_MODELS = tuple(Model(f"fp32_hd{d}", 4 * d, 8 * d, 4, 2, "swiglu", True, 256, 2, rope=True, production=False,
                          halves=("attention", "mlp"), autocast=False) for d in (64, 80, 256)) + (
    Model("fp32_gelu", 256, 1024, 4, 4, "gelu", False, 256, 2, production=False, halves=("mlp",), autocast=False),)


def _param(*shape, device="meta"):
    return torch.empty(*shape, device=device, dtype=torch.float32, requires_grad=True)


def _mlp_params(m: Model):
    if m.activation == "swiglu":
        return dict(norm_weight=_param(m.dim), w_gate=_param(m.hidden, m.dim), w_up=_param(m.hidden, m.dim),
                    w_down=_param(m.dim, m.hidden))
    return dict(norm_weight=_param(m.dim), norm_bias=_param(m.dim), w1=_param(m.hidden, m.dim), b1=_param(m.hidden),
                w2=_param(m.dim, m.hidden), b2=_param(m.dim))


def _attention_params(m: Model):
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
    bias = m.norm == "layer"
    return dict(norm_weight=_param(m.dim), norm_bias=_param(m.dim) if bias else None, w_qkv=_param(qkv, m.dim),
                b_qkv=_param(qkv) if bias else None, w_proj=_param(m.dim, m.dim),
                b_proj=_param(m.dim) if bias else None)


def _couple(m: Model, half: str, params: dict):
    """The half's couple(res, x, sign, frac_bits, scale) with its weights bound."""
    row_scale = torch.empty(m.batch, m.seq, device="meta") if m.drop_path else None
    if half == "mlp" and m.activation == "swiglu":
        return lambda res, x, sign, frac, scale: fused_mlp.fused_swiglu_mlp_couple(
            res, x, sign, frac, params["norm_weight"], params["w_gate"], params["w_up"], params["w_down"],
            row_scale=row_scale, scale=scale)
    if half == "mlp":
        return lambda res, x, sign, frac, scale: fused_mlp.fused_norm_mlp_couple(
            res, x, sign, frac, params["norm_weight"], params["norm_bias"], params["w1"], params["b1"], params["w2"],
            params["b2"], norm=m.norm, activation=m.activation, row_scale=row_scale, scale=scale)
    layout = {}
    if m.packed:
        layout = {name: torch.empty(m.batch, m.seq, device="meta", dtype=torch.long)
                  for name in ("positions", "segments")}
    return lambda res, x, sign, frac, scale: fused_attention.fused_norm_attention_couple(
        res, x, sign, frac, params["norm_weight"], params["norm_bias"], params["w_qkv"], params["b_qkv"],
        params["w_proj"], params["b_proj"], heads=m.heads, kv_heads=m.kv_heads, causal=m.causal,
        rope_theta=10000.0 if m.rope else None, norm=m.norm, row_scale=row_scale, scale=scale, **layout)


def _coupling_scales(m: Model, res: torch.Tensor, exact: bool):
    """(forward, rebuild) ResidualScale of a scaled model (None, None otherwise): the exact rebuild
    gets the dropped bits' planes, as the engine keeps them from the forward."""
    if m.coupling_scale is None:
        return None, None
    planes = None
    if exact:
        planes = torch.empty(scale_shift(m.coupling_scale), -(-res.numel() // 8), device="meta", dtype=torch.uint8)
    return ResidualScale(m.coupling_scale), ResidualScale(m.coupling_scale, planes)


def half_launches(m: Model, half: str, exact: bool = True) -> dict:
    """{phase: [aot.Launch]} of one fused half at the model's shape (exact or float streams)."""
    if half not in HALVES:
        raise ValueError(f"half must be one of {HALVES}, got {half!r}")
    params = _mlp_params(m) if half == "mlp" else _attention_params(m)
    couple = _couple(m, half, params)
    frac = FRAC_BITS if exact else None
    shape = (m.batch, m.seq, m.dim)
    res = torch.empty(shape, device="meta", dtype=torch.int32 if exact else torch.float32)
    x = torch.empty(shape, device="meta", dtype=torch.float32)
    forward_scale, rebuild_scale = _coupling_scales(m, res, exact)
    with aot.recording_launches(torch.bfloat16 if m.autocast else None) as launches:
        with torch.no_grad():
            couple(res, x, 1, frac, forward_scale)
        forward = len(launches)
        stream, port = couple(res, x.requires_grad_(), -1, frac, rebuild_scale)
        recompute = len(launches)
        out = stream if port is None else port  # float streams: the stream is the port, unless scaled
        out.backward(torch.empty_like(out, dtype=torch.float32))
    return {"forward": launches[:forward], "recompute": launches[forward:recompute],
            "backward": launches[recompute:]}


def all_launches(models=None, modes=(True, False)):
    """(model, half, exact, phase, index, launch) for every launch of every model x half x mode."""
    for m in models or (PRODUCTION + COVERAGE):
        for half in m.halves:
            for exact in modes:
                for phase, launches in half_launches(m, half, exact).items():
                    for i, launch in enumerate(launches):
                        yield m, half, exact, phase, i, launch
