"""Hugging Face MPNet (``MPNetModel`` and its heads; sentence-transformers' all-mpnet-base-v2 is one):
post-norm BERT-like layers (``attention`` with its LayerNorm after the residual add, ``intermediate``,
``output`` with its own) whose attention adds a relative position bias the encoder computes once
before its loop (``position_bias``, a layer tensor the conditioning carries: its gradient reaches the
encoder's relative_attention_bias), under the preserving couplings whose one half is the whole
pretrained layer (``meft1`` / ``meft2``, as BERT's: convert.postnorm)."""
from __future__ import annotations

from .core import Family, _pickled_host_classes
from .encoder import _HostEncoderModel
from .host import _convert_hosted_layers
from .postnorm import _PostNormBlock, _PostNormOrdinaryBlock, prepare_whole_layers
from .probe import _loop_source_matches, _require_layer_loop

_MPNET_LAYER_PARTS = {"attention", "intermediate", "output"}


def _convert_mpnet(model, conversion, found=None):
    base = getattr(model, "mpnet", model)
    prepare_whole_layers(model, conversion, base.encoder.layer, _MPNET_LAYER_PARTS, "MPNet")
    _require_layer_loop(base.encoder, r"\bin (enumerate\()?self\.layer\b", "loop over self.layer")
    tuples = _loop_source_matches(base.encoder, r"(\w+) = layer_module\((?:.|\n)*?hidden_states = \1\[0\]")
    if not tuples:
        _require_layer_loop(base.encoder, r"hidden_states = layer_module\(",
                            "take each layer's output as the next hidden states (hidden_states = layer_module(...))")
    _convert_hosted_layers(model, base, "encoder.layer", conversion, (_PostNormBlock, _PostNormOrdinaryBlock),
                           _HostEncoderModel, layer_tuples=tuples)


_CLASSES = ("MPNetModel", "MPNetForMaskedLM", "MPNetForSequenceClassification", "MPNetForTokenClassification",
            "MPNetForQuestionAnswering", "MPNetForMultipleChoice")
FAMILY = Family("mpnet", ("transformers MPNetModel and its heads (post-norm layers, the encoder's relative position "
                          "bias) under preserve='meft1' or 'meft2'",), _convert_mpnet, halves="whole layer",
                classes=tuple(("transformers", name) for name in _CLASSES),
                pickled=_pickled_host_classes("transformers.models.mpnet.modeling_mpnet", "MPNetLayer",
                                              (_PostNormBlock, _PostNormOrdinaryBlock), "MPNetModel",
                                              _HostEncoderModel))
