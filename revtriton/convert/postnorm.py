"""Hugging Face post-norm encoders with BERT's layer parts (BERT, RoBERTa, ...: a LayerNorm after
each residual add, in ``attention.output`` and ``output``) under the preserving couplings whose one
half is the whole pretrained layer: ``meft1`` (F = the layer plus an adapter, G an adapter) and
``meft2`` (F an adapter, G the layer), MEFT's own setting (its backbones are BERT and RoBERTa).

A norm after the add is inside the half there, so nothing needs inverting through it: the half is
the layer's own forward (its attention with the library's mask), its output the layer's output. The
function-changing conversion and ``meft3`` couple each branch to a stream, which a norm applied after
the add does not fit: they refuse, naming the modes that work.
"""
from __future__ import annotations

import functools
import inspect

from torch import nn

from ..ops.streams import couple_output
from .core import Family, LayerSpec, _OrdinaryBlock, _RevifiedBlock, _spec_of, preserving_adapters
from .clip import _convert_clip
from .clip import _towers as _clip_towers
from .encoder import _HostEncoderModel, _attention_norm, bert_style_layer
from .host import (LAYER_TENSORS, _convert_hosted_layers, _first, _HostAttention, _library_forward,
                   _require_hosted_layer_loop, _unpack_host_cond, decoding_inputs)
from .probe import _loop_source_matches, _require_layer_loop, require_layer_parts

WHOLE_LAYER_MODES = ("meft1", "meft2")


@functools.lru_cache(maxsize=None)
def _parameters(forward) -> frozenset:
    return frozenset(inspect.signature(forward).parameters)


class _LibraryLayer:
    """The pretrained layer as one half: its own forward, with the model's mask (none when called
    alone: every row one sequence), a decoder's position ids, the model's rotary embedding where the
    layer takes one and, while decoding, its cache; its
    output the layer's (residual and norms included). ``LayerSpec.attention`` names the layer's
    attention module (its cache layer index) where the layer decodes."""

    takes_cond = True

    def __init__(self, block: nn.Module):
        self.block = block

    def parameters(self):  # the block's (what the engine reads a stream's value dtype from)
        return self.block.parameters()

    def __call__(self, x, cond=None):
        forward = _library_forward(self.block)
        if cond is None:
            return _first(forward(self.block, x))
        host = _unpack_host_cond(cond)
        spec = _spec_of(self.block)
        attention = self.block.get_submodule(spec.attention) if spec.attention else None
        inputs = dict(decoding_inputs(self.block, attention),
                      attention_mask=host.mask_for(self.block))
        if "position_ids" in _parameters(forward):  # (a decoder's: flash attention finds packed rows by them)
            inputs["position_ids"] = _HostAttention._position_ids(host)
        rotary = host.rotary_for(self.block)
        if rotary is not None and "position_embeddings" in _parameters(forward):  # (NomicBERT's, GTE's RoPE)
            inputs["position_embeddings"] = rotary
        inputs.update((name, t) for name, t in host.layer_tensors.items() if name in _parameters(forward))
        return _first(forward(self.block, x, **inputs))

    def couple(self, res, x, sign, frac_bits=None, cond=None):
        return couple_output(res, self(x, cond), sign, frac_bits)


class _LibraryLayerWithAdapter(_LibraryLayer):
    """meft1's F: the layer's output plus an adapter of the layer's input."""

    def __init__(self, block: nn.Module, adapter: nn.Module):
        super().__init__(block)
        self.adapter = adapter

    def __call__(self, x, cond=None):
        return super().__call__(x, cond) + self.adapter(x)


class _PostNormBlock(_RevifiedBlock):
    _class_prefix = "RevifiedPostNorm"

    def coupling_halves(self):
        adapters = preserving_adapters(self)
        if self._revtriton_preserve == "meft1":
            return _LibraryLayerWithAdapter(self, adapters["f"]), adapters["g"]
        return adapters["f"], _LibraryLayer(self)


class _PostNormOrdinaryBlock(_OrdinaryBlock):
    _class_prefix = "RevifiedPostNormOrdinary"

    def forward(self, x, cond=None):
        return _LibraryLayer(self)(x, cond)


def _is_layer_norm(norm) -> bool:
    """A LayerNorm: torch's, or a model's own class of one (DeBERTa's DebertaLayerNorm); the whole layer
    runs its own forward, so which one computes it does not matter here."""
    return isinstance(norm, nn.LayerNorm) or (isinstance(norm, nn.Module) and type(norm).__name__.endswith("LayerNorm"))


def _postnorm_encoder_base(model: nn.Module):
    """The base model of a Hugging Face encoder whose layers have BERT's parts with a LayerNorm after
    each residual add (``attention.output.LayerNorm``, ``output.LayerNorm``), or None."""
    found = bert_style_layer(model)
    if found is None or _attention_norm(found[1]) is not None:
        return None
    base, layer = found
    norms = (getattr(layer.attention.output, "LayerNorm", None), getattr(layer.output, "LayerNorm", None))
    if not all(_is_layer_norm(norm) for norm in norms):
        return None
    extra = [name for name in inspect.signature(type(layer).forward).parameters if name not in LAYER_INPUTS]
    if extra:
        raise NotImplementedError(
            f"revify: {type(model).__name__}'s post-norm layers take {', '.join(extra)} from the encoder's loop, "
            f"which a whole-layer half is not given (it gets the hidden states, the mask and "
            f"{', '.join(LAYER_TENSORS)}): not supported")
    return base


# The inputs of a BERT-style layer's forward a whole-layer half provides (the mask, the layer tensors:
# DeBERTa-v2's relative positions and embeddings) or that an encoder without cross-attention or a cache
# leaves at their defaults (DeBERTa-v2's query_states: None but in its enhanced mask decoder).
LAYER_INPUTS = {"self", "hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask",
                "cache", "past_key_value", "past_key_values", "cache_position", "output_attentions", "kwargs",
                "query_states", *LAYER_TENSORS}


POST_NORM = "post-norm layers (a LayerNorm after each residual add)"


def require_whole_layer_mode(conversion, what: str, structure: str = POST_NORM):
    """Layers whose residual is not an additive one of their input (``what`` names the model,
    ``structure`` says how: post-norm by default) convert only with the whole layer as one half."""
    if conversion.preserve not in WHOLE_LAYER_MODES:
        asked = "revify(model)" if conversion.preserve is None else f"preserve={conversion.preserve!r}"
        raise NotImplementedError(
            f"revify: {what} has {structure}: {asked} couples each branch to a stream, which that residual does "
            f"not fit; preserve='meft1' or 'meft2' converts it (the whole pretrained layer is one half, MEFT's "
            f"setting)")


def prepare_whole_layers(model, conversion, layers, parts: set, whose: str, **spec):
    """What each family of post-norm layers converted whole (one half a layer) checks and sets before
    hosting its layers: some layers, a whole-layer mode, transformers 5, every layer made of ``parts``
    exactly (``whose``: the model the parts are named after), and each layer's spec (library path;
    ``spec``: more of its fields)."""
    name = type(model).__name__
    if not len(layers):
        raise ValueError(f"revify: {name} has no layers")
    require_whole_layer_mode(conversion, name)
    _require_hosted_layer_loop(name)
    require_layer_parts(layers, parts, whose)
    for block in layers:
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False, **spec)


def _convert_postnorm_encoder(model, conversion, base):
    name, config = type(model).__name__, base.config
    require_whole_layer_mode(conversion, f"{name} (BERT-style)")
    _require_hosted_layer_loop(name)
    # A base model that decodes with a cache whatever is_decoder says (GIT's: BERT's layers, found by the sweep;
    # BERT's own caches only as a decoder, refused by its config).
    decodes = _loop_source_matches(base, r"\buse_cache\b") and not _loop_source_matches(
        base, r"if self\.config\.is_decoder:")
    decoder = bool(getattr(config, "is_decoder", False))
    _require_layer_loop(base.encoder, r"\bin (enumerate\()?self\.layer\b", "loop over self.layer")
    if getattr(base.encoder, "conv", None) is not None:
        raise NotImplementedError(f"revify: {name}'s encoder adds a convolution of its input to the first layer's "
                                  f"output (conv_kernel_size={config.conv_kernel_size}, DeBERTa-v2's), which the "
                                  f"stack's layers, each taking the last one's output, do not compose: not supported")
    for block in base.encoder.layer:  # (a decoder's: its self-attention's cache layer while decoding)
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False,
                                          attention="attention.self" if decoder or decodes else None)
    # DeBERTa-v2's loop unpacks (output, attention weights) from each layer, RemBERT's, TAPAS's, MRA's, YOSO's
    # and Nystromformer's read the output as layer_outputs[0]: the stand-ins return a tuple; BERT's loop takes
    # one tensor.
    tuples = (_loop_source_matches(base.encoder, r"\w+, \w+ = layer_module\(")
              or _loop_source_matches(base.encoder, r"(\w+) = layer_module\((?:.|\n)*?hidden_states = \1\[0\]"))
    if not tuples:
        _require_layer_loop(base.encoder, r"hidden_states = layer_module\(",
                            "take each layer's output as the next hidden states (hidden_states = layer_module(...))")
    host = _HostDecodingEncoderModel if decoder else _HostCachingEncoderModel if decodes else _HostEncoderModel
    _convert_hosted_layers(model, base, "encoder.layer", conversion, (_PostNormBlock, _PostNormOrdinaryBlock),
                           host, layer_tuples=tuples)
    image_encoder = getattr(base, "image_encoder", None)
    if decodes and image_encoder is not None and _clip_towers(image_encoder):  # GIT's: CLIP's vision tower
        _convert_clip(image_encoder, conversion)


class _HostDecodingEncoderModel(_HostEncoderModel):
    """A BERT-style model configured as a decoder (is_decoder=True: BertLMHeadModel, BertGeneration's,
    an EncoderDecoderModel's decoder): causal self-attention with a cache while decoding, and with
    ``add_cross_attention`` its layers attend to an encoder's states."""

    _class_prefix = "RevifiedHostDecodingEncoder"
    _caches, _cross_attention = True, True


class _HostCachingEncoderModel(_HostEncoderModel):
    """A BERT-style model that decodes with a cache whatever its config's is_decoder says (GIT's: the
    image's tokens first, then the text, under the mask it builds itself): its layers keep their
    self-attention's cache while decoding, and a call with grad given a filled cache is refused (the
    stack would ignore it). Its layers' rows are not its ``input_ids``, so the host reads no token
    layout from them: the layers take the model's own mask."""

    _class_prefix = "RevifiedHostCachingEncoder"
    _caches, _tokens_input = True, False


FAMILY = Family(
    "postnorm_encoder", ("post-norm encoders with BERT's layer parts (BERT, RoBERTa, ELECTRA, DeBERTa and DeBERTa-v2 "
                         "with their relative positions, RemBERT, TAPAS, YOSO, Nystromformer, LayoutLM: any head; "
                         "as decoders too, is_decoder=True with or without cross-attention: their causal LMs, "
                         "BertGeneration, an EncoderDecoderModel's; GIT's captioner, its CLIP vision tower by the "
                         "clip family's halves), under preserve='meft1' or 'meft2'",),
    _convert_postnorm_encoder, detect=_postnorm_encoder_base, halves="whole layer",
    conventions={("PostNorm", None, "Layer"): _PostNormBlock,
                 ("PostNorm", "Ordinary", "Layer"): _PostNormOrdinaryBlock,
                 ("HostDecodingEncoder", None, "Model"): _HostDecodingEncoderModel,
                 ("HostCachingEncoder", None, "Model"): _HostCachingEncoderModel})

