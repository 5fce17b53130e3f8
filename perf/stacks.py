"""The benchmark stacks: presets (ViT-B-like, GPT-2-like, LLaMA-like) and the variants perf/ compares.

Every coupled variant runs the same blocks (``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``, both
streams start as the input, the output is their mean) and differs only in how backward gets its
activations:

* ``coupled-stored`` (formerly ``vanilla``, still accepted: :data:`VARIANT_ALIASES`): plain
  autograd over :meth:`ReversibleBlock.forward`, every activation stored, reference halves
  (PyTorch eager, SDPA attention);
* ``checkpoint``: the same, with ``torch.utils.checkpoint`` around each block;
* ``revtriton-sequential`` / ``revtriton-pareprop``: :class:`ReversibleStack` with that backward
  schedule;
* ``revtriton-chunked``: the sequential stack with ``token_chunk`` at the preset's sequence length
  (the MLP halves a sample's worth of rows at a time, the attention a sample at a time): what
  chunking costs in time and saves in memory beside ``revtriton-sequential``. Opt-in
  (:data:`OPT_IN_VARIANTS`): the GPU suites run it with fused halves, a CPU sweep when
  ``--variants`` names it.

``prenorm-stored`` is the block people train today, for comparison: one stream,
``x = x + F(x); x = x + G(x)`` (F = norm + attention, G = norm + MLP: a standard pre-norm
transformer block), plain autograd, every activation stored. It is built from the very same
halves (same modules, same seed, same parameters and count) as the coupled stacks of that width
and depth; what differs is the wiring: one stream instead of two coupled ones.

Halves are ``reference`` (the pure-torch ops, on any device) or ``fused`` (revtriton's halves as
they dispatch: the Triton kernels on CUDA). Fused halves exist only on CUDA; on the CPU the
revtriton halves *are* the reference path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from revtriton import (LayerNormAttention, LayerNormMLP, ReversibleBlock, ReversibleStack, RMSNormAttention,
                       RMSNormSwiGLU)
from revtriton.halves.base import CouplingHalf

VARIANTS = ("coupled-stored", "checkpoint", "revtriton-sequential", "revtriton-pareprop", "prenorm-stored")
OPT_IN_VARIANTS = ("revtriton-chunked",)  # in the GPU suites (fused halves); on a CPU when --variants names them
ALL_VARIANTS = VARIANTS + OPT_IN_VARIANTS
BASELINES = ("coupled-stored", "checkpoint", "prenorm-stored")  # plain autograd, reference halves
# Old names still accepted on the command line, by build_stack and in result files.
VARIANT_ALIASES = {"vanilla": "coupled-stored"}
HALVES = ("reference", "fused")


def canonical_variant(name: str) -> str:
    """``name`` with an old alias (``vanilla``) replaced by today's variant name."""
    return VARIANT_ALIASES.get(name, name)


@dataclass(frozen=True)
class Preset:
    """The shape of one transformer family; ``unit`` is what its throughput counts."""

    name: str
    family: str  # "vit", "gpt2" or "llama"
    dim: int
    heads: int
    kv_heads: int
    tokens: int
    hidden: int
    causal: bool
    unit: str  # "images" (one sample = one image) or "tokens"
    activation: str | None = None  # the MLP's: None for the family's (vit gelu, gpt2 gelu_tanh, llama swiglu)

    def scaled(self, dim: int | None = None, heads: int | None = None, tokens: int | None = None) -> "Preset":
        """The same family at another width / head count / length (the CPU sweeps use small ones)."""
        dim = dim or self.dim
        heads = heads or self.heads
        if dim % heads:
            raise ValueError(f"heads ({heads}) must divide dim ({dim})")
        kv_heads = max(1, heads * self.kv_heads // self.heads)
        while heads % kv_heads:
            kv_heads -= 1
        hidden = self.hidden * dim // self.dim
        return dataclasses.replace(self, dim=dim, heads=heads, kv_heads=kv_heads, hidden=hidden,
                                   tokens=tokens or self.tokens)


PRESETS = {
    # ViT-B/16 at 224px: 196 patches + the class token, bidirectional attention.
    "vit-b": Preset("vit-b", "vit", 768, 12, 12, 197, 3072, False, "images"),
    # GPT-2 small: 1024-token causal attention, GELU-tanh MLP.
    "gpt2": Preset("gpt2", "gpt2", 768, 12, 12, 1024, 3072, True, "tokens"),
    # LLaMA-style at GPT-2 width: RMSNorm, RoPE, grouped-query attention (4 KV heads), SwiGLU.
    "llama": Preset("llama", "llama", 768, 12, 4, 1024, 2048, True, "tokens"),
}


FAMILY_ACTIVATION = {"vit": "gelu", "gpt2": "gelu_tanh", "llama": "swiglu"}


def make_halves(preset: Preset):
    """(F, G) of one block of ``preset`` as revtriton halves (fused on CUDA, reference elsewhere).

    vit / gpt2: LayerNorm + multi-head attention, LayerNorm + MLP (GELU, GELU-tanh or ReLU);
    llama: RMSNorm + RoPE grouped-query attention, RMSNorm + SwiGLU. Attention is causal when
    ``preset.causal`` is.
    """
    if preset.family not in FAMILY_ACTIVATION:
        raise ValueError(f"unknown preset family {preset.family!r}")
    activation = preset.activation or FAMILY_ACTIVATION[preset.family]
    if preset.family == "llama":
        if activation != "swiglu":
            raise ValueError(f"the llama family's MLP is SwiGLU, got activation {activation!r}")
        return (RMSNormAttention(preset.dim, preset.heads, kv_heads=preset.kv_heads, causal=preset.causal),
                RMSNormSwiGLU(preset.dim, preset.hidden))
    if preset.kv_heads != preset.heads:
        raise ValueError(f"grouped-query attention (kv_heads {preset.kv_heads} < heads {preset.heads}) is in the "
                         "llama family's halves only (RMSNorm + RoPE attention, SwiGLU)")
    return (LayerNormAttention(preset.dim, preset.heads, causal=preset.causal),
            LayerNormMLP(preset.dim, preset.hidden, activation=activation))


class ReferenceHalf(CouplingHalf):
    """A revtriton transformer half forced onto the pure-torch reference ops (SDPA attention).

    Shares the wrapped half's parameters; ``couple`` is the generic one (torch ops), so the
    engine and plain autograd see exactly the reference math on any device.
    """

    def __init__(self, half: nn.Module):
        super().__init__()
        if not isinstance(half, (LayerNormAttention, RMSNormAttention, LayerNormMLP, RMSNormSwiGLU)):
            raise TypeError(f"ReferenceHalf wraps revtriton's transformer halves, got {type(half).__name__}")
        self.inner = half

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # a transformer half's forward is its pure-torch reference

    # ReversibleStack(token_chunk=) splits it as the wrapped half's math allows (revtriton.engine.rows).
    @property
    def rows_independent(self) -> bool:
        return self.inner.rows_independent

    @property
    def samples_independent(self) -> bool:
        return self.inner.samples_independent


def make_blocks(preset: Preset, depth: int, halves: str = "reference") -> list[ReversibleBlock]:
    """``depth`` fresh blocks of ``preset`` with reference or fused (as-dispatched) halves."""
    if halves not in HALVES:
        raise ValueError(f"halves must be one of {HALVES}, got {halves!r}")
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive int, got {depth!r}")
    blocks = []
    for _ in range(depth):
        f, g = make_halves(preset)
        if halves == "reference":
            f, g = ReferenceHalf(f), ReferenceHalf(g)
        blocks.append(ReversibleBlock(f, g))
    return blocks


class StoredActivationStack(nn.Module):
    """The same coupling stack under plain autograd (optionally checkpointing each block); streams as
    ReversibleStack's: ``"duplicate"`` (both start as x, the output is their mean) or ``"split"`` (x's
    halves, the output their concatenation)."""

    def __init__(self, blocks, checkpoint_blocks: bool = False, streams: str = "duplicate", early_stop: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.checkpoint_blocks = checkpoint_blocks
        self.streams = streams
        self.early_stop = early_stop  # False: checkpoint recomputes whole blocks (torch's default stops early)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1) if self.streams == "split" else (x, x)
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x1, x2 = checkpoint(block, x1, x2, use_reentrant=False, early_stop=self.early_stop)
            else:
                x1, x2 = block(x1, x2)
        return torch.cat([x1, x2], dim=-1) if self.streams == "split" else (x1 + x2) * 0.5


class PreNormStack(nn.Module):
    """A standard pre-norm transformer: ``x = x + F(x); x = x + G(x)`` per block, plain autograd.

    Takes the coupled stacks' blocks and uses their halves as they are (F: norm + attention, G:
    norm + MLP), so the parameters, their names and (under the same seed) their values are those
    of the coupled stack of the same preset and depth; one stream of width ``dim``.
    """

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block.f(x)
            x = x + block.g(x)
        return x


def build_stack(preset: Preset, depth: int, variant: str, halves: str = "reference", exact: bool = True,
                frac_bits: int = 16) -> nn.Module:
    """A module mapping ``[batch, tokens, dim] -> [batch, tokens, dim]`` for one benchmark variant
    (or an alias of one: ``vanilla`` is ``coupled-stored``)."""
    variant = canonical_variant(variant)
    if variant not in ALL_VARIANTS:
        raise ValueError(f"variant must be one of {ALL_VARIANTS} (or an alias: {sorted(VARIANT_ALIASES)}), "
                         f"got {variant!r}")
    if halves == "fused" and variant in BASELINES:
        raise ValueError(f"the {variant} baseline runs the reference halves (PyTorch eager, SDPA)")
    blocks = make_blocks(preset, depth, halves)
    if variant == "coupled-stored":
        return StoredActivationStack(blocks)
    if variant == "prenorm-stored":
        return PreNormStack(blocks)
    if variant == "checkpoint":
        return StoredActivationStack(blocks, checkpoint_blocks=True)
    if variant == "revtriton-chunked":
        return ReversibleStack(blocks, exact=exact, frac_bits=frac_bits, token_chunk=preset.tokens)
    schedule = variant.split("-", 1)[1]
    return ReversibleStack(blocks, exact=exact, frac_bits=frac_bits, schedule=schedule)


def variant_available(variant: str, halves: str, device: torch.device) -> bool:
    """Fused halves only on CUDA; the baselines always run the reference halves."""
    variant = canonical_variant(variant)
    if halves == "fused":
        return device.type == "cuda" and variant not in BASELINES
    return True
