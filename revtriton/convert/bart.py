"""The BART lineage: its decoders as causal LMs (``BartForCausalLM`` and its kin: MBart, Pegasus,
Blenderbot, BigBird-Pegasus and Whisper's decoder with pre-norm layers; BART, Marian, Blenderbot-Small,
TrOCR, MVP, PLBart with post-norm ones), and both stacks of its seq2seq models (``BartEncoder``,
``BartDecoder`` and their kin, found as parts of ``BartForConditionalGeneration``, ``MarianMTModel``,
``M2M100Model``, ``Speech2TextForConditionalGeneration``, ...; the decoders alone of models whose
encoder another attention runs: PEGASUS-X, LED).

Their layers have OPT's parts (``self_attn``, ``self_attn_layer_norm``, ``fc1``, ``fc2``,
``final_layer_norm``) and a decoder's a cross-attention (``encoder_attn``, ``encoder_attn_layer_norm``),
run when the model is given an encoder's states: the conditioning carries them (and their mask) to the
halves, so their gradient reaches the encoder. Pre-norm layers run OPT's halves (checked on a probe at
conversion, without an encoder's states), a decoder's F its self-attention then its cross-attention on
the sum (:class:`_CrossAttendingHalf`); post-norm ones convert under ``preserve="meft1"`` / ``"meft2"``,
the whole layer one half (convert.postnorm)."""
from __future__ import annotations

from .core import Family, LayerSpec, _dropout, _host_block_mixins, _pickled_host_classes
from .host import _convert_hosted_layers, _first, _HostDecoderModel, _pack_host_cond, _require_hosted_layer_loop
from .opt import _HostOPTBlock, _HostOPTDecoder, _HostOPTOrdinaryBlock, _OPTAttentionHalf, _OPTMlpHalf
from .postnorm import _PostNormBlock, _PostNormOrdinaryBlock, require_whole_layer_mode
from .probe import _causal_layer_inputs, _loop_source_matches, _probe_layers, _require_layer_loop, require_layer_parts

_ALL = ("ForCausalLM", "Decoder", "Encoder")
# (module, class prefix, pre-norm layers, the classes revify takes: "<prefix>ForCausalLM" (its decoder's
# layers), "<prefix>Decoder" and "<prefix>Encoder" (a seq2seq model's parts)). Their layers are
# "<prefix>DecoderLayer" and "<prefix>EncoderLayer".
_MODELS = (("bart", "Bart", False, _ALL),
           ("mbart", "MBart", True, _ALL),
           ("pegasus", "Pegasus", True, _ALL),
           ("marian", "Marian", False, _ALL),
           ("blenderbot", "Blenderbot", True, _ALL),
           ("blenderbot_small", "BlenderbotSmall", False, _ALL),
           ("bigbird_pegasus", "BigBirdPegasus", True, ("ForCausalLM", "Decoder")),  # (its encoder: block-sparse)
           ("trocr", "TrOCR", False, ("ForCausalLM",)),  # (a vision encoder-decoder's decoder is its causal LM)
           ("mvp", "Mvp", False, ("ForCausalLM", "Decoder")),  # (its encoder's layers take a prompt, None or not)
           ("plbart", "PLBart", False, _ALL),
           ("whisper", "Whisper", True, ("ForCausalLM", "Decoder")),  # (Whisper's encoder: convert.whisper)
           ("m2m_100", "M2M100", True, ("Decoder", "Encoder")),
           ("speech_to_text", "Speech2Text", True, ("Decoder", "Encoder")),  # (its encoder reads audio features)
           ("pegasus_x", "PegasusX", True, ("Decoder",)),  # (its encoder: block-local attention, global tokens)
           ("led", "LED", False, ("Decoder",)))  # (its encoder: Longformer's attention)
_AUDIO_ENCODERS = {"Speech2TextEncoder"}
# Decoders named otherwise than "<prefix>Decoder": PP-FormulaNet's (mBART's decoder, its text model)
_DECODER_NAMES = {"PPFormulaNet": "PPFormulaNetTextModel"}
_MODELS += (("pp_formulanet", "PPFormulaNet", True, ("Decoder",)),)  # (its encoder: the sam family's)


def _class_name(prefix: str, kind: str) -> str:
    return _DECODER_NAMES.get(prefix, f"{prefix}Decoder") if kind == "Decoder" else f"{prefix}{kind}"


# class name -> (what it is: one of _ALL, pre-norm layers)
_CLASSES = {_class_name(prefix, kind): (kind, pre_norm) for _, prefix, pre_norm, kinds in _MODELS for kind in kinds}
# The parts of every layer: OPT's, and a decoder's cross-attention (run when the model is given an
# encoder's states).
_LAYER_PARTS = {"self_attn", "self_attn_layer_norm", "activation_fn", "fc1", "fc2", "final_layer_norm"}
_CROSS_ATTENTION_PARTS = {"encoder_attn", "encoder_attn_layer_norm"}


class _CrossAttendingHalf(_OPTAttentionHalf):
    """F of a pre-norm decoder layer: its self-attention branch, then, given an encoder's states (the
    conditioning carries them and their mask), its cross-attention branch on the sum, so that
    ``x + F(x)`` is the layer's state before its MLP. While decoding, both attention modules use the
    model's cache (the cross-attention's keys and values computed once)."""

    def _library_call(self, x, host, extra):
        attended = super()._library_call(x, host, extra)
        states = host.layer_tensors.get("encoder_hidden_states")
        if states is None:  # (a causal LM called without an encoder)
            return attended
        b = self.block
        h = self._input(x, b.encoder_attn_layer_norm.weight) + attended
        out = b.encoder_attn(hidden_states=b.encoder_attn_layer_norm(h), key_value_states=states,
                             attention_mask=host.layer_tensors.get("encoder_attention_mask"), **extra)
        return attended + _dropout(b.dropout, b.training)(_first(out))


_HostCrossAttendingBlock, _HostCrossAttendingOrdinaryBlock = _host_block_mixins((_CrossAttendingHalf, _OPTMlpHalf))


class _HostBartDecoder(_HostOPTDecoder):
    """A decoder of the BART lineage (a causal LM's, or a seq2seq model's part): learned or sinusoidal
    positions added before its loop, a cache while decoding, an encoder's states for its layers'
    cross-attention where the model is given them."""

    _cross_attention = True


class _HostBartEncoder(_HostDecoderModel):
    """An encoder of the BART lineage (a seq2seq model's part): token ids and a padding mask in, no
    cache; positions enter with the embeddings."""

    _rope, _caches = False, False


class _HostBartAudioEncoder(_HostBartEncoder):
    """An encoder of audio features (Speech2Text's): its mask, made from the features', goes to the
    library's modules as it is."""

    _tokens_input = False


def _encoder_layer_inputs(x, block):
    """:func:`_probe_layers`' inputs of an encoder layer: no mask (every token sees every other)."""
    return dict(attention_mask=None), _pack_host_cond(None, None, None, (None, None), True, x)


def _family_class(model) -> str:
    """The name of the model's class among the family's (a user's subclass: the library class it derives from)."""
    return next(cls.__name__ for cls in type(model).__mro__ if cls.__name__ in _CLASSES)


def _convert_bart(model, conversion, found=None):
    """A causal LM (its decoder's layers), or a seq2seq model's decoder or encoder (found as its parts)."""
    kind, pre_norm = _CLASSES[_family_class(model)]
    encoder = kind == "Encoder"
    base = model.model.decoder if kind == "ForCausalLM" else model  # (the causal LM's wrapper holds the decoder)
    name, config, role = type(model).__name__, model.config, "encoder" if encoder else "decoder"
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no {role} layers")
    _require_hosted_layer_loop(name)
    require_layer_parts(base.layers, _LAYER_PARTS if encoder else _LAYER_PARTS | _CROSS_ATTENTION_PARTS, name)
    # TrOCR's and MVP's loops read each layer's output as outputs[0] (the stand-ins then return a tuple)
    tuples = _loop_source_matches(base, rf"(\w+) = {role}_layer\((?:.|\n)*?hidden_states = \1\[0\]")
    if not tuples:
        _require_layer_loop(base, rf"hidden_states = {role}_layer\(",
                            f"take each layer's output as the next hidden states (hidden_states = {role}_layer(...))")
    if getattr(base, "layerdrop", 0.0):
        raise NotImplementedError(f"revify: {name} with {role}_layerdrop={base.layerdrop} skips layers at random "
                                  f"in training, where a reversible stack runs every layer: set {role}_layerdrop=0")
    if getattr(config, "use_prompt", False):  # MVP's prompts: each layer its own, which no half is given
        raise NotImplementedError(f"revify: {name} with use_prompt=True gives each layer prompts of its own: "
                                  f"not supported")
    host = (_HostBartAudioEncoder if _family_class(model) in _AUDIO_ENCODERS else _HostBartEncoder) if encoder else \
        _HostBartDecoder
    if not pre_norm:  # post-norm: the whole layer as one half (given the encoder's states, a decoder's)
        require_whole_layer_mode(conversion, name)
        for block in base.layers:
            block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False, attention="self_attn")
        _convert_hosted_layers(model, base, "layers", conversion, (_PostNormBlock, _PostNormOrdinaryBlock), host,
                               layer_tuples=tuples)
        return
    for block in base.layers:  # the layer's own modules, the model's mask (alone, a half refuses)
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    # (a probe without an encoder's states: a decoder's cross-attention is not run)
    _probe_layers(base, name, base.layers, (_OPTAttentionHalf, _OPTMlpHalf),
                  _encoder_layer_inputs if encoder else _causal_layer_inputs(base), "OPT's pre-norm layer")
    blocks = (_HostOPTBlock, _HostOPTOrdinaryBlock) if encoder else (_HostCrossAttendingBlock,
                                                                      _HostCrossAttendingOrdinaryBlock)
    _convert_hosted_layers(model, base, "layers", conversion, blocks, host, layer_tuples=tuples)


def _pickled(module: str, prefix: str, pre_norm: bool, kinds: tuple) -> dict:
    module = f"transformers.models.{module}.modeling_{module}"
    post_norm = (_PostNormBlock, _PostNormOrdinaryBlock)
    out = {}
    if "ForCausalLM" in kinds or "Decoder" in kinds:
        blocks = (_HostCrossAttendingBlock, _HostCrossAttendingOrdinaryBlock) if pre_norm else post_norm
        out.update(_pickled_host_classes(module, f"{prefix}DecoderLayer", blocks, _class_name(prefix, "Decoder"),
                                         _HostBartDecoder))
    if "Encoder" in kinds:
        blocks = (_HostOPTBlock, _HostOPTOrdinaryBlock) if pre_norm else post_norm
        host = _HostBartAudioEncoder if f"{prefix}Encoder" in _AUDIO_ENCODERS else _HostBartEncoder
        out.update(_pickled_host_classes(module, f"{prefix}EncoderLayer", blocks, f"{prefix}Encoder", host))
    return out


FAMILY = Family("bart", ("the BART lineage: its decoders as causal LMs (MBartForCausalLM, PegasusForCausalLM, "
                         "BlenderbotForCausalLM, BigBirdPegasusForCausalLM, WhisperForCausalLM: pre-norm layers; "
                         "BartForCausalLM, MarianForCausalLM, BlenderbotSmallForCausalLM, TrOCRForCausalLM, "
                         "MvpForCausalLM, PLBartForCausalLM: post-norm layers under preserve='meft1' / 'meft2', "
                         "the whole layer one half), with an encoder's states too (a vision encoder-decoder's "
                         "TrOCR), and both stacks of its seq2seq models, any head: the encoder and the decoder with "
                         "its cross-attention (BART, mBART, Pegasus, Marian, Blenderbot, Blenderbot-Small, PLBart, "
                         "M2M100, Speech2Text; the decoder of MVP, BigBird-Pegasus, Whisper, PEGASUS-X, LED and "
                         "PP-FormulaNet)",),
                _convert_bart, halves="library",
                classes=tuple(("transformers", name) for name in _CLASSES),
                pickled={name: entry for model in _MODELS for name, entry in _pickled(*model).items()})
