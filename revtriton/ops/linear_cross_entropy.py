"""Linear + cross-entropy without materialised logits (the LM head's memory peak).

``loss = CE(softcap(hidden @ weight.T + bias), labels)`` computed a chunk of tokens at a time: the
forward keeps each token's logsumexp (4 bytes a token), not its ``vocab`` logits; the backward
recomputes a chunk's logits, turns them into their gradient in place and folds it into the hidden
states' gradient and the head's weight (and bias) gradient. A chunk holds at most
``chunk_elements`` logits, so the head's transient memory is bounded whatever the token count
(the full-logits loss keeps about four ``tokens x vocab`` float32 buffers: logits, log-softmax and
two gradients).

Options match ``torch.nn.functional.cross_entropy`` and Hugging Face's ``ForCausalLMLoss``:
``ignore_index``, ``reduction`` ("mean" over the tokens not ignored, "sum"), ``num_items_in_batch``
(sum divided by it: gradient accumulation), ``label_smoothing``, ``softcap`` (Gemma's
``final_logit_softcapping``: ``softcap * tanh(logits / softcap)``) and ``z_loss``
(``z_loss * logsumexp**2`` per token, PaLM's auxiliary loss).

Precision: logits accumulate in float32 at least (float64 stays float64); under autocast the GEMMs
run in the autocast dtype, as the full-logits head would. The chunks run in a fixed order and the
weight gradient accumulates in one float32 buffer: the result is deterministic. No host sync.

:func:`linear_cross_entropy_reference` (full logits, plain autograd) is the oracle.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .arguments import checked_int

REDUCTIONS = ("mean", "sum")
# Logits of one chunk (tokens x vocab elements): 8 MiB of float32 on a CPU, 64 MiB on a GPU, where
# the GEMMs want more rows (at LLaMA-3's vocabulary of 128,256 that is 130 tokens a chunk).
CPU_CHUNK_ELEMENTS = 2**21
CUDA_CHUNK_ELEMENTS = 2**24


def _check(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, z_loss,
           num_items_in_batch, chunk_tokens):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy takes hidden [tokens, dim] and weight [vocab, dim], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1] or labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"labels must be integer [tokens] = [{hidden.shape[0]}], got {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [vocab] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    devices = {t.device for t in (hidden, weight, labels, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"hidden, weight, labels and bias must be on one device, got {sorted(map(str, devices))}")
    if not hidden.is_floating_point() or weight.dtype != hidden.dtype and not torch.is_autocast_enabled(
            hidden.device.type):
        raise TypeError(f"hidden and weight must be one floating dtype (or run under autocast), got {hidden.dtype} "
                        f"and {weight.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError("num_items_in_batch divides the summed loss (Hugging Face's convention): use it with "
                         "reduction='mean' (the default)")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if not z_loss >= 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if chunk_tokens is not None:
        checked_int("chunk_tokens", chunk_tokens, 1, note=" or None")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 at least: float64 logits stay float64."""
    return torch.promote_types(dtype, torch.float32)


def default_chunk_tokens(tokens: int, vocab: int, device: torch.device) -> int:
    """Tokens a chunk: as many as keep its logits within the device's element budget (at least 1)."""
    budget = CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CPU_CHUNK_ELEMENTS
    return max(1, min(tokens, budget // vocab))


def _scale(labels, ignore_index, reduction, num_items_in_batch, dtype):
    """The loss's divisor as a device tensor (no host sync): the tokens not ignored, n, or 1."""
    if reduction == "sum":
        return torch.ones((), dtype=dtype, device=labels.device)
    if num_items_in_batch is not None:
        return torch.as_tensor(num_items_in_batch, device=labels.device).to(dtype)
    return (labels != ignore_index).sum().to(dtype)  # all ignored: 0 / 0 = nan, as F.cross_entropy's mean


def linear_cross_entropy_reference(hidden, weight, labels, bias=None, *, ignore_index: int = -100,
                                   reduction: str = "mean", label_smoothing: float = 0.0,
                                   softcap: float | None = None, z_loss: float = 0.0, num_items_in_batch=None):
    """The full-logits loss in plain autograd: the oracle of :func:`linear_cross_entropy`."""
    _check(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, z_loss,
           num_items_in_batch, None)
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(accumulation_dtype(logits.dtype))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    per_token = F.cross_entropy(logits, labels.long(), ignore_index=ignore_index, reduction="none",
                                label_smoothing=label_smoothing)
    if z_loss:
        per_token = per_token + z_loss * torch.logsumexp(logits, -1).square() * (labels != ignore_index)
    return per_token.sum() / _scale(labels, ignore_index, reduction, num_items_in_batch, per_token.dtype)


def _chunk_logits(hidden, weight, bias, softcap, dtype):
    """A chunk's logits in ``dtype`` (softcapped), and tanh of them before the cap (for its gradient)."""
    logits = F.linear(hidden, weight, bias).to(dtype)
    if softcap is None:
        return logits, None
    tanh = logits.div_(softcap).tanh_()
    return tanh * softcap, tanh


class LinearCrossEntropy(torch.autograd.Function):
    """The chunked loss. Saves the inputs and each token's logsumexp; no logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, options):
        ignore_index, smoothing, softcap, z_loss, chunk, divisor = options
        dtype = accumulation_dtype(hidden.dtype)
        tokens, vocab = hidden.shape[0], weight.shape[0]
        lse = torch.empty(tokens, dtype=dtype, device=hidden.device)
        per_token = torch.empty(tokens, dtype=dtype, device=hidden.device)
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, 0).long()  # an ignored row gathers column 0, then is zeroed
        for start in range(0, tokens, chunk):
            rows = slice(start, start + chunk)
            logits, _ = _chunk_logits(hidden[rows], weight, bias, softcap, dtype)
            chunk_lse = torch.logsumexp(logits, -1)
            loss = chunk_lse - (1.0 - smoothing) * logits.gather(1, safe_labels[rows, None]).squeeze(1)
            if smoothing:
                loss -= smoothing / vocab * logits.sum(-1)
            if z_loss:
                loss += z_loss * chunk_lse.square()
            lse[rows] = chunk_lse
            per_token[rows] = loss
        per_token.masked_fill_(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe_labels, valid, lse, divisor)
        ctx.options = options
        return per_token.sum() / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, safe_labels, valid, lse, divisor = ctx.saved_tensors
        _, smoothing, softcap, z_loss, chunk, _ = ctx.options
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype = lse.dtype
        tokens, vocab = hidden.shape[0], weight.shape[0]
        # d loss_i / d logits_ij = c_i * (softmax_ij * (1 + 2 z lse_i) - (1 - s) [j = y_i] - s / V)
        row_scale = (grad_loss.to(dtype) / divisor) * valid
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(vocab, dtype=dtype, device=weight.device) if need_bias and bias is not None else None
        for start in range(0, tokens, chunk):
            rows = slice(start, start + chunk)
            logits, tanh = _chunk_logits(hidden[rows], weight, bias, softcap, dtype)
            scale = row_scale[rows]
            grad = logits.sub_(lse[rows, None]).exp_()  # softmax, in the logits' buffer
            grad.mul_((scale * (1.0 + 2.0 * z_loss * lse[rows]) if z_loss else scale)[:, None])
            grad.scatter_add_(1, safe_labels[rows, None], -(1.0 - smoothing) * scale[:, None])
            if smoothing:
                grad.sub_((smoothing / vocab * scale)[:, None])
            if tanh is not None:  # through softcap * tanh(x / softcap): times 1 - tanh**2
                grad.mul_(tanh.square_().neg_().add_(1.0))
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(grad, weight.to(hidden.dtype), out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(grad.t().to(dtype), hidden[rows].to(dtype))
            if grad_bias is not None:
                grad_bias += grad.sum(0, dtype=dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


def linear_cross_entropy(hidden, weight, labels, bias=None, *, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, softcap: float | None = None, z_loss: float = 0.0,
                         num_items_in_batch=None, chunk_tokens: int | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels`` without the full logits.

    ``hidden`` [tokens, dim] (flatten batch and sequence first), ``weight`` [vocab, dim], ``bias``
    [vocab] or None, ``labels`` [tokens] (``ignore_index`` skipped). Returns the scalar loss; the
    gradients reach hidden, weight and bias. ``chunk_tokens``: tokens a chunk (default: as many as
    keep a chunk's logits within 2**21 elements on a CPU, 2**24 on a GPU).
    """
    _check(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, z_loss,
           num_items_in_batch, chunk_tokens)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # the GEMMs in the autocast dtype, as F.linear would run them
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    chunk = chunk_tokens or default_chunk_tokens(hidden.shape[0], weight.shape[0], hidden.device)
    divisor = _scale(labels, ignore_index, reduction, num_items_in_batch, accumulation_dtype(hidden.dtype))
    options = (ignore_index, float(label_smoothing), None if softcap is None else float(softcap), float(z_loss),
               chunk, divisor)
    with torch.autocast(device, enabled=False):
        return LinearCrossEntropy.apply(hidden, weight, bias, labels, options)


def chunk_count(tokens: int, vocab: int, device: torch.device, chunk_tokens: int | None = None) -> int:
    """How many chunks :func:`linear_cross_entropy` runs (for tests and perf)."""
    return math.ceil(tokens / (chunk_tokens or default_chunk_tokens(tokens, vocab, device)))
