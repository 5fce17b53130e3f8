"""AIMv2's towers (``Aimv2VisionModel``, ``Aimv2TextModel``, both towers of ``Aimv2Model``) and Ovis2's vision
tower (``Ovis2VisionModel``, AIMv2's layers): pre-norm layers ``x + attention(rms_norm1(x))`` then
``h + ffn(rms_norm2(h))`` (a SwiGLU MLP). The loop is the tower's ``encoder`` (Ovis2's under ``transformer``),
which hands every layer the tower's mask (the text tower's causal one; none for images); both halves run the
layer's own modules."""
from __future__ import annotations

from .core import Family, _host_block_mixins, _LibraryMlpHalf, _pickled_models, _RevifiedLM
from .host import _convert_library_tower, _first, _HostTowerModel, _LibraryAttentionHalf

_LAYER_PARTS = {"attention", "ffn", "rms_norm1", "rms_norm2"}


class _Aimv2AttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.attention

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.rms_norm1.weight)
        return _first(b.attention(hidden_states=b.rms_norm1(x), attention_mask=host.mask_for(b)))


class _Aimv2MlpHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "rms_norm2", "ffn"


_HostAimv2Block, _HostAimv2OrdinaryBlock = _host_block_mixins((_Aimv2AttentionHalf, _Aimv2MlpHalf))


class _HostAimv2Encoder(_HostTowerModel):
    """An AIMv2-style encoder (the tower's loop): the tower's mask."""


def _convert_aimv2(model, conversion, found=None):
    loop = model.encoder if hasattr(model, "encoder") else model.transformer.encoder  # (Ovis2's)
    _convert_library_tower(model, loop, "layers", _LAYER_PARTS, conversion, (_HostAimv2Block, _HostAimv2OrdinaryBlock),
                           _HostAimv2Encoder)


# (transformers module, layer class, loop class, the towers)
_TOWERS = (("aimv2", "Aimv2EncoderLayer", "Aimv2Encoder", ("Aimv2VisionModel", "Aimv2TextModel")),
           ("ovis2", "Ovis2VisionEncoderLayer", "Ovis2VisionEncoder", ("Ovis2VisionModel",)))
FAMILY = Family("aimv2", ("transformers AIMv2's towers (Aimv2VisionModel, Aimv2TextModel, both towers of Aimv2Model) "
                          "and Ovis2's vision tower (Ovis2VisionModel: AIMv2's layers)",),
                _convert_aimv2, halves="library",
                classes=tuple(("transformers", tower) for *_, towers in _TOWERS for tower in towers),
                pickled={**_pickled_models((_HostAimv2Block, _HostAimv2OrdinaryBlock),
                                           ((module, layer, loop, _HostAimv2Encoder)
                                            for module, layer, loop, _ in _TOWERS)),
                         # (the tower around the loop, which transformers does not export by its name)
                         "RevifiedOvis2VisionModel": ("transformers.models.ovis2.modeling_ovis2", "Ovis2VisionModel",
                                                      _RevifiedLM)})
