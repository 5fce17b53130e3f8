"""Hugging Face pre-norm encoders (BERT's layer parts, a LayerNorm before each branch).

RoBERTa-PreLayerNorm and XLM-RoBERTa-XL keep BERT's layer parts (``attention.self`` with query /
key / value, ``attention.output.dense``, ``intermediate.dense`` + activation, ``output.dense``, each
output adding the residual) and put a LayerNorm before each branch instead of after the residual
add: ``attention.LayerNorm`` (or ``attention.self_attn_layer_norm``) before attention,
``intermediate.LayerNorm`` (or the layer's ``LayerNorm``) before the MLP; Megatron-BERT names both
``ln`` (``attention.ln``, the layer's ``ln``), its loop reads each layer's output as
``layer_outputs[0]`` and its encoder norms the last one. Admitted by those parts, whatever the class,
and checked on a probe against each layer's own forward. Positions are absolute (added with the
embeddings); masks are bidirectional.
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..ops.attention import norm_attention_couple
from ..ops.mlp import norm_mlp_couple
from .core import (Family, LayerSpec, _HF_ACTIVATIONS, _concatenated_qkv, _Half, _host_block_mixins, _p,
                   _residual_dropout, _scores_scaled_plainly)
from .host import (_first, _convert_hosted_layers, _HostAttention, _HostDecoderModel, _pack_host_cond,
                   _require_hosted_layer_loop)
from .probe import _loop_source_matches, _probe_layers, _require_layer_loop


def _attention_norm(layer):
    """The LayerNorm before a BERT-style layer's attention branch, or None (BERT itself: post-norm)."""
    attention = layer.attention
    for name in ("LayerNorm", "self_attn_layer_norm", "ln"):
        norm = getattr(attention, name, None)
        if isinstance(norm, nn.LayerNorm):
            return norm
    return None


def _mlp_norm(layer) -> tuple:
    """(the LayerNorm before a BERT-style layer's MLP branch or None, whether ``intermediate`` applies it)."""
    inner = getattr(layer.intermediate, "LayerNorm", None)
    if isinstance(inner, nn.LayerNorm):
        return inner, True
    for name in ("LayerNorm", "ln"):  # (Megatron-BERT's: ln)
        outer = getattr(layer, name, None)
        if isinstance(outer, nn.LayerNorm):
            return outer, False
    return None, False


class _EncoderAttentionHalf(_Half):
    takes_cond = True

    def _projections(self):
        a = self.block.attention
        return a.self.query, a.self.key, a.self.value, a.output.dense

    def _dropouts(self):
        a = self.block.attention
        return _p(getattr(a.self, "dropout", None)), _p(getattr(a.output, "dropout", None))

    def _beyond_fused(self, x):
        return not self._spec().fused_attention

    couple_op = norm_attention_couple

    def operands(self, x, layout=None):
        a, norm = self.block.attention, _attention_norm(self.block)
        s = a.self
        w_qkv, b_qkv = _concatenated_qkv(s.query, s.key, s.value)
        segments = None if layout is None else layout[1]  # absolute positions entered with the embeddings
        return ((norm.weight, norm.bias, w_qkv, b_qkv, a.output.dense.weight, a.output.dense.bias),
                dict(heads=s.num_attention_heads, causal=False, norm="layer", eps=norm.eps, segments=segments))

    def _branch(self, x, mask=None, extra=None):
        """The layer's own modules: dropout(dense(self-attention(norm(x), mask))), without the residual."""
        a, norm = self.block.attention, _attention_norm(self.block)
        x = self._input(x, norm.weight)
        h = _first(a.self(norm(x), attention_mask=mask, **(extra or {})))
        return _residual_dropout(a.output, "dropout")(a.output.dense(h))

    def _modules(self, x):  # a half called alone: every row one sequence, no mask
        return self._branch(x)


class _EncoderMlpHalf(_Half):
    rows_independent = True  # each token's MLP output from its own row (ReversibleStack token_chunk)

    def _projections(self):
        return self.block.intermediate.dense, self.block.output.dense

    def _dropouts(self):
        return (_p(getattr(self.block.output, "dropout", None)),)

    def _beyond_fused(self, x):
        return not self._spec().fused_mlp

    couple_op = norm_mlp_couple

    def operands(self, x, layout=None):
        b, (norm, _) = self.block, _mlp_norm(self.block)
        return ((norm.weight, norm.bias, b.intermediate.dense.weight, b.intermediate.dense.bias,
                 b.output.dense.weight, b.output.dense.bias),
                dict(norm="layer", activation=self._spec().activation, eps=norm.eps))

    def _modules(self, x):
        b, (norm, inside) = self.block, _mlp_norm(self.block)
        x = self._input(x, norm.weight)
        h = b.intermediate(x if inside else norm(x))  # RoBERTa-PreLayerNorm's intermediate norms itself
        return _residual_dropout(b.output, "dropout")(b.output.dense(h))


def bert_style_layer(model: nn.Module) -> tuple | None:
    """``(base model, its first layer)`` of a Hugging Face encoder whose layers (``encoder.layer``)
    have BERT's parts (``attention.self``, ``attention.output``, ``intermediate``, ``output``), or None."""
    base = getattr(model, "base_model", model)
    if not type(base).__module__.startswith("transformers"):
        return None
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return None
    layer = layers[0]
    attention = getattr(layer, "attention", None)
    parts = (getattr(attention, "self", None), getattr(attention, "output", None),
             getattr(layer, "intermediate", None), getattr(layer, "output", None))
    return None if any(part is None for part in parts) else (base, layer)


def _prenorm_encoder_base(model: nn.Module):
    """The base model of a Hugging Face encoder whose layers have BERT's parts with a LayerNorm before
    each branch (see the section's comment), whatever its class, or None."""
    found = bert_style_layer(model)
    if found is None or _attention_norm(found[1]) is None or _mlp_norm(found[1])[0] is None:
        return None
    return found[0]


def _convert_prenorm_encoder(model, conversion, base):
    """A pre-norm BERT-style encoder (``base``: its base model, as :func:`_prenorm_encoder_base` found
    it): each layer is probed against its own forward (NotImplementedError, model unchanged, where it
    differs); the fused kernels run the branches they compute (LayerNorm, q/k/v with head_dim ** -0.5
    scores, a GELU / ReLU MLP), the layer's own modules the rest."""
    config, name = base.config, type(model).__name__
    _require_hosted_layer_loop(name)
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise NotImplementedError(f"revify: {name} as a decoder (is_decoder=True: causal self-attention with a KV "
                                  f"cache, or cross-attention) is not supported; the encoder is")
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise NotImplementedError(f"revify: {name} with position_embedding_type={position_type!r} is not supported "
                                  f"(absolute positions, added with the embeddings, are; ESM's rotary or BERT's "
                                  f"relative keys are computed inside attention)")
    encoder = base.encoder
    _require_layer_loop(encoder, r"\bin (enumerate\()?self\.layer\b", "loop over self.layer")
    # Megatron-BERT's loop reads each layer's output as layer_outputs[0]: the stand-ins return a tuple
    tuples = _loop_source_matches(encoder, r"(\w+) = layer_module\((?:.|\n)*?hidden_states = \1\[0\]")
    layers = encoder.layer
    s = layers[0].attention.self
    heads, head_dim = s.num_attention_heads, s.attention_head_size
    biases = [p.bias is not None for p in (s.query, s.key, s.value)]
    activation = _HF_ACTIVATIONS.get(getattr(config, "hidden_act", None))
    spec = LayerSpec(activation=activation, fused_mlp=activation is not None,
                     fused_attention=(heads * head_dim == config.hidden_size and len(set(biases)) == 1
                                      and _scores_scaled_plainly(s, head_dim)))
    for block in layers:
        block._revtriton_spec = replace(spec)
    no_mask = (lambda x, block: ({}, _pack_host_cond(None, None, None, (None, None), True, x)))
    _probe_layers(base, name, layers, (_HostEncoderAttentionHalf, _EncoderMlpHalf), no_mask,
                  "a pre-norm encoder layer x + attention(norm(x)), then + mlp(norm(h))")
    # Megatron-BERT's forward makes a mask of ones where none is given: packed rows see each other there,
    # so restarting position_ids are positions only, as in the library
    packs = not _loop_source_matches(base, r"attention_mask = torch\.ones\(")
    _convert_hosted_layers(model, base, "encoder.layer", conversion, (_HostEncoderBlock, _HostEncoderOrdinaryBlock),
                           _HostEncoderModel if packs else _HostUnpackedEncoderModel, layer_tuples=tuples)


class _HostEncoderAttentionHalf(_HostAttention, _EncoderAttentionHalf):
    _splits_samples = True  # ReversibleStack token_chunk: a few samples at a time (engine.rows)
    def _attention_module(self):
        return self.block.attention.self

    def _standalone(self, cond) -> bool:  # alone, the layer's own modules compute it (no mask, no RoPE)
        return cond is None

    def _library_call(self, x, host, extra):
        return self._branch(x, host.mask_for(self.block), dict(extra, position_ids=self._position_ids(host)))


_HostEncoderBlock, _HostEncoderOrdinaryBlock = _host_block_mixins((_HostEncoderAttentionHalf, _EncoderMlpHalf),
                                                                  "RevifiedHostEncoder")


class _HostEncoderModel(_HostDecoderModel):
    """A pre-norm BERT-style encoder (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL): its layers are
    ``encoder.layer``, absolute positions enter with the embeddings, no KV cache."""

    _class_prefix = "RevifiedHostEncoder"
    _layers, _rope, _caches = "encoder.layer", False, False


class _HostUnpackedEncoderModel(_HostEncoderModel):
    """:class:`_HostEncoderModel` of a library forward that lets packed rows see each other (Megatron-BERT's):
    restarting position_ids without a mask are positions only."""

    _class_prefix = "RevifiedHostUnpackedEncoder"
    _packs_rows = False


FAMILY = Family(
    "prenorm_encoder", ("pre-norm encoders with BERT's layer parts (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL, "
                        "Megatron-BERT: any head)",),
    _convert_prenorm_encoder, detect=_prenorm_encoder_base,
    conventions={("HostEncoder", None, "Layer"): _HostEncoderBlock,
                 ("HostEncoder", "Ordinary", "Layer"): _HostEncoderOrdinaryBlock,
                 ("HostEncoder", None, "Model"): _HostEncoderModel,
                 ("HostUnpackedEncoder", None, "Model"): _HostUnpackedEncoderModel})
