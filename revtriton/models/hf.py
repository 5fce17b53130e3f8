"""The RevGPT presets as Hugging Face models: ``generate`` with a KV cache, ``save_pretrained`` /
:func:`revtriton.from_pretrained`, Trainer and PEFT, as users of those libraries work.

:func:`rev_causal_lm` builds the library's model of the preset's architecture (``GPT2LMHeadModel``
for the gpt2 style, ``LlamaForCausalLM`` for the llama style) with the preset's sizes and revifies
it: the same layers, parameter count and couplings as :class:`~revtriton.models.RevGPT`
(F = norm + causal attention, G = norm + MLP), in a ``PreTrainedModel``. Needs ``transformers``
(imported only when called).
"""
from __future__ import annotations

import dataclasses

from torch import nn

from ..convert import revify
from .gpt import GPT_PRESETS, GPTConfig


def hf_config(config: GPTConfig):
    """The Hugging Face config of a RevGPT config: ``GPT2Config`` (gpt2 style) or ``LlamaConfig``."""
    import transformers

    c = config.resolved()
    if c.drop_path_rate:
        raise ValueError("drop_path_rate has no Hugging Face equivalent (GPT-2 and LLaMA have no stochastic depth); "
                         "use RevGPT for it")
    if c.style == "gpt2":
        # RevGPT has dropout only after the embeddings: no attention or residual dropout.
        return transformers.GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.dim,
                                       n_layer=c.depth, n_head=c.heads, n_inner=c.hidden,
                                       activation_function="gelu_new", layer_norm_epsilon=c.eps,
                                       embd_pdrop=c.dropout, attn_pdrop=0.0, resid_pdrop=0.0,
                                       tie_word_embeddings=c.tie_embeddings,
                                       # GPT-2's rule (50256 of 50257): the last id, in any vocabulary
                                       bos_token_id=c.vocab_size - 1, eos_token_id=c.vocab_size - 1)
    if c.dropout:
        raise ValueError("LlamaForCausalLM has no dropout after the embeddings; use dropout=0.0 (or RevGPT)")
    return transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.hidden,
                                    num_hidden_layers=c.depth, num_attention_heads=c.heads,
                                    num_key_value_heads=c.kv_heads, max_position_embeddings=c.block_size,
                                    rms_norm_eps=c.eps, rope_theta=c.rope_theta, hidden_act="silu",
                                    attention_bias=False, mlp_bias=False, tie_word_embeddings=c.tie_embeddings)


def rev_causal_lm(preset: str = "gpt2", *, exact: bool = True, frac_bits: int = 16, anchor_every: int | None = None,
                  schedule: str = "sequential", token_chunk: int | None = None, **overrides) -> nn.Module:
    """A RevGPT preset (``GPT_PRESETS``; ``overrides``: GPTConfig fields) as a revified Hugging Face
    causal LM, freshly initialised by the library (``config.initializer_range``).

    ``exact``, ``frac_bits``, ``anchor_every``, ``schedule``, ``token_chunk``: ReversibleStack options (as
    :func:`revtriton.revify`). Save with ``save_pretrained``; load with
    :func:`revtriton.from_pretrained` (the library's own ``from_pretrained`` gives the plain model).
    """
    import transformers

    if preset not in GPT_PRESETS:
        raise ValueError(f"unknown RevGPT preset {preset!r}; choose from {sorted(GPT_PRESETS)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"rev_causal_lm got unexpected arguments {unknown} (GPTConfig fields: {sorted(fields)})")
    config = hf_config(dataclasses.replace(GPT_PRESETS[preset], **overrides))
    model_class = transformers.GPT2LMHeadModel if config.model_type == "gpt2" else transformers.LlamaForCausalLM
    return revify(model_class(config), exact=exact, frac_bits=frac_bits, anchor_every=anchor_every,
                  schedule=schedule, token_chunk=token_chunk)
