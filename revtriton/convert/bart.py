"""The BART lineage: its decoders as causal LMs (``BartForCausalLM`` and its kin: MBart, Pegasus,
Blenderbot, BigBird-Pegasus and Whisper's decoder with pre-norm layers; BART, Marian, Blenderbot-Small,
TrOCR, MVP, PLBart with post-norm ones), and the encoders of its seq2seq models (``BartEncoder`` and its
kin, found as a part of ``BartForConditionalGeneration``, ``MarianMTModel``, ``M2M100Model``, ...: the
decoder, whose cross-attention reads the encoder's states at every layer, stays as it is).

Their layers have OPT's parts (``self_attn``, ``self_attn_layer_norm``, ``fc1``, ``fc2``,
``final_layer_norm``); a decoder's cross-attention (``encoder_attn``) runs only when the model is given
an encoder's states, so a causal LM without them computes OPT's layer. The pre-norm layers run OPT's
halves (checked on a probe at conversion), the post-norm ones convert under ``preserve="meft1"`` /
``"meft2"``, the whole layer one half (convert.postnorm). A causal LM called with
``encoder_hidden_states`` refuses (the host model's input check); the cross-attention's weights stay in
the layer, unused, as they are in the library's causal LM without an encoder."""
from __future__ import annotations

from .core import Family, LayerSpec, _pickled_host_classes
from .host import _convert_hosted_layers, _HostDecoderModel, _pack_host_cond, _require_hosted_layer_loop
from .opt import _HostOPTBlock, _HostOPTDecoder, _HostOPTOrdinaryBlock, _OPTAttentionHalf, _OPTMlpHalf
from .postnorm import _PostNormBlock, _PostNormOrdinaryBlock, require_whole_layer_mode
from .probe import _causal_layer_inputs, _loop_source_matches, _probe_layers, _require_layer_loop, require_layer_parts

# (module, its causal LM class (None: it has none), its encoder class, pre-norm layers); the layers are
# "<Name>DecoderLayer" in "<Name>Decoder", "<Name>EncoderLayer" in the encoder, <Name> the causal LM's
# or the encoder's prefix.
_MODELS = (("bart", "BartForCausalLM", "BartEncoder", False),
           ("mbart", "MBartForCausalLM", "MBartEncoder", True),
           ("pegasus", "PegasusForCausalLM", "PegasusEncoder", True),
           ("marian", "MarianForCausalLM", "MarianEncoder", False),
           ("blenderbot", "BlenderbotForCausalLM", "BlenderbotEncoder", True),
           ("blenderbot_small", "BlenderbotSmallForCausalLM", "BlenderbotSmallEncoder", False),
           ("bigbird_pegasus", "BigBirdPegasusForCausalLM", None, True),
           ("trocr", "TrOCRForCausalLM", None, False),
           ("mvp", "MvpForCausalLM", None, False),  # (its encoder's layers take a prompt argument, None or not)
           ("plbart", "PLBartForCausalLM", "PLBartEncoder", False),
           ("whisper", "WhisperForCausalLM", None, True),  # (Whisper's encoder: convert.whisper)
           ("m2m_100", None, "M2M100Encoder", True))
_ENCODERS = {encoder for *_, encoder, _ in _MODELS if encoder}
_PRE_NORM = {name: pre_norm for _, causal_lm, encoder, pre_norm in _MODELS for name in (causal_lm, encoder) if name}
# The parts of every layer: OPT's, and in a decoder's the cross-attention a causal LM without an encoder
# does not run.
_LAYER_PARTS = {"self_attn", "self_attn_layer_norm", "activation_fn", "fc1", "fc2", "final_layer_norm"}
_CROSS_ATTENTION_PARTS = {"encoder_attn", "encoder_attn_layer_norm"}


class _HostBartEncoder(_HostDecoderModel):
    """An encoder of the BART lineage (a seq2seq model's part): token ids and a padding mask in, no
    cache; positions enter with the embeddings."""

    _rope, _caches = False, False


def _encoder_layer_inputs(x, block):
    """:func:`_probe_layers`' inputs of an encoder layer: no mask (every token sees every other)."""
    return dict(attention_mask=None), _pack_host_cond(None, None, None, (None, None), True, x)


def _family_class(model) -> str:
    """The name of the model's class among the family's (a user's subclass: the library class it derives from)."""
    return next(cls.__name__ for cls in type(model).__mro__ if cls.__name__ in _PRE_NORM)


def _convert_bart(model, conversion, found=None):
    """A causal LM (its decoder's layers) or an encoder (found as a seq2seq model's part: the decoder,
    which attends to the encoder's states, stays as it is)."""
    encoder = _family_class(model) in _ENCODERS
    base = model if encoder else model.model.decoder  # (the causal LM's decoder wrapper holds the decoder)
    name, config, kind = type(model).__name__, base.config, "encoder" if encoder else "decoder"
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no {kind} layers")
    _require_hosted_layer_loop(name)
    require_layer_parts(base.layers, _LAYER_PARTS if encoder else _LAYER_PARTS | _CROSS_ATTENTION_PARTS, name)
    # TrOCR's and MVP's loops read each layer's output as outputs[0] (the stand-ins then return a tuple)
    tuples = _loop_source_matches(base, rf"(\w+) = {kind}_layer\((?:.|\n)*?hidden_states = \1\[0\]")
    if not tuples:
        _require_layer_loop(base, rf"hidden_states = {kind}_layer\(",
                            f"take each layer's output as the next hidden states (hidden_states = {kind}_layer(...))")
    if getattr(base, "layerdrop", 0.0):
        raise NotImplementedError(f"revify: {name} with {kind}_layerdrop={base.layerdrop} skips layers at random "
                                  f"in training, where a reversible stack runs every layer: set {kind}_layerdrop=0")
    if getattr(config, "use_prompt", False):  # MVP's prompts: each layer its own, which no half is given
        raise NotImplementedError(f"revify: {name} with use_prompt=True gives each layer prompts of its own: "
                                  f"not supported")
    host = _HostBartEncoder if encoder else _HostOPTDecoder
    if not _PRE_NORM[_family_class(model)]:  # post-norm: the whole layer as one half
        require_whole_layer_mode(conversion, name)
        for block in base.layers:
            block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False, attention="self_attn")
        _convert_hosted_layers(model, base, "layers", conversion, (_PostNormBlock, _PostNormOrdinaryBlock), host,
                               layer_tuples=tuples)
        return
    for block in base.layers:  # the layer's own modules, the model's mask (alone, a half refuses)
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _probe_layers(base, name, base.layers, (_OPTAttentionHalf, _OPTMlpHalf),
                  _encoder_layer_inputs if encoder else _causal_layer_inputs(base),
                  "OPT's pre-norm layer" + ("" if encoder else " (its cross-attention not run)"))
    _convert_hosted_layers(model, base, "layers", conversion, (_HostOPTBlock, _HostOPTOrdinaryBlock), host,
                           layer_tuples=tuples)


def _pickled(module: str, causal_lm: str | None, encoder: str | None, pre_norm: bool) -> dict:
    blocks = (_HostOPTBlock, _HostOPTOrdinaryBlock) if pre_norm else (_PostNormBlock, _PostNormOrdinaryBlock)
    module = f"transformers.models.{module}.modeling_{module}"
    out = {}
    if causal_lm:
        prefix = causal_lm[:-len("ForCausalLM")]
        out.update(_pickled_host_classes(module, f"{prefix}DecoderLayer", blocks, f"{prefix}Decoder", _HostOPTDecoder))
    if encoder:
        out.update(_pickled_host_classes(module, f"{encoder}Layer", blocks, encoder, _HostBartEncoder))
    return out


FAMILY = Family("bart", ("the BART lineage's decoders as causal LMs without an encoder (MBartForCausalLM, "
                         "PegasusForCausalLM, BlenderbotForCausalLM, BigBirdPegasusForCausalLM, WhisperForCausalLM: "
                         "pre-norm layers; BartForCausalLM, MarianForCausalLM, BlenderbotSmallForCausalLM, "
                         "TrOCRForCausalLM, MvpForCausalLM, PLBartForCausalLM: post-norm layers under "
                         "preserve='meft1' / 'meft2', the whole layer one half), and the encoders of its seq2seq "
                         "models (BART, mBART, Pegasus, Marian, Blenderbot, Blenderbot-Small, PLBart, M2M100: "
                         "any head; the decoder, attending to the encoder's states, stays as it is)",),
                _convert_bart, halves="library",
                classes=tuple(("transformers", name) for _, causal_lm, encoder, _ in _MODELS
                              for name in (causal_lm, encoder) if name),
                pickled={name: entry for model in _MODELS for name, entry in _pickled(*model).items()})
