"""InternVL's vision tower (``InternVLVisionModel``, the vision tower of ``InternVLForConditionalGeneration``
/ ``InternVLModel``, found as their part): pre-norm layers with a layer scale on each branch,
``x + lambda_1 * attention(layernorm_before(x))`` then ``h + lambda_2 * dropout(mlp(layernorm_after(h)))``
(the scales are parameters: trained with the rest). Its loop is ``encoder`` (``InternVLVisionEncoder``),
which hands the layers the hidden states alone; both halves run the layer's own modules."""
from __future__ import annotations

from .core import Family, LayerSpec, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _first, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .probe import require_layer_parts

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


class _HostInternVLEncoder(_HostDecoderModel):
    """InternVLVisionEncoder (the tower's loop, over ``layer``): patch embeddings in, no mask, no cache;
    its last hidden state is the last layer's."""

    _layers = "layer"
    _rope, _tokens_input, _caches, _tie_last = False, False, False, False


def _convert_internvl(model, conversion, found=None):
    name, loop = type(model).__name__, model.encoder
    if not len(loop.layer):
        raise ValueError(f"revify: {name} has no layers")
    _require_hosted_layer_loop(name)
    require_layer_parts(loop.layer, _LAYER_PARTS, name)
    for layer in loop.layer:
        layer._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _convert_hosted_layers(model, loop, "layer", conversion, (_HostInternVLBlock, _HostInternVLOrdinaryBlock),
                           _HostInternVLEncoder)


_MODULE = "transformers.models.internvl.modeling_internvl"
FAMILY = Family("internvl", ("transformers InternVLVisionModel: InternVL's vision tower (its layer scales "
                             "on both branches)",),
                _convert_internvl, halves="library", classes=(("transformers", "InternVLVisionModel"),),
                pickled=_pickled_host_classes(_MODULE, "InternVLVisionLayer", (_HostInternVLBlock,
                                                                               _HostInternVLOrdinaryBlock),
                                              "InternVLVisionEncoder", _HostInternVLEncoder))
