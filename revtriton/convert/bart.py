"""The decoders of the BART lineage as causal LMs (``BartForCausalLM`` and its kin: MBart, Pegasus,
Blenderbot, BigBird-Pegasus and Whisper's decoder with pre-norm layers; BART, Marian, Blenderbot-Small,
TrOCR, MVP, PLBart with post-norm ones). Their layers have OPT's parts (``self_attn``,
``self_attn_layer_norm``, ``fc1``, ``fc2``, ``final_layer_norm``) and a cross-attention
(``encoder_attn``) that runs only when the model is given an encoder's states: a causal LM without them
computes OPT's layer, so the pre-norm ones run OPT's halves (checked on a probe at conversion) and the
post-norm ones convert under ``preserve="meft1"`` / ``"meft2"``, the whole layer one half
(convert.postnorm). A call with ``encoder_hidden_states`` is refused (the host model's input check); the
cross-attention's weights stay in the layer, unused, as they are in the library's causal LM without an
encoder."""
from __future__ import annotations

from .core import Family, LayerSpec, _pickled_host_classes
from .host import _convert_hosted_layers, _require_hosted_layer_loop
from .opt import _HostOPTBlock, _HostOPTDecoder, _HostOPTOrdinaryBlock, _OPTAttentionHalf, _OPTMlpHalf
from .postnorm import _PostNormBlock, _PostNormOrdinaryBlock, require_whole_layer_mode
from .probe import _causal_layer_inputs, _loop_source_matches, _probe_layers, _require_layer_loop, require_layer_parts

# (module, causal LM class, its layer class, the decoder class its loop is in, pre-norm layers)
_MODELS = (("bart", "BartForCausalLM", "BartDecoderLayer", "BartDecoder", False),
           ("mbart", "MBartForCausalLM", "MBartDecoderLayer", "MBartDecoder", True),
           ("pegasus", "PegasusForCausalLM", "PegasusDecoderLayer", "PegasusDecoder", True),
           ("marian", "MarianForCausalLM", "MarianDecoderLayer", "MarianDecoder", False),
           ("blenderbot", "BlenderbotForCausalLM", "BlenderbotDecoderLayer", "BlenderbotDecoder", True),
           ("blenderbot_small", "BlenderbotSmallForCausalLM", "BlenderbotSmallDecoderLayer",
            "BlenderbotSmallDecoder", False),
           ("bigbird_pegasus", "BigBirdPegasusForCausalLM", "BigBirdPegasusDecoderLayer", "BigBirdPegasusDecoder",
            True),
           ("trocr", "TrOCRForCausalLM", "TrOCRDecoderLayer", "TrOCRDecoder", False),
           ("mvp", "MvpForCausalLM", "MvpDecoderLayer", "MvpDecoder", False),
           ("plbart", "PLBartForCausalLM", "PLBartDecoderLayer", "PLBartDecoder", False),
           ("whisper", "WhisperForCausalLM", "WhisperDecoderLayer", "WhisperDecoder", True))
_PRE_NORM_LAYERS = {layer for _, _, layer, _, pre_norm in _MODELS if pre_norm}
# The parts of every layer: OPT's, and the cross-attention a causal LM without an encoder does not run.
_LAYER_PARTS = {"self_attn", "self_attn_layer_norm", "activation_fn", "fc1", "fc2", "final_layer_norm",
                "encoder_attn", "encoder_attn_layer_norm"}


def _convert_bart_decoder(model, conversion, found=None):
    base = model.model.decoder  # the causal LM's decoder wrapper holds the decoder its loop runs in
    name, config = type(model).__name__, base.config
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no decoder layers")
    _require_hosted_layer_loop(name)
    require_layer_parts(base.layers, _LAYER_PARTS, name)
    # TrOCR's and MVP's loops read each layer's output as outputs[0] (the stand-ins then return a tuple)
    tuples = _loop_source_matches(base, r"(\w+) = decoder_layer\((?:.|\n)*?hidden_states = \1\[0\]")
    if not tuples:
        _require_layer_loop(base, r"hidden_states = decoder_layer\(",
                            "take each layer's output as the next hidden states (hidden_states = decoder_layer(...))")
    if getattr(base, "layerdrop", 0.0):
        raise NotImplementedError(f"revify: {name} with decoder_layerdrop={base.layerdrop} skips layers at random "
                                  f"in training, where a reversible stack runs every layer: set decoder_layerdrop=0")
    if getattr(config, "use_prompt", False):  # MVP's prompts: each layer its own, which no half is given
        raise NotImplementedError(f"revify: {name} with use_prompt=True gives each layer prompts of its own: "
                                  f"not supported")
    if type(base.layers[0]).__name__ not in _PRE_NORM_LAYERS:  # post-norm: the whole layer as one half
        require_whole_layer_mode(conversion, name)
        for block in base.layers:
            block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False, attention="self_attn")
        _convert_hosted_layers(model, base, "layers", conversion, (_PostNormBlock, _PostNormOrdinaryBlock),
                               _HostOPTDecoder, layer_tuples=tuples)
        return
    for block in base.layers:  # the layer's own modules, the model's mask (alone, a half refuses)
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _probe_layers(base, name, base.layers, (_OPTAttentionHalf, _OPTMlpHalf), _causal_layer_inputs(base),
                  "OPT's pre-norm layer (its cross-attention not run)")
    _convert_hosted_layers(model, base, "layers", conversion, (_HostOPTBlock, _HostOPTOrdinaryBlock),
                           _HostOPTDecoder, layer_tuples=tuples)


def _pickled(module: str, layer: str, decoder: str, pre_norm: bool) -> dict:
    blocks = (_HostOPTBlock, _HostOPTOrdinaryBlock) if pre_norm else (_PostNormBlock, _PostNormOrdinaryBlock)
    return _pickled_host_classes(f"transformers.models.{module}.modeling_{module}", layer, blocks, decoder,
                                 _HostOPTDecoder)


FAMILY = Family("bart", ("the BART lineage's decoders as causal LMs without an encoder (MBartForCausalLM, "
                         "PegasusForCausalLM, BlenderbotForCausalLM, BigBirdPegasusForCausalLM, WhisperForCausalLM: "
                         "pre-norm layers; BartForCausalLM, MarianForCausalLM, BlenderbotSmallForCausalLM, "
                         "TrOCRForCausalLM, MvpForCausalLM, PLBartForCausalLM: post-norm layers under "
                         "preserve='meft1' / 'meft2', the whole layer one half)",),
                _convert_bart_decoder, halves="library",
                classes=tuple(("transformers", causal_lm) for _, causal_lm, *_ in _MODELS),
                pickled={name: entry for module, _, layer, decoder, pre_norm in _MODELS
                         for name, entry in _pickled(module, layer, decoder, pre_norm).items()})
