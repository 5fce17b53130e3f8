"""Hugging Face DistilBERT (``DistilBertModel`` and its heads): post-norm layers,
``h = sa_layer_norm(x + attention(x))`` then ``output_layer_norm(h + ffn(h))``, under the preserving
couplings whose one half is the whole pretrained layer (``meft1`` / ``meft2``, as BERT's:
convert.postnorm); the layer runs its own forward with the model's mask. Its layers are
``transformer.layer``, looped over by ``Transformer.forward``."""
from __future__ import annotations

from .core import Family, _pickled_host_classes
from .host import _convert_hosted_layers, _HostDecoderModel
from .postnorm import _PostNormBlock, _PostNormOrdinaryBlock, prepare_whole_layers
from .probe import _require_layer_loop

_DISTILBERT_LAYER_PARTS = {"attention", "sa_layer_norm", "ffn", "output_layer_norm"}


class _HostDistilBertModel(_HostDecoderModel):
    """DistilBertModel: its layers are ``transformer.layer``, absolute positions enter with the
    embeddings, no KV cache."""

    _layers, _rope, _caches = "transformer.layer", False, False


def _convert_distilbert(model, conversion, found=None):
    base = getattr(model, "distilbert", model)
    prepare_whole_layers(model, conversion, base.transformer.layer, _DISTILBERT_LAYER_PARTS, "DistilBERT")
    _require_layer_loop(base.transformer, r"hidden_states = layer_module\(",
                        "take each layer's output as the next hidden states (hidden_states = layer_module(...))")
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
