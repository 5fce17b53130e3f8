"""Hugging Face ModernBERT (``ModernBertModel`` and its heads): a pre-norm encoder,
``h = x + attn(attn_norm(x))`` then ``h + mlp(mlp_norm(h))`` (the first layer's attn_norm is the
identity), its layers alternating global and local (sliding window) attention, each kind with a
mask and a RoPE of its own (the conditioning carries one of each per kind). Both halves run the
layer's own modules (the library path: its attention with the library's bidirectional masks and
rotary embeddings, its output dropout; the MLP's own dropout). ModernBERT's decoder
(``ModernBertDecoderModel`` and its heads) has the same layers, causal, with a KV cache while decoding."""
from __future__ import annotations

from dataclasses import replace

from .core import Family, LayerSpec, _host_block_mixins, _LibraryMlpHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .llama import _sliding_windows
from .probe import _check_layer_slice, require_layer_parts

_MODERNBERT_LAYER_PARTS = {"attn_norm", "attn", "mlp_norm", "mlp"}


class _ModernBertAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.attn

    def _attention_norm(self):
        return self.block.attn_norm  # (the first layer's: nn.Identity)


class _ModernBertMlpHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "mlp_norm", "mlp"


_HostModernBertBlock, _HostModernBertOrdinaryBlock = _host_block_mixins((_ModernBertAttentionHalf, _ModernBertMlpHalf))


class _HostModernBertModel(_HostDecoderModel):
    """ModernBertModel: its layers are ``layers``, position ids drive RoPE, no cache (an encoder)."""

    _layers = "layers"
    _caches = False


class _HostModernBertDecoderModel(_HostDecoderModel):
    """ModernBertDecoderModel: its layers are ``layers``, position ids drive RoPE, a cache while decoding,
    its last hidden state the normed output."""


def _convert_modernbert(model, conversion, found=None):
    base = model.model if hasattr(model, "model") else model
    name, layers = type(model).__name__, base.layers
    if not len(layers):
        raise ValueError(f"revify: {name} has no layers")
    _require_hosted_layer_loop(name)
    require_layer_parts(layers, _MODERNBERT_LAYER_PARTS, "ModernBERT")
    _check_layer_slice(base)
    spec = LayerSpec(fused_attention=False, fused_mlp=False, library_rope=True)
    for block, window in zip(layers, _sliding_windows(base.config, len(layers))):
        block._revtriton_spec = replace(spec, window=window)  # the attention kind: its mask and RoPE
    decoder = base.config.model_type == "modernbert-decoder"
    _convert_hosted_layers(model, base, "layers", conversion, (_HostModernBertBlock, _HostModernBertOrdinaryBlock),
                           _HostModernBertDecoderModel if decoder else _HostModernBertModel)


_CLASSES = ("ModernBertModel", "ModernBertForMaskedLM", "ModernBertForSequenceClassification",
            "ModernBertForTokenClassification", "ModernBertForQuestionAnswering", "ModernBertForMultipleChoice")
_DECODER_CLASSES = ("ModernBertDecoderModel", "ModernBertDecoderForCausalLM",
                    "ModernBertDecoderForSequenceClassification")
_BLOCKS = (_HostModernBertBlock, _HostModernBertOrdinaryBlock)
FAMILY = Family("modernbert", ("transformers ModernBertModel and its heads (global and local attention, each with "
                               "its RoPE), and ModernBERT's decoder (ModernBertDecoderModel, its causal LM and "
                               "sequence classifier)",), _convert_modernbert, halves="library",
                classes=tuple(("transformers", name) for name in (*_CLASSES, *_DECODER_CLASSES)),
                pickled={**_pickled_host_classes("transformers.models.modernbert.modeling_modernbert",
                                                 "ModernBertEncoderLayer", _BLOCKS, "ModernBertModel",
                                                 _HostModernBertModel),
                         **_pickled_host_classes("transformers.models.modernbert_decoder.modeling_modernbert_decoder",
                                                 "ModernBertDecoderLayer", _BLOCKS, "ModernBertDecoderModel",
                                                 _HostModernBertDecoderModel)})
