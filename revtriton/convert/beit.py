"""Hugging Face BEiT (``BeitModel``, ``BeitForImageClassification``, ``BeitForMaskedImageModeling``;
transformers 5): a pre-norm ViT encoder whose branches end in dropout, a layer scale (``lambda_1`` /
``lambda_2``, a parameter or 1.0) and drop-path, and whose attention adds relative position biases to
its mask: the model's shared one (folded into the mask it hands every layer) and, with
``use_relative_position_bias``, each layer's own, which the layer makes from the image's resolution
its loop passes. Both halves run the layer's own modules (no fused kernel adds a bias to attention
scores); the resolution reaches the attention half in the conditioning (``host._HostCond.resolution``),
so its rebuild in backward makes the same bias."""
from __future__ import annotations

from .core import Family, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _first, _HostAttention, _HostDecoderModel

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
    parts = {name for name, _ in layers[0].named_children()} - {"relative_position_bias"}
    if parts != _BEIT_LAYER_PARTS:
        raise NotImplementedError(f"revify: {type(layers[0]).__name__} has parts {sorted(parts)}, not BEiT's "
                                  f"{sorted(_BEIT_LAYER_PARTS)}: not supported")
    _convert_hosted_layers(model, base, "layers", conversion, (_HostBeitBlock, _HostBeitOrdinaryBlock), _HostBeitModel)


_HEADS = ("BeitForImageClassification", "BeitForMaskedImageModeling")

FAMILY = Family("beit", ("transformers BeitModel / BeitForImageClassification / BeitForMaskedImageModeling (relative "
                         "position biases shared or per layer, layer scale, drop-path)",), _convert_beit,
                halves="library",
                classes=tuple(("transformers", name) for name in ("BeitModel", *_HEADS)),
                pickled=_pickled_host_classes("transformers.models.beit.modeling_beit", "BeitLayer",
                                              (_HostBeitBlock, _HostBeitOrdinaryBlock), "BeitModel", _HostBeitModel))
