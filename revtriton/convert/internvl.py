"""InternVL's vision tower (``InternVLVisionModel``, the vision tower of ``InternVLForConditionalGeneration``
/ ``InternVLModel``, found as their part) and Qianfan-OCR's (``QianfanOCRVisionModel``, InternViT's layers
with drop-path): pre-norm layers with a layer scale on each branch,
``x + lambda_1 * attention(layernorm_before(x))`` then ``h + lambda_2 * dropout(mlp(layernorm_after(h)))``
(the scales are parameters: trained with the rest; Qianfan-OCR's branches then drop whole samples,
``drop_path1`` and ``drop_path2``). InternVL's loop is ``encoder`` (``InternVLVisionEncoder``), Qianfan-OCR's
the tower itself; they hand the layers the hidden states alone, and both halves run the layer's own modules."""
from __future__ import annotations

from torch import nn

from .core import Family, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_library_tower, _first, _HostTowerModel, _LibraryAttentionHalf

_LAYER_PARTS = {"attention", "mlp", "layernorm_before", "layernorm_after", "dropout"}
_DROP_PATHS = ("drop_path1", "drop_path2")  # (Qianfan-OCR's: Identity at rate 0)
_NO_DROP_PATH = nn.Identity()


class _InternVLAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.attention

    def _library_call(self, x, host, extra):  # (the tower masks nothing)
        b = self.block
        x = self._input(x, b.layernorm_before.weight)
        out = b.lambda_1 * _first(b.attention(b.layernorm_before(x)))
        return b._modules.get("drop_path1", _NO_DROP_PATH)(out)


class _InternVLMlpHalf(_LibraryHalf):
    def _modules(self, x):
        b = self.block
        out = b.dropout(b.mlp(b.layernorm_after(self._input(x, b.layernorm_after.weight))))
        out = out if b.lambda_2 is None else b.lambda_2 * out
        return b._modules.get("drop_path2", _NO_DROP_PATH)(out)


_HostInternVLBlock, _HostInternVLOrdinaryBlock = _host_block_mixins((_InternVLAttentionHalf, _InternVLMlpHalf))


class _HostInternVLEncoder(_HostTowerModel):
    """InternVLVisionEncoder or Qianfan-OCR's tower (the loop, over ``layer`` / ``layers``): no mask."""

    _layers = ("layer", "layers")


def _convert_internvl(model, conversion, found=None):
    if hasattr(model, "encoder"):  # InternVL's
        _convert_library_tower(model, model.encoder, "layer", _LAYER_PARTS, conversion,
                               (_HostInternVLBlock, _HostInternVLOrdinaryBlock), _HostInternVLEncoder)
        return
    _convert_library_tower(model, model, "layers", _LAYER_PARTS, conversion, (_HostInternVLBlock,
                                                                               _HostInternVLOrdinaryBlock),
                           _HostInternVLEncoder, optional_parts=_DROP_PATHS)


_MODULE = "transformers.models.internvl.modeling_internvl"
_QIANFAN = "transformers.models.qianfan_ocr.modeling_qianfan_ocr"
FAMILY = Family("internvl", ("transformers InternVLVisionModel: InternVL's vision tower (its layer scales "
                             "on both branches), and Qianfan-OCR's (QianfanOCRVisionModel: drop-path too)",),
                _convert_internvl, halves="library",
                classes=(("transformers", "InternVLVisionModel"), ("transformers", "QianfanOCRVisionModel")),
                pickled={**_pickled_host_classes(_MODULE, "InternVLVisionLayer", (_HostInternVLBlock,
                                                                                  _HostInternVLOrdinaryBlock),
                                                 "InternVLVisionEncoder", _HostInternVLEncoder),
                         **_pickled_host_classes(_QIANFAN, "QianfanOCRVisionLayer", (_HostInternVLBlock,
                                                                                     _HostInternVLOrdinaryBlock),
                                                 "QianfanOCRVisionModel", _HostInternVLEncoder)})
