"""Hugging Face CLIP, SigLIP, SigLIP 2 and MetaCLIP 2 encoders: a text or vision tower alone, with its
projection or a classifier, or both towers of ``CLIPModel`` / ``SiglipModel`` / ``Siglip2Model`` /
``MetaClip2Model``. Their layers are pre-norm, ``x + attention(layer_norm1(x))`` then
``h + mlp(layer_norm2(h))``, run through the library's own forward; each tower is a stack of its own.
The fused kernels compute the attention (causal in CLIP's text tower, padded rows by their token
layout) and SigLIP's tanh-GELU MLP; CLIP's quick-GELU MLP, dropout in training and other custom masks
run the layer's own modules."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..halves.base import parameter
from ..ops.attention import norm_attention_couple
from .core import (Family, LayerSpec, _concatenated_qkv, _HF_ACTIVATIONS, _host_block_mixins, _layout_options,
                   _NormMlpHalf, _p, _parts, _RevifiedLM, _spec_of)
from .host import _convert_hosted_layers, _first, _HostDecoderModel, _ProjectedAttentionHalf
from .probe import require_layer_parts

_LAYER_PARTS = {"self_attn", "layer_norm1", "mlp", "layer_norm2"}
# The towers, by class: (the library's module, whether its attention is causal, whether it takes tokens).
_TOWERS = {"CLIPTextModel": ("clip", True, True), "CLIPVisionModel": ("clip", False, False),
           "SiglipTextModel": ("siglip", False, True), "SiglipVisionModel": ("siglip", False, False),
           "Siglip2TextModel": ("siglip2", False, True), "Siglip2VisionModel": ("siglip2", False, False),
           # MetaCLIP 2: CLIP's towers and layers (its modules "copied from" CLIP's), multilingual tokens
           "MetaClip2TextModel": ("metaclip_2", True, True), "MetaClip2VisionModel": ("metaclip_2", False, False),
           # Janus's SigLIP tower (its attention with q / k norms and a projection_layer: the layer's own modules)
           "JanusVisionModel": ("janus", False, False),
           # The SigLIP towers of Idefics 2, Idefics 3 and SmolVLM (found inside their vision-language models)
           "Idefics2VisionTransformer": ("idefics2", False, False),
           "Idefics3VisionTransformer": ("idefics3", False, False),
           "SmolVLMVisionTransformer": ("smolvlm", False, False),
           # GIT's image encoder: CLIP's vision tower (its modules "copied from" CLIP's; converted with GIT's text
           # layers, by the postnorm_encoder family)
           "GitVisionTransformer": ("git", False, False)}
# The models around the towers (their class taken by revify; their towers are found inside them).
_WRAPPERS = {"clip": ("CLIPModel", "CLIPTextModelWithProjection", "CLIPVisionModelWithProjection",
                      "CLIPForImageClassification"),
             "siglip": ("SiglipModel", "SiglipForImageClassification"),
             "siglip2": ("Siglip2Model", "Siglip2ForImageClassification"),
             "metaclip_2": ("MetaClip2Model", "MetaClip2TextModelWithProjection", "MetaClip2VisionModelWithProjection",
                            "MetaClip2ForImageClassification")}
_LAYERS = {"clip": "CLIPEncoderLayer", "siglip": "SiglipEncoderLayer", "siglip2": "Siglip2EncoderLayer",
           "metaclip_2": "MetaClip2EncoderLayer", "idefics2": "Idefics2EncoderLayer",
           "idefics3": "Idefics3EncoderLayer", "smolvlm": "SmolVLMEncoderLayer", "git": "GitVisionEncoderLayer",
           "janus": "JanusVisionEncoderLayer"}


def _causal(block) -> dict:
    """CLIP's text tower passes ``is_causal=True`` to its attention: the library's mask is None where
    SDPA's causal flag can stand for it."""
    return {"is_causal": True} if _spec_of(block).library_causal else {}


class _ClipAttentionHalf(_ProjectedAttentionHalf):
    # (the library's mask: padding, causal; the token layout of padded rows)
    _norm_name, _attention_name = "layer_norm1", "self_attn"

    def _dropouts(self):  # CLIP's and SigLIP's dropout (a probability); Janus's attention_dropout, projection_dropout
        a = self._attention_module()
        return tuple(_p(getattr(a, name, None)) for name in ("dropout", "attention_dropout", "projection_dropout"))

    couple_op = norm_attention_couple

    def operands(self, x, layout=None):
        norm, a = self._attention_norm(), self._attention_module()
        q, k, v, out = self._projections()
        w_qkv, b_qkv = _concatenated_qkv(q, k, v)
        return ((parameter(norm, "weight"), parameter(norm, "bias"), w_qkv, b_qkv, parameter(out, "weight"),
                 parameter(out, "bias")), dict(heads=a.num_heads, causal=self._spec().library_causal, norm="layer",
                                               eps=norm.eps, **_layout_options(layout)))

    def _fuses(self, x, host) -> bool:
        """Where no mask reaches the layers that the token layout does not describe: SigLIP 2's vision
        tower masks its padded patches (the model's ``pixel_attention_mask``), which only the library's
        attention sees."""
        return super()._fuses(x, host) and (host.layout is not None or host.mask_for(self.block) is None)

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.layer_norm1.weight)
        return _first(b.self_attn(hidden_states=b.layer_norm1(x), attention_mask=host.mask_for(b), **_causal(b),
                                  **extra))

    def _modules(self, x):
        b = self.block
        x = self._input(x, b.layer_norm1.weight)
        mask = None
        if self._spec().library_causal:  # as a mask: the library's eager attention reads causality from it only
            tokens = x.shape[-2]
            mask = torch.full((tokens, tokens), float("-inf"), dtype=x.dtype, device=x.device).triu(1)[None, None]
        return _first(b.self_attn(hidden_states=b.layer_norm1(x), attention_mask=mask))


class _ClipMlpHalf(_NormMlpHalf):
    def _mlp_norm(self):
        return _parts(self.block)["layer_norm2"]

    def _dropouts(self):  # the MLP's own (Janus's two; CLIP's and SigLIP's have none), which the fused path lacks
        return tuple(_p(m) for m in _parts(self.block)["mlp"].children() if isinstance(m, torch.nn.Dropout))

    def _projections(self):
        m = _parts(_parts(self.block)["mlp"])
        return m["fc1"], m["fc2"]

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
        require_layer_parts(layers, _LAYER_PARTS, "CLIP")
    for tower in towers:
        config, causal = tower.config, _TOWERS[type(tower).__name__][1]
        attention = tower.encoder.layers[0].self_attn
        head_dim = attention.head_dim
        projections = {name for name, _ in attention.named_children()} == {"q_proj", "k_proj", "v_proj", "out_proj"}
        spec = LayerSpec(fused_attention=(projections and head_dim * attention.num_heads == config.hidden_size
                                          and abs(float(attention.scale) - head_dim**-0.5) <= 1e-12),
                         activation=_HF_ACTIVATIONS.get(config.hidden_act), library_causal=causal)
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
        layer = _LAYERS[kind]
        names.update({f"{_HostClipBlock._class_prefix}{layer}": (module, layer, _HostClipBlock),
                      f"{_HostClipOrdinaryBlock._class_prefix}{layer}": (module, layer, _HostClipOrdinaryBlock)})
        mixin = _HostClipTextModel if tokens else _HostClipVisionModel
        names[f"{mixin._class_prefix}{tower}"] = (module, tower, mixin)
    for kind, wrappers in _WRAPPERS.items():
        for wrapper in wrappers:
            names[f"Revified{wrapper}"] = (f"transformers.models.{kind}.modeling_{kind}", wrapper, _RevifiedLM)
    return names


FAMILY = Family("clip", ("transformers CLIP, SigLIP, SigLIP 2 and MetaCLIP 2 text and vision towers (CLIPTextModel, "
                         "CLIPVisionModel, SiglipTextModel, SiglipVisionModel, Siglip2TextModel, Siglip2VisionModel, "
                         "MetaClip2TextModel, MetaClip2VisionModel), with their projection or classifier, and both "
                         "towers of CLIPModel / SiglipModel / Siglip2Model / MetaClip2Model; the SigLIP vision towers "
                         "of Idefics 2, Idefics 3, SmolVLM and Janus; GIT's vision tower",),
                _convert_clip,
                classes=tuple(("transformers", name) for name in (*_TOWERS, *sum(_WRAPPERS.values(), ()))),
                pickled=_pickled())
