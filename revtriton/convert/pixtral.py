"""Pixtral's vision tower (``PixtralVisionModel``: Pixtral's, and the vision tower of Mistral 3's and
LightOnOCR's vision-language models, found as their part): pre-norm layers
``x + attention(attention_norm(x))`` then ``h + feed_forward(ffn_norm(h))`` over every image's patches
in one row, each image attending to itself (the tower's block-diagonal mask) with 2-D rotary
embeddings. Its loop is ``transformer`` (``PixtralTransformer``), which the host mixin takes; both
halves run the layer's own modules with the loop's mask and rotary embedding."""
from __future__ import annotations

from .core import Family, _host_block_mixins, _LibraryMlpHalf, _pickled_host_classes
from .host import _convert_library_tower, _first, _HostTowerModel, _LibraryAttentionHalf

_LAYER_PARTS = {"attention_norm", "attention", "ffn_norm", "feed_forward"}


class _PixtralAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.attention

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.attention_norm.weight)
        return _first(b.attention(hidden_states=b.attention_norm(x), attention_mask=host.mask_for(b),
                                  position_embeddings=host.rotary_for(b)))


class _PixtralMlpHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "ffn_norm", "feed_forward"


_HostPixtralBlock, _HostPixtralOrdinaryBlock = _host_block_mixins((_PixtralAttentionHalf, _PixtralMlpHalf))


class _HostPixtralTransformer(_HostTowerModel):
    """PixtralTransformer (the tower's loop): its mask and rotary embedding made by the tower."""


def _convert_pixtral(model, conversion, found=None):
    _convert_library_tower(model, model.transformer, "layers", _LAYER_PARTS, conversion,
                           (_HostPixtralBlock, _HostPixtralOrdinaryBlock), _HostPixtralTransformer)


_MODULE = "transformers.models.pixtral.modeling_pixtral"
FAMILY = Family("pixtral", ("transformers PixtralVisionModel: Pixtral's vision tower, and Mistral 3's and "
                            "LightOnOCR's (the images' patches in one row, a block-diagonal mask)",),
                _convert_pixtral, halves="library", classes=(("transformers", "PixtralVisionModel"),),
                pickled=_pickled_host_classes(_MODULE, "PixtralAttentionLayer", (_HostPixtralBlock,
                                                                                 _HostPixtralOrdinaryBlock),
                                              "PixtralTransformer", _HostPixtralTransformer))
