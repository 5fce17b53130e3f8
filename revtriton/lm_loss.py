"""Revified Hugging Face causal LMs train through the chunked linear + cross-entropy (issue 36).

With reversible blocks the language-model head's logits are a training step's memory peak (about
four ``tokens x vocab`` float32 buffers). :func:`prepare_causal_lm` (``revify`` calls it) gives a
causal LM a ``forward`` that, in training with ``labels``, runs the library's forward without its
loss, takes the head's input (the final hidden states) instead of its logits, and computes the loss
with :func:`revtriton.ops.linear_cross_entropy.linear_cross_entropy`: Hugging Face's
``ForCausalLMLoss`` (labels shifted, or ``shift_labels``; ``ignore_index``; ``num_items_in_batch``
for gradient accumulation; Gemma's ``final_logit_softcapping``) without materialised logits. GIT's
captioner scores its text after the image's tokens, as its own loss does.

Then ``output.logits`` is None (Liger-Kernel's convention); ``return_logits=True`` in the call, or
``model.revtriton_fused_loss = False``, gives the library's own path (logits and its loss). Evaluation
(``model.eval()``), ``generate`` and calls without labels are the library's forward unchanged.

Fused only where it computes exactly the library's loss: a head that is an ``nn.Linear`` (a PEFT
wrapper on the head, a quantized head, a head that is an FSDP unit of its own, as accelerate's
``transformer_based_wrap`` makes it, or a model whose loss is not ``ForCausalLM``'s, keeps the
library's path),
and logits used as the head made them or softcapped (the first fused call reads what the library
does to them from a probe; a model that scales them, as Cohere and Granite do, keeps the library's
path, with a warning).
"""
from __future__ import annotations

import inspect
import math
import warnings

import torch
from torch import nn

from .ops.linear_cross_entropy import linear_cross_entropy

_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def fusable_head(model: nn.Module) -> nn.Linear | None:
    """The head of a Hugging Face causal LM whose loss the fused path computes, or None."""
    if not _is_causal_lm(model):
        return None
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM") or "_loss_function" in vars(model):
        return None  # another loss than ForCausalLMLoss (or the user's own)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if _plain_linear(head) else None


def _plain_linear(head) -> bool:
    """An ``nn.Linear`` computing ``F.linear`` on its own weight: not a subclass with its own forward
    (bitsandbytes' quantized layers), not a PEFT wrapper, and not an FSDP unit of its own (its weight
    is sharded outside its forward and its gradient reduced by hooks the fused loss would bypass)."""
    return (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
            and not any(cls.__name__ == "FSDPModule" for cls in type(head).__mro__))


# What the head's stand-in returns in place of the logits: one column of this value a token. What
# the library's forward returns for it tells what it does to logits after the head (see _after_head).
PROBE = 3.0


class _HiddenStates:
    """Stands in for the head's forward: keeps its input and returns a [..., 1] probe (no logits)."""

    def __init__(self):
        self.hidden = None

    def __call__(self, hidden):
        self.hidden = hidden
        return hidden.new_full(hidden.shape[:-1] + (1,), PROBE)


def _after_head(logits, config) -> str:
    """What the library's forward does to the head's output: "nothing", "softcap" (Gemma 2's
    ``final_logit_softcapping``) or "other" (Cohere's ``logit_scale``, Granite's ``logits_scaling``,
    ...: the fused loss does not reproduce it). Read from the probe once per model (one host sync)."""
    if not isinstance(logits, torch.Tensor) or logits.numel() == 0:
        return "other"
    value = logits.reshape(-1)[0].float().item()
    if value == PROBE:
        return "nothing"
    cap = getattr(config, "final_logit_softcapping", None)
    if cap and abs(value - cap * math.tanh(PROBE / cap)) <= 1e-2 * abs(value):
        return "softcap"
    return "other"


def _text_positions(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The head's input at the positions the library's loss scores: all of them, but GIT's image tokens
    (its projected patches come first in the sequence, and GitForCausalLM's loss scores the text after
    them: ``logits[:, image_patch_tokens:]``)."""
    if not any(cls.__name__ == "GitForCausalLM" for cls in type(model).__mro__):
        return hidden
    return hidden[:, model.git.encoder.layer[0].attention.self.image_patch_tokens:]


class FusedLossForward:
    """A causal LM's ``forward`` (an instance attribute: ``model(...)`` and PEFT's ``model.forward(...)``
    both reach it) computing the training loss through the chunked linear + cross-entropy."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.after_head = None  # _after_head's answer, from the first fused call

    @property
    def __signature__(self):  # the library's (Trainer reads it: loss kwargs accepted or not)
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def fuses(self, kwargs) -> bool:
        model = self.model
        return (model.training and kwargs.get("labels") is not None and getattr(model, "revtriton_fused_loss", True)
                and kwargs.get("return_dict", getattr(model.config, "return_dict", True)) is not False
                and fusable_head(model) is not None)

    def __call__(self, *args, return_logits: bool = False, **kwargs):
        model = self.model
        library_forward = type(model).forward
        if return_logits or not self.fuses(kwargs):
            return library_forward(model, *args, **kwargs)
        labels = kwargs.pop("labels")
        if kwargs.get("use_cache") is None and "use_cache" in inspect.signature(library_forward).parameters:
            kwargs["use_cache"] = False  # (as the library's forward with labels: no cache made while training)
        head = fusable_head(model)
        capture = _HiddenStates()
        head.forward = capture  # an instance attribute: nn.Module.__call__ runs it (hooks included)
        try:
            output = library_forward(model, *args, **kwargs)
        finally:
            del head.forward
        if self.after_head is None:
            self.after_head = _after_head(output.get("logits"), model.config)
            if self.after_head == "other":
                warnings.warn(f"revtriton: {type(model).__name__} transforms its logits after the head in a way the "
                              f"fused loss does not reproduce: it keeps the library's loss (with logits)")
        if self.after_head == "other":  # this call again, the library's way (only the first time costs two)
            return library_forward(model, *args, labels=labels, **kwargs)
        hidden = _text_positions(model, capture.hidden)
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None:  # ForCausalLMLoss: tokens < n predict n, the last one nothing
            shift_labels = labels.new_full(labels.shape, -100)
            shift_labels[..., :-1] = labels[..., 1:]
        if hidden.shape[:-1] != shift_labels.shape:
            raise ValueError(f"the head's input {tuple(hidden.shape)} does not match the labels "
                             f"{tuple(shift_labels.shape)} (logits_to_keep with labels is not supported)")
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                    shift_labels.reshape(-1).to(hidden.device), head.bias,
                                    ignore_index=kwargs.get("ignore_index", -100),
                                    num_items_in_batch=kwargs.get("num_items_in_batch"),
                                    softcap=model.config.final_logit_softcapping if self.after_head == "softcap"
                                    else None)
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        return type(output)(loss=loss, **fields)


def _is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face causal LM (revify swaps its class for a subclass: the library's class is a base)."""
    return any(cls.__module__.startswith("transformers.") and cls.__name__.endswith(_CAUSAL_LM_SUFFIXES)
               for cls in type(model).__mro__)


def prepare_causal_lm(model: nn.Module, fused_loss: bool) -> bool:
    """After revify: name a causal LM's loss where its class name does not (GPT-2's ``LMHeadModel``:
    the library falls back to ``ForCausalLM`` with a warning on every loss) and, with ``fused_loss``,
    give it the fused training loss. True where the fused loss is installed. Idempotent."""
    if _is_causal_lm(model) and getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    if not fused_loss or fusable_head(model) is None:
        return False
    if not isinstance(model.__dict__.get("forward"), FusedLossForward):
        model.forward = FusedLossForward(model)
    return True
