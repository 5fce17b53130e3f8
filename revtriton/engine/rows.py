"""Halves computed by chunks of token rows (``ReversibleStack(token_chunk=N)``).

An MLP half's hidden activations are ``[tokens, hidden]`` (four times a stream for GPT-2's,
in every pass: the forward, the rebuild and its backward), and an attention half's projections
``[tokens, 3 * dim]``: the largest tensors of a long sequence's step once the streams are the
only activations kept. A half says which of its rows depend on which:

* ``rows_independent = True``: output row ``r`` from input row ``r`` alone (the MLP halves of
  ``halves.transformer``; revify's LLaMA-style, GPT-2, GPT-NeoX, HF ViT and pre-norm encoder
  MLPs). The stack runs it on at most ``token_chunk`` rows at a time, each chunk a
  ``[rows, dim]`` view of the streams.
* ``samples_independent = True``: sample ``b`` (index ``b`` of the leading dim) from sample ``b``
  alone (the attention halves: tokens see each other, samples do not). The stack runs it on as
  many whole samples as fit in ``token_chunk`` rows (at least one), each chunk a
  ``[samples, ...]`` view; a half that takes the stack's conditioning gets its samples' part of
  it from ``cond_samples(cond, start, stop, samples)`` (``samples``: the batch's), which returns
  None where it cannot split it (no such method, or None: the half runs whole).
* ``head_parts(wanted, like, cond) -> parts``: a samples-independent half that is also a sum of
  parts (the attention halves: one part per head group, ``ops.attention.head_group``) says into how
  many it splits when a sample alone is ``wanted`` times ``token_chunk`` rows (1: it cannot, at most
  ``wanted``; ``like``: a tensor of its input's shape, the stream's dtype), and ``part_output(part,
  parts, x[, cond])`` computes one (plain autograd). The stack sums the parts' outputs (in float32 at
  least) and couples the sum once, the rebuild running each part's gradients before the next part
  is computed: one head group's projections and attention alive at a time. The sum's order is not
  the whole half's GEMM's: float streams agree to rounding, and exact streams round the same sum in
  the forward and its rebuild (the same grid points as the half computed whole but where the two
  sums straddle a rounding boundary).

The FLOPs are the same; the sequential schedule's backward rebuilds each chunk and runs its
gradients before the next (``engine.segment``), so no more than one chunk's graph is alive.

Every pass that computes a half (forward, inverse, rebuild) splits its rows at the same places,
so an exact stack's rebuild still adds back, chunk for chunk, the very values its forward added.
A half that draws random numbers draws them chunk by chunk in the same order in the forward and
its replay. Not chunked: a scaled coupling's half (its dropped low bits are the whole stream's),
a conditioned half without ``cond_samples``, a token-wise half whose draw is per sample
(drop-path), an FSDP2 layer's halves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..halves.base import couple_half, half_part_output, takes_cond
from ..ops.streams import couple_output
from .fsdp import _is_fsdp_module


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, dim]`` (a view of a contiguous stream)."""
    return t.reshape(-1, t.shape[-1])


@dataclass(frozen=True)
class RowChunks:
    """Where a half's rows are split: ``bounds``, ``(start, stop)`` row ranges of the flattened
    ``[rows, dim]`` streams; ``sample_shape``: for chunks of whole samples, a sample's shape (a
    chunk is then handed over as ``[samples, *sample_shape]``), else None (``[rows, dim]``);
    ``samples``: the batch's samples (for ``cond_samples``); ``parts``: the half computed as that many
    summed parts (``part_output``), 1: whole."""

    bounds: list
    sample_shape: tuple | None = None
    samples: int = 0
    parts: int = 1

    def view(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of ``t`` (a stream, or a gradient in its shape) as the half takes them."""
        rows = rows_of(t)[start:stop]
        return rows if self.sample_shape is None else rows.view(-1, *self.sample_shape)

    def cond(self, half, cond, start: int, stop: int):
        """The conditioning for rows ``start:stop``: its samples' rows for a chunk of samples."""
        if cond is None or self.sample_shape is None or not takes_cond(half):
            return cond
        per_sample = math.prod(self.sample_shape[:-1])  # a sample's rows
        if start == 0 and stop == per_sample * self.samples:  # every sample (a half in parts, not by samples)
            return cond
        return half.cond_samples(cond, start // per_sample, stop // per_sample, self.samples)

    def couple(self, half, res, x, sign: int, frac_bits, cond=None):
        """A chunk's ``couple_half``: for a half in parts, their outputs summed and coupled once."""
        if self.parts == 1:
            return couple_half(half, res, x, sign, frac_bits, cond)
        total = None
        for part in range(self.parts):  # (in the same order in every pass: their random draws)
            h = half_part_output(half, part, self.parts, x, cond)
            total = add_part(total, h)
        return couple_output(res, total, sign, frac_bits)


def add_part(total, h: torch.Tensor) -> torch.Tensor:
    """``total + h``, a half's parts summed (in float32 at least; in place where no graph is kept)."""
    if total is None:
        return h.float() if h.dtype in (torch.float16, torch.bfloat16) else h
    if total.requires_grad or h.requires_grad:
        return total + h
    return total.add_(h)


def head_parts(half, wanted: int, like: torch.Tensor, cond=None) -> int:
    """Into how many summed parts ``half`` splits a sample ``wanted`` chunks long (see the module doc)."""
    split = getattr(half, "head_parts", None)
    if wanted <= 1 or not callable(split):
        return 1
    parts = split(wanted, like, cond)
    if not isinstance(parts, int) or not 1 <= parts <= wanted:
        raise ValueError(f"{type(half).__name__}.head_parts({wanted}) must be an int in 1..{wanted}, got {parts!r}")
    return parts


def layer_rows(layer, rows: int | None) -> int | None:
    """The rows a chunk for ``layer``'s halves: none for an FSDP2 layer (its rebuild's backward runs
    outside the phase, after its post-backward token: engine.segment)."""
    return None if rows is None or _is_fsdp_module(layer) else rows


def row_chunks(half, stream: torch.Tensor, rows: int | None, cond=None, scale=None) -> RowChunks | None:
    """Where ``half`` splits a stream like ``stream`` (see the module doc), or None to run it whole:
    no ``rows`` set, a half that declares neither independence, a scaled coupling, a conditioned
    half given conditioning it cannot split, or a single chunk."""
    if rows is None or scale is not None or not stream.dim() or not stream.shape[-1]:
        return None
    total = stream.numel() // stream.shape[-1]
    if getattr(half, "rows_independent", False):
        if (cond is not None and takes_cond(half)) or total <= rows:
            return None
        return RowChunks([(start, min(start + rows, total)) for start in range(0, total, rows)])
    if getattr(half, "samples_independent", False) and stream.dim() >= 2:
        samples = stream.shape[0]
        per_sample = total // samples if samples else 0
        step = max(1, rows // per_sample) if per_sample else samples
        parts = head_parts(half, -(-per_sample // rows), stream, cond) if per_sample > rows else 1
        if step >= samples:
            if parts == 1:
                return None
            step = samples  # one chunk, the half in parts
        elif cond is not None and takes_cond(half):
            split = getattr(half, "cond_samples", None)
            if not callable(split) or split(cond, 0, step, samples) is None:  # (a view of the first chunk's)
                return None
        bounds = [(b * per_sample, min(b + step, samples) * per_sample) for b in range(0, samples, step)]
        return RowChunks(bounds, tuple(stream.shape[1:]), samples, parts)
    return None


def couple_by_rows(half, res: torch.Tensor, x: torch.Tensor, sign: int, frac_bits, cond=None, scale=None,
                   rows: int | None = None):
    """``couple_half(half, res, x, ...)`` chunk by chunk where :func:`row_chunks` says so: ``(stream,
    port)``, the stream in ``res``'s shape. For the passes that keep no graph (forward, inverse):
    the port returned is the first chunk's that has one (the forward's captured-tensor check asks
    only whether there is one); the engine's rebuild keeps every chunk's itself."""
    chunks = row_chunks(half, res, rows, cond, scale)
    if chunks is None:
        return couple_half(half, res, x, sign, frac_bits, cond, scale)
    out = torch.empty(res.shape, dtype=res.dtype, device=res.device)
    out_rows = rows_of(out)
    port = None
    for start, stop in chunks.bounds:
        stream, chunk_port = chunks.couple(half, chunks.view(res, start, stop), chunks.view(x, start, stop), sign,
                                           frac_bits, chunks.cond(half, cond, start, stop))
        out_rows[start:stop] = rows_of(stream.detach())
        if port is None:
            port = chunk_port
    return out, port
