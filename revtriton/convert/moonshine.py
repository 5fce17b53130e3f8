"""Hugging Face Moonshine's decoder (``MoonshineDecoder``: inside ``MoonshineForConditionalGeneration`` and
``MoonshineModel``, found as their part; the encoder's layers have LLaMA's parts and convert by LLaMA's
conventions) and Moonshine Streaming's (``MoonshineStreamingDecoder``, its layers the same). Its pre-norm
layers run three branches: ``h = x + self_attn(input_layernorm(x))`` (RoPE, causal), given an encoder's
states ``h = h + encoder_attn(post_attention_layernorm(h), encoder states)``, then
``h + mlp(final_layernorm(h))`` (a gated MLP). F is the self-attention then the cross-attention on
the sum, as the BART lineage's decoders (convert.bart): the conditioning carries the encoder's states
and their mask, so their gradient reaches the encoder; G the MLP. Both run the layer's own modules (the
library path), with the model's masks, rotary embedding and, while decoding, its cache (the
cross-attention's keys and values computed once)."""
from __future__ import annotations

from .core import Family, LayerSpec, _host_block_mixins, _LibraryMlpHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _first, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .llama import _HostLlamaBlock, _HostLlamaOrdinaryBlock
from .probe import _require_layer_loop, require_layer_parts

_MODULE = "transformers.models.moonshine.modeling_moonshine"
_STREAMING_MODULE = "transformers.models.moonshine_streaming.modeling_moonshine_streaming"

_LAYER_PARTS = {"self_attn", "encoder_attn", "mlp", "input_layernorm", "post_attention_layernorm", "final_layernorm"}


class _MoonshineAttentionHalf(_LibraryAttentionHalf):
    """The self-attention branch, then, given an encoder's states, the cross-attention branch on the sum,
    so that ``x + F(x)`` is the layer's state before its MLP."""

    def _attention_norm(self):
        return self.block.input_layernorm

    def _library_call(self, x, host, extra):
        attended = super()._library_call(x, host, extra)
        states = host.layer_tensors.get("encoder_hidden_states")
        if states is None:  # (a decoder called without an encoder's states: the library skips the branch)
            return attended
        b = self.block
        h = self._input(x, b.post_attention_layernorm.weight) + attended
        out = b.encoder_attn(hidden_states=b.post_attention_layernorm(h), key_value_states=states,
                             attention_mask=host.layer_tensors.get("encoder_attention_mask"), **extra)
        return attended + _first(out)


class _MoonshineMlpHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "final_layernorm", "mlp"
    rows_independent = True  # each token's output from its own row (ReversibleStack token_chunk)


_HostMoonshineBlock, _HostMoonshineOrdinaryBlock = _host_block_mixins((_MoonshineAttentionHalf, _MoonshineMlpHalf))


class _HostMoonshineDecoder(_HostDecoderModel):
    """MoonshineDecoder: token ids in, RoPE from position ids, a cache while decoding, an encoder's states
    for its layers' cross-attention."""

    _cross_attention = True


def _convert_moonshine(model, conversion, found=None):
    name = type(model).__name__
    if not len(model.layers):
        raise ValueError(f"revify: {name} has no decoder layers")
    _require_hosted_layer_loop(name)
    require_layer_parts(model.layers, _LAYER_PARTS, "Moonshine's decoder")
    _require_layer_loop(model, r"hidden_states = decoder_layer\(",
                        "take each layer's output as the next hidden states (hidden_states = decoder_layer(...))")
    for block in model.layers:  # the layer's own modules, the model's masks (alone, a half refuses)
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _convert_hosted_layers(model, model, "layers", conversion, (_HostMoonshineBlock, _HostMoonshineOrdinaryBlock),
                           _HostMoonshineDecoder)


FAMILY = Family("moonshine", ("transformers Moonshine's decoder (MoonshineDecoder, the decoder of "
                              "MoonshineForConditionalGeneration / MoonshineModel, with its cross-attention; the "
                              "encoder: by LLaMA's layer conventions), and Moonshine Streaming's "
                              "(MoonshineStreamingDecoder)",), _convert_moonshine,
                halves="library", classes=(("transformers", "MoonshineDecoder"),
                                           ("transformers", "MoonshineStreamingDecoder")),
                pickled={**_pickled_host_classes(_MODULE, "MoonshineDecoderLayer",
                                                 (_HostMoonshineBlock, _HostMoonshineOrdinaryBlock),
                                                 "MoonshineDecoder", _HostMoonshineDecoder),
                         # the encoder's classes, which LLaMA's conventions make (their names are not
                         # LLaMA's DecoderLayer / Model, which a fresh process finds by pattern)
                         **_pickled_host_classes(_MODULE, "MoonshineEncoderLayer",
                                                 (_HostLlamaBlock, _HostLlamaOrdinaryBlock), "MoonshineEncoder",
                                                 _HostDecoderModel),
                         **_pickled_host_classes(_STREAMING_MODULE, "MoonshineStreamingDecoderLayer",
                                                 (_HostMoonshineBlock, _HostMoonshineOrdinaryBlock),
                                                 "MoonshineStreamingDecoder", _HostMoonshineDecoder)})
