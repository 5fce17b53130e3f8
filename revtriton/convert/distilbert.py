"""Hugging Face DistilBERT (``DistilBertModel`` and its heads): post-norm layers,
``h = sa_layer_norm(x + attention(x))`` then ``output_layer_norm(h + ffn(h))``, under the preserving
couplings whose one half is the whole pretrained layer (``meft1`` / ``meft2``, as BERT's:
convert.postnorm); the layer runs its own forward with the model's mask. Its layers are
``transformer.layer``, looped over by ``Transformer.forward``."""
from __future__ import annotations

from .core import Family, LayerSpec, _pickled_host_classes
from .host import _convert_hosted_layers, _HostDecoderModel, _require_hosted_layer_loop
from .postnorm import _PostNormBlock, _PostNormOrdinaryBlock, require_whole_layer_mode
from .probe import _require_layer_loop

_DISTILBERT_LAYER_PARTS = {"attention", "sa_layer_norm", "ffn", "output_layer_norm"}


class _HostDistilBertModel(_HostDecoderModel):
    """DistilBertModel: its layers are ``transformer.layer``, absolute positions enter with the
    embeddings, no KV cache."""

    _layers, _rope, _caches = "transformer.layer", False, False


def _convert_distilbert(model, conversion, found=None):
    base = getattr(model, "distilbert", model)
    name, layers = type(model).__name__, base.transformer.layer
    if not len(layers):
        raise ValueError(f"revify: {name} has no layers")
    require_whole_layer_mode(conversion, name)
    _require_hosted_layer_loop(name)
    for i, block in enumerate(layers):
        parts = {part for part, _ in block.named_children()}
        if parts != _DISTILBERT_LAYER_PARTS:
            raise NotImplementedError(f"revify: {type(block).__name__} {i} has parts {sorted(parts)}, not "
                                      f"DistilBERT's {sorted(_DISTILBERT_LAYER_PARTS)}: not supported")
    _require_layer_loop(base.transformer, r"hidden_states = layer_module\(",
                        "take each layer's output as the next hidden states (hidden_states = layer_module(...))")
    for block in layers:
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _convert_hosted_layers(model, base, "transformer.layer", conversion, (_PostNormBlock, _PostNormOrdinaryBlock),
                           _HostDistilBertModel)


_CLASSES = ("DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification",
            "DistilBertForTokenClassification", "DistilBertForQuestionAnswering", "DistilBertForMultipleChoice")
FAMILY = Family("distilbert", ("transformers DistilBertModel and its heads (post-norm layers) under preserve='meft1' "
                               "or 'meft2'",), _convert_distilbert, halves="whole layer",
                classes=tuple(("transformers", name) for name in _CLASSES),
                pickled=_pickled_host_classes("transformers.models.distilbert.modeling_distilbert", "TransformerBlock",
                                              (_PostNormBlock, _PostNormOrdinaryBlock), "DistilBertModel",
                                              _HostDistilBertModel))
