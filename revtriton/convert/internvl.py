"""InternVL's vision tower (``InternVLVisionModel``, the vision tower of ``InternVLForConditionalGeneration``
/ ``InternVLModel``, found as their part): pre-norm layers with a layer scale on each branch,
``x + lambda_1 * attention(layernorm_before(x))`` then ``h + lambda_2 * dropout(mlp(layernorm_after(h)))``
(the scales are parameters: trained with the rest). Its loop is ``encoder`` (``InternVLVisionEncoder``),
which hands the layers the hidden states alone; both halves run the layer's own modules."""
from __future__ import annotations

from .core import Family, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_library_tower, _first, _HostTowerModel, _LibraryAttentionHalf

_LAYER_PARTS = {"attention", "mlp", "layernorm_before", "layernorm_after", "dropout"}


class _InternVLAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.attention

    def _library_call(self, x, host, extra):  # (the tower masks nothing)
        b = self.block
        x = self._input(x, b.layernorm_before.weight)
        return b.lambda_1 * _first(b.attention(b.layernorm_before(x)))


class _InternVLMlpHalf(_LibraryHalf):
    def _modules(self, x):
        b = self.block
        out = b.dropout(b.mlp(b.layernorm_after(self._input(x, b.layernorm_after.weight))))
        return out if b.lambda_2 is None else b.lambda_2 * out


_HostInternVLBlock, _HostInternVLOrdinaryBlock = _host_block_mixins((_InternVLAttentionHalf, _InternVLMlpHalf))


class _HostInternVLEncoder(_HostTowerModel):
    """InternVLVisionEncoder (the tower's loop, over ``layer``): no mask."""

    _layers = "layer"


def _convert_internvl(model, conversion, found=None):
    _convert_library_tower(model, model.encoder, "layer", _LAYER_PARTS, conversion,
                           (_HostInternVLBlock, _HostInternVLOrdinaryBlock), _HostInternVLEncoder)


_MODULE = "transformers.models.internvl.modeling_internvl"
FAMILY = Family("internvl", ("transformers InternVLVisionModel: InternVL's vision tower (its layer scales "
                             "on both branches)",),
                _convert_internvl, halves="library", classes=(("transformers", "InternVLVisionModel"),),
                pickled=_pickled_host_classes(_MODULE, "InternVLVisionLayer", (_HostInternVLBlock,
                                                                               _HostInternVLOrdinaryBlock),
                                              "InternVLVisionEncoder", _HostInternVLEncoder))
