"""Halves computed by chunks of token rows (``ReversibleStack(token_chunk=N)``).

An MLP half's hidden activations are ``[tokens, hidden]`` (four times a stream for GPT-2's,
in every pass: the forward, the rebuild and its backward), the largest tensors of a long
sequence's step once the streams are the only activations kept. A half whose output row ``r``
depends on its input row ``r`` alone says so with ``rows_independent = True`` (the MLP halves:
``halves.transformer``, the converted LLaMA / GPT-2 / GPT-NeoX MLPs); the stack then runs it on
at most ``token_chunk`` rows at a time, each chunk a ``[rows, dim]`` view of the streams, so
those activations stay ``[token_chunk, hidden]``. The FLOPs are the same; the sequential
schedule's backward rebuilds each chunk and runs its gradients before the next
(``engine.segment``), so no more than one chunk's graph is alive.

Every pass that computes a half (forward, inverse, rebuild) splits its rows at the same
multiples of ``token_chunk``, so an exact stack's rebuild still adds back, chunk for chunk, the
very values its forward added. A half that draws random numbers draws them chunk by chunk in the
same order in the forward and its replay. Not chunked: a half that takes the stack's
conditioning (it may be per sample), a scaled coupling's half (its dropped low bits are the
whole stream's), and a half whose rows are not independent (attention; drop-path, whose draw is
per sample).
"""
from __future__ import annotations

import torch

from ..halves.base import couple_half, takes_cond
from .fsdp import _is_fsdp_module


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, dim]`` (a view of a contiguous stream)."""
    return t.reshape(-1, t.shape[-1])


def layer_rows(layer, rows: int | None) -> int | None:
    """The rows a chunk for ``layer``'s halves: none for an FSDP2 layer (its rebuild's backward runs
    outside the phase, after its post-backward token: engine.segment)."""
    return None if rows is None or _is_fsdp_module(layer) else rows


def row_chunks(half, stream: torch.Tensor, rows: int | None, cond=None, scale=None) -> list | None:
    """The ``(start, stop)`` row ranges ``half`` runs on for a stream like ``stream``, or None to run
    it whole: no ``rows`` set, a half that does not declare ``rows_independent``, a conditioned
    half given conditioning, a scaled coupling, or no more rows than ``rows``."""
    if rows is None or scale is not None or not getattr(half, "rows_independent", False):
        return None
    if cond is not None and takes_cond(half):
        return None
    total = stream.numel() // stream.shape[-1] if stream.dim() and stream.shape[-1] else 0
    if total <= rows:
        return None
    return [(start, min(start + rows, total)) for start in range(0, total, rows)]


def couple_by_rows(half, res: torch.Tensor, x: torch.Tensor, sign: int, frac_bits, cond=None, scale=None,
                   rows: int | None = None):
    """``couple_half(half, res, x, ...)`` chunk by chunk of rows where :func:`row_chunks` says so:
    ``(stream, port)``, the stream in ``res``'s shape. For the passes that keep no graph (forward,
    inverse): the port returned is the first chunk's that has one (the forward's captured-tensor
    check asks only whether there is one); the engine's rebuild keeps every chunk's itself."""
    chunks = row_chunks(half, res, rows, cond, scale)
    if chunks is None:
        return couple_half(half, res, x, sign, frac_bits, cond, scale)
    out = torch.empty(res.shape, dtype=res.dtype, device=res.device)
    out_rows, res_rows, x_rows = rows_of(out), rows_of(res), rows_of(x)
    port = None
    for start, stop in chunks:
        stream, chunk_port = couple_half(half, res_rows[start:stop], x_rows[start:stop], sign, frac_bits, cond)
        out_rows[start:stop] = stream.detach()
        if port is None:
            port = chunk_port
    return out, port
