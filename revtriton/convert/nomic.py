"""Hugging Face NomicBERT and GTE (``NomicBertModel``, ``GteModel`` and their heads): post-norm encoder
layers with rotary positions, ``h = post_attention_layernorm(x + dropout(self_attn(x)))`` then
``post_mlp_layernorm(h + dropout(mlp(h)))``, under the preserving couplings whose one half is the
whole pretrained layer (``meft1`` / ``meft2``, as BERT's: convert.postnorm); the layer runs its own
forward with the model's mask and rotary embedding (carried by the conditioning to the rebuild)."""
from __future__ import annotations

from .core import Family, _pickled_host_classes
from .host import _convert_hosted_layers, _HostDecoderModel
from .postnorm import _PostNormBlock, _PostNormOrdinaryBlock, prepare_whole_layers
from .probe import _check_layer_slice, _require_layer_loop

_LAYER_PARTS = {"self_attn", "post_attention_dropout", "post_attention_layernorm", "mlp", "post_mlp_dropout",
                "post_mlp_layernorm"}


class _HostRotaryEncoderModel(_HostDecoderModel):
    """NomicBertModel, GteModel: its layers are ``layers``, position ids drive its RoPE, no cache."""

    _caches = False


def _convert_rotary_postnorm(model, conversion, found=None):
    base = next((getattr(model, name) for name in ("nomic_bert", "gte") if hasattr(model, name)), model)
    # (the rotary embedding is the model's: library_rope)
    prepare_whole_layers(model, conversion, base.layers, _LAYER_PARTS, "NomicBERT's and GTE", library_rope=True)
    _require_layer_loop(base, r"hidden_states = encoder_layer\(",
                        "take each layer's output as the next hidden states (hidden_states = encoder_layer(...))")
    _check_layer_slice(base)
    _convert_hosted_layers(model, base, "layers", conversion, (_PostNormBlock, _PostNormOrdinaryBlock),
                           _HostRotaryEncoderModel)


# (module, layer, base model, heads)
_KINDS = (("nomic_bert", "NomicBertLayer", "NomicBertModel",
           ("NomicBertForMaskedLM", "NomicBertForSequenceClassification", "NomicBertForTokenClassification")),
          ("gte", "GteLayer", "GteModel", ("GteForMaskedLM", "GteForSequenceClassification",
                                           "GteForTokenClassification")))
FAMILY = Family("rotary_postnorm", ("transformers NomicBertModel / GteModel and their heads (post-norm layers with "
                                    "rotary positions) under preserve='meft1' or 'meft2'",),
                _convert_rotary_postnorm, halves="whole layer",
                classes=tuple(("transformers", name) for _, _, base, heads in _KINDS for name in (base, *heads)),
                pickled={name: entry for module, layer, base, _ in _KINDS
                         for name, entry in _pickled_host_classes(f"transformers.models.{module}.modeling_{module}",
                                                                  layer, (_PostNormBlock, _PostNormOrdinaryBlock),
                                                                  base, _HostRotaryEncoderModel).items()})
