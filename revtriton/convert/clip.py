"""Hugging Face CLIP and SigLIP encoders: a text or vision tower alone, with its projection or a
classifier, or both towers of ``CLIPModel`` / ``SiglipModel``. Their layers are pre-norm,
``x + attention(layer_norm1(x))`` then ``h + mlp(layer_norm2(h))``, run through the library's own
forward; each tower is a stack of its own. Both halves run the layer's own modules: its attention
with the library's mask (causal in CLIP's text tower), its MLP (CLIP's quick GELU, SigLIP's tanh
GELU)."""
from __future__ import annotations

from dataclasses import replace

from .core import Family, LayerSpec, _host_block_mixins, _LibraryHalf, _parts, _RevifiedLM, _spec_of
from .host import _convert_hosted_layers, _first, _HostAttention, _HostDecoderModel

_LAYER_PARTS = {"self_attn", "layer_norm1", "mlp", "layer_norm2"}
# The towers, by class: (the library's module, whether its attention is causal, whether it takes tokens).
_TOWERS = {"CLIPTextModel": ("clip", True, True), "CLIPVisionModel": ("clip", False, False),
           "SiglipTextModel": ("siglip", False, True), "SiglipVisionModel": ("siglip", False, False)}
# The models around the towers (their class taken by revify; their towers are found inside them).
_WRAPPERS = {"clip": ("CLIPModel", "CLIPTextModelWithProjection", "CLIPVisionModelWithProjection",
                      "CLIPForImageClassification"),
             "siglip": ("SiglipModel", "SiglipForImageClassification")}


def _causal(block) -> dict:
    """CLIP's text tower passes ``is_causal=True`` to its attention: the library's mask is None where
    SDPA's causal flag can stand for it."""
    return {"is_causal": True} if _spec_of(block).library_causal else {}


class _ClipAttentionHalf(_HostAttention, _LibraryHalf):
    takes_cond = True  # the library's mask (padding, causal), no token layout

    def _attention_module(self):
        return _parts(self.block)["self_attn"]

    def _attention_norm(self):
        return _parts(self.block)["layer_norm1"]

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.layer_norm1.weight)
        return _first(b.self_attn(hidden_states=b.layer_norm1(x), attention_mask=host.mask_for(b), **_causal(b),
                                  **extra))

    def _standalone(self, cond) -> bool:
        """Alone (no conditioning: no mask), a vision tower's half runs its modules; a causal one
        needs the model's mask (the library's eager attention reads causality from it only)."""
        if cond is None and _causal(self.block):
            raise RuntimeError("revtriton: a causal CLIP text layer's attention half needs its model's mask: call the "
                               "model, not the half or the stack alone")
        return cond is None

    def _modules(self, x):
        b = self.block
        return _first(b.self_attn(hidden_states=b.layer_norm1(self._input(x, b.layer_norm1.weight)), **_causal(b)))


class _ClipMlpHalf(_LibraryHalf):
    rows_independent = True  # each token's MLP output from its own row (ReversibleStack token_chunk)

    def _modules(self, x):
        b = self.block
        return b.mlp(b.layer_norm2(self._input(x, b.layer_norm2.weight)))


_HostClipBlock, _HostClipOrdinaryBlock = _host_block_mixins((_ClipAttentionHalf, _ClipMlpHalf))


class _HostClipTextModel(_HostDecoderModel):
    """CLIPTextModel / SiglipTextModel: token ids in (padding masks), no cache; the last hidden state
    is the final layer norm's, the last of the hidden states the last layer's."""

    _layers = "encoder.layers"
    _rope, _caches, _tie_last = False, False, False


class _HostClipVisionModel(_HostDecoderModel):
    """CLIPVisionModel / SiglipVisionModel: patches in; its last hidden state is the last layer's."""

    _layers = "encoder.layers"
    _rope, _tokens_input, _caches, _tie_last = False, False, False, False


def _towers(model) -> list:
    """The text and vision towers in ``model`` (itself, or its ``text_model`` / ``vision_model``)."""
    return [m for m in (model, getattr(model, "text_model", None), getattr(model, "vision_model", None))
            if m is not None and type(m).__name__ in _TOWERS]


def _convert_clip(model, conversion, found=None):
    towers = _towers(model)
    if not towers:
        raise NotImplementedError(f"revify: {type(model).__name__} has no CLIP / SigLIP text or vision tower")
    for tower in towers:
        layers = tower.encoder.layers
        if not len(layers):
            raise ValueError(f"revify: {type(tower).__name__} has no layers")
        for i, layer in enumerate(layers):
            parts = {name for name, _ in layer.named_children()}
            if parts != _LAYER_PARTS:
                raise NotImplementedError(f"revify: {type(layer).__name__} has parts {sorted(parts)} (layer {i}), not "
                                          f"CLIP's {sorted(_LAYER_PARTS)}: not supported")
    for tower in towers:
        causal = _TOWERS[type(tower).__name__][1]
        spec = LayerSpec(fused_attention=False, fused_mlp=False, library_causal=causal)
        for layer in tower.encoder.layers:
            layer._revtriton_spec = replace(spec)
        tokens = _TOWERS[type(tower).__name__][2]
        _convert_hosted_layers(model, tower, "encoder.layers", conversion, (_HostClipBlock, _HostClipOrdinaryBlock),
                               _HostClipTextModel if tokens else _HostClipVisionModel)


def _pickled() -> dict:
    """The swapped classes by the names pickles find them under: each family module's layer, its
    towers and the models around them."""
    names = {}
    for tower, (kind, _, tokens) in _TOWERS.items():
        module = f"transformers.models.{kind}.modeling_{kind}"
        layer = "CLIPEncoderLayer" if kind == "clip" else "SiglipEncoderLayer"
        names.update({f"{_HostClipBlock._class_prefix}{layer}": (module, layer, _HostClipBlock),
                      f"{_HostClipOrdinaryBlock._class_prefix}{layer}": (module, layer, _HostClipOrdinaryBlock)})
        mixin = _HostClipTextModel if tokens else _HostClipVisionModel
        names[f"{mixin._class_prefix}{tower}"] = (module, tower, mixin)
    for kind, wrappers in _WRAPPERS.items():
        for wrapper in wrappers:
            names[f"Revified{wrapper}"] = (f"transformers.models.{kind}.modeling_{kind}", wrapper, _RevifiedLM)
    return names


FAMILY = Family("clip", ("transformers CLIP and SigLIP text and vision towers (CLIPTextModel, CLIPVisionModel, "
                         "SiglipTextModel, SiglipVisionModel), with their projection or classifier, and both "
                         "towers of CLIPModel / SiglipModel",),
                _convert_clip, halves="library",
                classes=tuple(("transformers", name) for name in (*_TOWERS, *_WRAPPERS["clip"], *_WRAPPERS["siglip"])),
                pickled=_pickled())
