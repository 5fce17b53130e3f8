"""The vision towers of BLIP, BLIP-2, InstructBLIP and InstructBLIP-Video (``BlipVisionModel``,
``Blip2VisionModel``, ``InstructBlipVisionModel``, ``InstructBlipVideoVisionModel``: found as the
``vision_model`` part of their captioning, question-answering and vision-language models): pre-norm
layers ``x + self_attn(layer_norm1(x))`` then ``h + mlp(layer_norm2(h))``, their attention's q / k / v
one projection (``qkv``). Their loop is ``encoder``, which hands the layers the hidden states alone (no
mask); both halves run the layer's own modules. The Q-Former beside BLIP-2's tower (BERT-like
post-norm layers with cross-attention) stays as it is, named in revify's warning."""
from __future__ import annotations

from .core import Family, _host_block_mixins, _LibraryMlpHalf, _pickled_models
from .host import _convert_library_tower, _first, _HostTowerModel, _LibraryAttentionHalf

_LAYER_PARTS = {"self_attn", "layer_norm1", "mlp", "layer_norm2"}


class _BlipAttentionHalf(_LibraryAttentionHalf):
    def _library_call(self, x, host, extra):  # (the tower masks nothing)
        b = self.block
        x = self._input(x, b.layer_norm1.weight)
        return _first(b.self_attn(hidden_states=b.layer_norm1(x)))


class _BlipMlpHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "layer_norm2", "mlp"


_HostBlipBlock, _HostBlipOrdinaryBlock = _host_block_mixins((_BlipAttentionHalf, _BlipMlpHalf))


class _HostBlipEncoder(_HostTowerModel):
    """The tower's encoder (its loop): no mask."""


def _convert_blip(model, conversion, found=None):
    _convert_library_tower(model, model.encoder, "layers", _LAYER_PARTS, conversion,
                           (_HostBlipBlock, _HostBlipOrdinaryBlock), _HostBlipEncoder)


# (module, tower, its layer, its encoder)
_TOWERS = (("blip", "BlipVisionModel", "BlipEncoderLayer", "BlipEncoder"),
           ("blip_2", "Blip2VisionModel", "Blip2EncoderLayer", "Blip2Encoder"),
           ("instructblip", "InstructBlipVisionModel", "InstructBlipEncoderLayer", "InstructBlipEncoder"),
           ("instructblipvideo", "InstructBlipVideoVisionModel", "InstructBlipVideoEncoderLayer",
            "InstructBlipVideoEncoder"))
FAMILY = Family("blip", ("the vision towers of transformers BLIP, BLIP-2, InstructBLIP and InstructBLIP-Video "
                         "(their captioning, question-answering and vision-language models' vision_model)",),
                _convert_blip, halves="library", classes=tuple(("transformers", tower) for _, tower, _, _ in _TOWERS),
                pickled=_pickled_models((_HostBlipBlock, _HostBlipOrdinaryBlock),
                                        ((module, layer, encoder, _HostBlipEncoder)
                                         for module, _, layer, encoder in _TOWERS)))
