"""Hugging Face T5Gemma: both stacks (``T5GemmaEncoder``, ``T5GemmaDecoder``, found as parts of
``T5GemmaForConditionalGeneration``, ``T5GemmaModel``, ``T5GemmaEncoderModel`` and the classifiers).
Gemma 2's sandwich layers: ``x + dropout(post_self_attn_layernorm(self_attn(pre_self_attn_layernorm(x))))``,
in the decoder then the same around its cross-attention (``pre_cross_attn_layernorm``, ``cross_attn``,
``post_cross_attn_layernorm``), then ``+ dropout(post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))))``.
F is the attention branch (the decoder's self- then cross-attention on the sum), G the feed-forward; both
run the layer's own modules through the library's forward (its masks by attention kind, full or sliding
window, its rotary embedding, its cache while decoding: the self-attention the cache's self-attention
part, the cross-attention the whole, as the layer hands them).

T5Gemma 2's text encoder (``T5Gemma2TextEncoder``: T5Gemma's encoder layers; its SigLIP vision tower
converts by the clip family) and its decoder (``T5Gemma2Decoder``), whose layers have no cross-attention
of their own: their self-attention is merged with it (``T5Gemma2MergedAttention``: the queries attend
to the decoder's and the encoder's keys at once, under the loop's ``merged_attention_mask``, the causal
mask and the encoder's side by side). Its F is that merged attention branch, given the encoder's states
(the conditioning carries them, so their gradient reaches the encoder)."""
from __future__ import annotations

from dataclasses import replace

from .core import Family, LayerSpec, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _first, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .llama import _sliding_windows
from .probe import require_layer_parts

_ENCODER_PARTS = {"self_attn", "pre_self_attn_layernorm", "post_self_attn_layernorm", "mlp",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm", "dropout"}
_DECODER_PARTS = _ENCODER_PARTS | {"cross_attn", "pre_cross_attn_layernorm", "post_cross_attn_layernorm"}


class _T5GemmaAttentionHalf(_LibraryAttentionHalf):
    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.pre_self_attn_layernorm.weight)
        cache = extra.get("cache")
        own = extra if cache is None else {**extra, "cache": cache.self_attention_cache}  # (as the layer hands it)
        rotary = host.rotary_for(b)
        out = b.self_attn(hidden_states=b.pre_self_attn_layernorm(x), position_embeddings=rotary,
                          attention_mask=host.mask_for(b), position_ids=self._position_ids(host), **own)
        attended = b.dropout(b.post_self_attn_layernorm(_first(out)))
        states = host.layer_tensors.get("encoder_hidden_states")
        if states is None:  # an encoder's layer
            return attended
        out = b.cross_attn(hidden_states=b.pre_cross_attn_layernorm(x + attended), encoder_hidden_states=states,
                           attention_mask=host.layer_tensors.get("encoder_attention_mask"), **extra)
        return attended + b.dropout(b.post_cross_attn_layernorm(_first(out)))


class _T5GemmaMlpHalf(_LibraryHalf):
    def _modules(self, x):
        b = self.block
        x = self._input(x, b.pre_feedforward_layernorm.weight)
        return b.dropout(b.post_feedforward_layernorm(b.mlp(b.pre_feedforward_layernorm(x))))


_HostT5GemmaBlock, _HostT5GemmaOrdinaryBlock = _host_block_mixins((_T5GemmaAttentionHalf, _T5GemmaMlpHalf))


class _T5Gemma2MergedAttentionHalf(_LibraryAttentionHalf):
    """F of a T5Gemma 2 decoder layer: its merged self- and cross-attention on the encoder's states, under
    the merged mask of the layer's attention kind; while decoding, the model's cache (both parts: the
    module updates the self-attention's and fills the cross-attention's once)."""

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.pre_self_attn_layernorm.weight)
        out = b.self_attn(hidden_states=b.pre_self_attn_layernorm(x), position_embeddings=host.rotary_for(b),
                          merged_attention_mask=host.mask_for(b),  # (the model refuses a call without the states)
                          encoder_hidden_states=host.layer_tensors["encoder_hidden_states"],
                          position_ids=self._position_ids(host), **extra)
        return b.dropout(b.post_self_attn_layernorm(_first(out)))


class _T5Gemma2Loop:
    """T5Gemma 2's decoder loop hands each layer its mask as ``merged_attention_mask``: the conditioning
    carries it as the layer's attention mask (one per attention kind, as every host model's)."""

    def _loop_inputs(self, hidden, kwargs: dict) -> dict:
        if "merged_attention_mask" not in kwargs:
            return kwargs
        kwargs = dict(kwargs)
        kwargs["attention_mask"] = kwargs.pop("merged_attention_mask")
        return kwargs


_HostT5Gemma2DecoderBlock, _HostT5Gemma2DecoderOrdinaryBlock = (
    type(f"_HostT5Gemma2Decoder{m.__name__[5:]}", (_T5Gemma2Loop, m), {})
    for m in _host_block_mixins((_T5Gemma2MergedAttentionHalf, _T5GemmaMlpHalf), "RevifiedHostMerged"))


class _HostT5GemmaEncoder(_HostDecoderModel):
    """T5GemmaEncoder: RoPE from position ids, bidirectional masks by attention kind, no cache."""

    _caches = False


class _HostT5GemmaDecoder(_HostDecoderModel):
    """T5GemmaDecoder: its layers attend to the encoder's states; a cache while decoding."""

    _cross_attention = True


# The stacks revify takes, by class name: (layer parts, block mixins, host model mixin)
_STACKS = {"T5GemmaEncoder": (_ENCODER_PARTS, (_HostT5GemmaBlock, _HostT5GemmaOrdinaryBlock), _HostT5GemmaEncoder),
           "T5GemmaDecoder": (_DECODER_PARTS, (_HostT5GemmaBlock, _HostT5GemmaOrdinaryBlock), _HostT5GemmaDecoder),
           "T5Gemma2TextEncoder": (_ENCODER_PARTS, (_HostT5GemmaBlock, _HostT5GemmaOrdinaryBlock),
                                   _HostT5GemmaEncoder),
           "T5Gemma2Decoder": (_ENCODER_PARTS, (_HostT5Gemma2DecoderBlock, _HostT5Gemma2DecoderOrdinaryBlock),
                               _HostT5GemmaDecoder)}


def _convert_t5gemma(model, conversion, found=None):
    name, layers = type(model).__name__, model.layers
    if not len(layers):
        raise ValueError(f"revify: {name} has no layers")
    _require_hosted_layer_loop(name)
    kind = next(cls.__name__ for cls in type(model).__mro__ if cls.__name__ in _STACKS)  # (a user's subclass too)
    parts, blocks, host = _STACKS[kind]
    require_layer_parts(layers, parts, name)
    spec = LayerSpec(fused_attention=False, fused_mlp=False)
    for block, window in zip(layers, _sliding_windows(model.config, len(layers))):
        block._revtriton_spec = replace(spec, window=window)
    _convert_hosted_layers(model, model, "layers", conversion, blocks, host)


_MODULE = "transformers.models.t5gemma.modeling_t5gemma"
_MODULE_2 = "transformers.models.t5gemma2.modeling_t5gemma2"
FAMILY = Family("t5gemma", ("transformers T5Gemma: both stacks (T5GemmaEncoder, T5GemmaDecoder with its "
                            "cross-attention) of T5GemmaForConditionalGeneration, T5GemmaModel, T5GemmaEncoderModel "
                            "and the classifiers: Gemma 2's sandwich layers, sliding-window and full attention",
                            "transformers T5Gemma 2: its text encoder (T5Gemma2TextEncoder) and its decoder "
                            "(T5Gemma2Decoder, self- and cross-attention merged) of T5Gemma2ForConditionalGeneration, "
                            "T5Gemma2Model and the classifiers"),
                _convert_t5gemma, halves="library", classes=tuple(("transformers", name) for name in _STACKS),
                pickled={**_pickled_host_classes(_MODULE, "T5GemmaEncoderLayer", (_HostT5GemmaBlock,
                                                                                  _HostT5GemmaOrdinaryBlock),
                                                 "T5GemmaEncoder", _HostT5GemmaEncoder),
                         **_pickled_host_classes(_MODULE, "T5GemmaDecoderLayer", (_HostT5GemmaBlock,
                                                                                  _HostT5GemmaOrdinaryBlock),
                                                 "T5GemmaDecoder", _HostT5GemmaDecoder),
                         **_pickled_host_classes(_MODULE_2, "T5Gemma2EncoderLayer", (_HostT5GemmaBlock,
                                                                                     _HostT5GemmaOrdinaryBlock),
                                                 "T5Gemma2TextEncoder", _HostT5GemmaEncoder),
                         **_pickled_host_classes(_MODULE_2, "T5Gemma2DecoderLayer",
                                                 (_HostT5Gemma2DecoderBlock, _HostT5Gemma2DecoderOrdinaryBlock),
                                                 "T5Gemma2Decoder", _HostT5GemmaDecoder)})
