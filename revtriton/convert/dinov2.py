"""Hugging Face DINOv2 (``Dinov2Model``, ``Dinov2ForImageClassification``; with registers too): a
pre-norm ViT encoder whose branches end in a layer scale and drop-path,
``x + drop_path(layer_scale1(attention(norm1(x))))`` then ``h + drop_path(layer_scale2(mlp(norm2(h))))``,
run through the library's own forward. Both
halves run the layer's own modules (its attention with the library's mask, its MLP or SwiGLU MLP);
drop-path draws are replayed in the rebuild as any half's random draws are."""
from __future__ import annotations

from .core import Family, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _first, _HostAttention, _HostDecoderModel
from .probe import require_layer_parts

_DINOV2_LAYER_PARTS = {"norm1", "attention", "layer_scale1", "drop_path", "norm2", "mlp", "layer_scale2"}


class _Dinov2AttentionHalf(_HostAttention, _LibraryHalf):
    takes_cond = True  # the library's mask (an attention_mask given to the model), no token layout

    def _attention_module(self):
        return self.block.attention

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.norm1.weight)
        return b.drop_path(b.layer_scale1(_first(b.attention(b.norm1(x), host.mask_for(b), **extra))))

    def _standalone(self, cond) -> bool:  # no RoPE and no mask: alone, the half runs its modules
        return cond is None

    def _modules(self, x):
        b = self.block
        return b.drop_path(b.layer_scale1(_first(b.attention(b.norm1(self._input(x, b.norm1.weight))))))


class _Dinov2MlpHalf(_LibraryHalf):
    def _modules(self, x):
        b = self.block
        return b.drop_path(b.layer_scale2(b.mlp(b.norm2(self._input(x, b.norm2.weight)))))


_HostDinov2Block, _HostDinov2OrdinaryBlock = _host_block_mixins((_Dinov2AttentionHalf, _Dinov2MlpHalf))


class _HostDinov2Model(_HostDecoderModel):
    """Dinov2Model: patches in, no cache; its layers are ``encoder.layer``, its last hidden state the
    last layer's (before layernorm)."""

    _layers = "encoder.layer"
    _rope, _tokens_input, _caches, _tie_last = False, False, False, False


def _convert_dinov2(model, conversion, found=None):
    base = next((getattr(model, name) for name in ("dinov2", "dinov2_with_registers") if hasattr(model, name)), model)
    layers = base.encoder.layer
    if not len(layers):
        raise ValueError(f"revify: {type(model).__name__} has no layers")
    require_layer_parts(layers, _DINOV2_LAYER_PARTS, "DINOv2")
    _convert_hosted_layers(model, base, "encoder.layer", conversion, (_HostDinov2Block, _HostDinov2OrdinaryBlock),
                           _HostDinov2Model)


# DINOv2, and DINOv2 with registers (the same layers, register tokens in its embeddings): (module, prefix).
_KINDS = (("dinov2", "Dinov2"), ("dinov2_with_registers", "Dinov2WithRegisters"))

FAMILY = Family("dinov2", ("transformers Dinov2Model / Dinov2ForImageClassification, and DINOv2 with registers "
                           "(Dinov2WithRegistersModel / Dinov2WithRegistersForImageClassification)",), _convert_dinov2,
                halves="library",
                classes=tuple(("transformers", f"{prefix}{kind}") for _, prefix in _KINDS
                              for kind in ("ForImageClassification", "Model")),
                pickled={name: entry for module, prefix in _KINDS
                         for name, entry in _pickled_host_classes(f"transformers.models.{module}.modeling_{module}",
                                                                  f"{prefix}Layer",
                                                                  (_HostDinov2Block, _HostDinov2OrdinaryBlock),
                                                                  f"{prefix}Model", _HostDinov2Model).items()})
