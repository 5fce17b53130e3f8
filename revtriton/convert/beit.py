"""Hugging Face BEiT (``BeitModel``, ``BeitForImageClassification``, ``BeitForMaskedImageModeling``;
transformers 5): a pre-norm ViT encoder whose branches end in dropout, a layer scale (``lambda_1`` /
``lambda_2``, a parameter or 1.0) and drop-path, and whose attention adds relative position biases to
its mask: the model's shared one (folded into the mask it hands every layer) and, with
``use_relative_position_bias``, each layer's own, which the layer makes from the image's resolution
its loop passes. Both halves run the layer's own modules (no fused kernel adds a bias to attention
scores); the resolution reaches the attention half in the conditioning (``host._HostCond.resolution``),
so its rebuild in backward makes the same bias.

Data2Vec-vision (``Data2VecVisionModel`` and its classifier) keeps BEiT's earlier layout: ``attention``
(its ``attention`` and ``output``), ``intermediate`` / ``output``, ``lambda_1`` / ``lambda_2`` or None; its
loop makes the shared bias again for every layer (the first layer's stands for all: ``LayerSpec.loop_remade``)
and its attention adds each layer's own inside. The half runs that attention's eager forward, whichever
implementation the model chose: scaled_dot_product_attention would pick another kernel in the rebuild
(whose bias needs grad) than in the forward."""
from __future__ import annotations

import importlib

from .core import Family, LayerSpec, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _first, _HostAttention, _HostDecoderModel, _require_hosted_layer_loop
from .probe import _require_layer_loop, require_layer_parts

_BEIT_LAYER_PARTS = {"attention", "layernorm_before", "layernorm_after", "mlp", "dropout", "drop_path"}


def _layer_bias(block, x, resolution):
    """The layer's own relative position bias for ``x``'s tokens, or None: at the resolution the loop
    gave (height, width, interpolate), or, alone (no conditioning), at the image size it was built for."""
    module = block.relative_position_bias
    if module is None:
        return None
    if resolution is None:
        window, interpolate = module.window_size, False
    else:
        height, width, interpolate = resolution
        window = (height // block.patch_size, width // block.patch_size)
    return module(window, bool(interpolate), dim_size=x.shape[1])


def _with_layer_bias(block, mask, bias):
    """The attention's mask: the layer's bias plus the model's mask (the library's order), needing grad
    wherever the rebuild's does, also in the forward, which runs without grad:
    scaled_dot_product_attention picks its kernel by whether the mask needs grad (on a CPU a mask that
    does takes the math kernel, one that does not the flash kernel: other bits), so the forward's mask
    is then a leaf that needs grad, and both passes run the same kernel."""
    if bias is None:
        return mask
    needs_grad = block.relative_position_bias.relative_position_bias_table.requires_grad or (
        mask is not None and mask.requires_grad)
    mask = bias if mask is None else bias + mask
    if needs_grad and not mask.requires_grad:
        mask = mask.detach().requires_grad_()
    return mask


class _BeitAttentionHalf(_HostAttention, _LibraryHalf):
    takes_cond = True  # the model's mask (its shared relative position bias in it) and the image's resolution

    def _attention_module(self):
        return self.block.attention

    def _library_call(self, x, host, extra):
        return self._branch(x, host.mask_for(self.block), host.resolution, extra)

    def _standalone(self, cond) -> bool:  # no mask, no resolution: alone, the half runs at its built size
        return cond is None

    def _modules(self, x):
        return self._branch(x, None, None, {})

    def _branch(self, x, mask, resolution, extra):
        b = self.block
        x = self._input(x, b.layernorm_before.weight)
        mask = _with_layer_bias(b, mask, _layer_bias(b, x, resolution))
        out = _first(b.attention(b.layernorm_before(x), attention_mask=mask, **extra))
        return b.drop_path(b.lambda_1 * b.dropout(out))


class _BeitMlpHalf(_LibraryHalf):
    rows_independent = True  # each token's MLP output from its own row (ReversibleStack token_chunk)

    def _modules(self, x):
        b = self.block
        return b.drop_path(b.lambda_2 * b.dropout(b.mlp(b.layernorm_after(self._input(x, b.layernorm_after.weight)))))


_HostBeitBlock, _HostBeitOrdinaryBlock = _host_block_mixins((_BeitAttentionHalf, _BeitMlpHalf))


class _HostBeitModel(_HostDecoderModel):
    """BeitModel: patches in, no cache; its layers are ``layers``, its last hidden state the last
    layer's (before its layernorm or mean pooling)."""

    _rope, _tokens_input, _caches, _tie_last = False, False, False, False


def _convert_beit(model, conversion, found=None):
    base = getattr(model, "beit", model)
    layers = getattr(base, "layers", None)
    if layers is None or not len(layers):
        raise NotImplementedError(f"revify: this transformers version's {type(model).__name__} has no `layers` of "
                                  f"BeitLayer (transformers 5 layout) to convert")
    require_layer_parts(layers, _BEIT_LAYER_PARTS, "BEiT", optional=("relative_position_bias",))
    _convert_hosted_layers(model, base, "layers", conversion, (_HostBeitBlock, _HostBeitOrdinaryBlock), _HostBeitModel)


_DATA2VEC_MODULE = "transformers.models.data2vec.modeling_data2vec_vision"
_DATA2VEC_LAYER_PARTS = {"attention", "intermediate", "output", "layernorm_before", "layernorm_after", "drop_path"}


def _scaled(scale, h):
    return h if scale is None else scale * h


class _Data2VecAttentionHalf(_HostAttention, _LibraryHalf):
    takes_cond = True  # the shared relative position bias and the image's resolution

    def _attention_module(self):
        return self.block.attention.attention

    def _library_call(self, x, host, extra):
        return self._branch(x, host.layer_tensors.get("relative_position_bias"), host.resolution)

    def _standalone(self, cond) -> bool:  # alone: no shared bias, the image size it was built for
        return cond is None

    def _modules(self, x):
        return self._branch(x, None, None)

    def _branch(self, x, shared_bias, resolution):
        b, attention = self.block, self.block.attention.attention
        x = self._input(x, b.layernorm_before.weight)
        if resolution is None:
            size = attention.config.image_size
            height, width = (size, size) if isinstance(size, int) else size
            interpolate = False
        else:
            height, width, interpolate = resolution
        eager = importlib.import_module(_DATA2VEC_MODULE).Data2VecVisionSelfAttention.forward
        h = _first(eager(attention, b.layernorm_before(x), False, shared_bias, bool(interpolate), (height, width)))
        return b.drop_path(_scaled(b.lambda_1, b.attention.output(h, None)))


class _Data2VecMlpHalf(_LibraryHalf):
    rows_independent = True

    def _modules(self, x):
        b = self.block
        x = self._input(x, b.layernorm_after.weight)
        return b.drop_path(_scaled(b.lambda_2, b.output(b.intermediate(b.layernorm_after(x)))))


_HostData2VecBlock, _HostData2VecOrdinaryBlock = _host_block_mixins((_Data2VecAttentionHalf, _Data2VecMlpHalf))


class _HostData2VecVisionModel(_HostDecoderModel):
    """Data2VecVisionModel: patches in, its layers ``encoder.layer``, no cache; its last hidden state the
    last layer's (before its layernorm or pooling)."""

    _layers = "encoder.layer"
    _rope, _tokens_input, _caches, _tie_last = False, False, False, False


def _convert_data2vec_vision(model, conversion, found=None):
    base = getattr(model, "data2vec_vision", model)
    name, layers = type(model).__name__, base.encoder.layer
    if not len(layers):
        raise ValueError(f"revify: {name} has no layers")
    _require_hosted_layer_loop(name)
    require_layer_parts(layers, _DATA2VEC_LAYER_PARTS, "Data2Vec-vision")
    _require_layer_loop(base.encoder, r"(\w+) = layer_module\((?:.|\n)*?hidden_states = \1\[0\]",
                        "take each layer's output as the next hidden states (hidden_states = layer_outputs[0])")
    for block in layers:
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False,
                                          loop_remade=("relative_position_bias",))
    _convert_hosted_layers(model, base, "encoder.layer", conversion, (_HostData2VecBlock, _HostData2VecOrdinaryBlock),
                           _HostData2VecVisionModel, layer_tuples=True)


_HEADS = ("BeitForImageClassification", "BeitForMaskedImageModeling")
_DATA2VEC_CLASSES = ("Data2VecVisionModel", "Data2VecVisionForImageClassification")


def _convert_beit_like(model, conversion, found=None):
    if type(getattr(model, "data2vec_vision", model)).__name__ == "Data2VecVisionModel":
        return _convert_data2vec_vision(model, conversion, found)
    return _convert_beit(model, conversion, found)


FAMILY = Family("beit", ("transformers BeitModel / BeitForImageClassification / BeitForMaskedImageModeling (relative "
                         "position biases shared or per layer, layer scale, drop-path), and Data2Vec-vision "
                         "(Data2VecVisionModel / Data2VecVisionForImageClassification: BEiT's earlier layout)",),
                _convert_beit_like, halves="library",
                classes=tuple(("transformers", name) for name in ("BeitModel", *_HEADS, *_DATA2VEC_CLASSES)),
                pickled={**_pickled_host_classes("transformers.models.beit.modeling_beit", "BeitLayer",
                                                 (_HostBeitBlock, _HostBeitOrdinaryBlock), "BeitModel",
                                                 _HostBeitModel),
                         **_pickled_host_classes(_DATA2VEC_MODULE, "Data2VecVisionLayer",
                                                 (_HostData2VecBlock, _HostData2VecOrdinaryBlock),
                                                 "Data2VecVisionModel", _HostData2VecVisionModel)})
