"""Hugging Face Whisper's audio encoder (``WhisperEncoder``: inside ``WhisperForConditionalGeneration``,
``WhisperModel`` and ``WhisperForAudioClassification``, found as their part), and the audio towers of
the audio-language models with its layers (Qwen2-Audio's, Voxtral's, Audio Flamingo 3's and Music
Flamingo's: ``Qwen2AudioEncoder``, ``VoxtralEncoder``, ``AudioFlamingo3Encoder``): pre-norm layers,
``x + dropout(attention(self_attn_layer_norm(x)))`` then ``h + dropout(fc2(act(fc1(final_layer_norm(h)))))``,
run through the library's own forward. The decoder is the BART lineage's (convert.bart). The
fused kernels compute the attention (its key projection has no bias: a zero one) and a GELU / ReLU
MLP; dropout in training runs the layer's own modules. Whisper's fp16 clamp after each layer has no
reversible form: the halves leave it out (it only acts on values past fp16's range)."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..halves.base import parameter
from ..ops.attention import norm_attention_couple
from .core import (Family, LayerSpec, _HF_ACTIVATIONS, _host_block_mixins, _NormMlpHalf, _parts,
                   _pickled_host_classes)
from .host import _convert_hosted_layers, _first, _HostDecoderModel, _ProjectedAttentionHalf
from .probe import require_layer_parts

_LAYER_PARTS = {"self_attn", "self_attn_layer_norm", "fc1", "activation_fn", "fc2", "final_layer_norm"}
# The encoders with Whisper's layers, by class: (the library's module, their layer class).
_ENCODERS = {"WhisperEncoder": ("whisper", "WhisperEncoderLayer"),
             "Qwen2AudioEncoder": ("qwen2_audio", "Qwen2AudioEncoderLayer"),
             "VoxtralEncoder": ("voxtral", "VoxtralEncoderLayer"),
             "AudioFlamingo3Encoder": ("audioflamingo3", "AudioFlamingo3EncoderLayer")}


def _dropout(x, p, training):
    return nn.functional.dropout(x, p=p, training=training) if training and p > 0 else x


class _WhisperAttentionHalf(_ProjectedAttentionHalf):
    # (the library's mask: None, Whisper's encoder masks nothing)
    _norm_name, _attention_name = "self_attn_layer_norm", "self_attn"

    def _dropouts(self):
        return float(self._attention_module().dropout or 0.0), float(self.block.dropout or 0.0)

    couple_op = norm_attention_couple

    def operands(self, x, layout=None):  # (an audio encoder's rows carry no token layout)
        norm, a = self._attention_norm(), self._attention_module()
        q, k, v, out = self._projections()
        q_bias, v_bias = parameter(q, "bias"), parameter(v, "bias")
        w_qkv = torch.cat([parameter(q, "weight"), parameter(k, "weight"), parameter(v, "weight")])
        b_qkv = torch.cat([q_bias, torch.zeros_like(q_bias), v_bias])  # the key projection has no bias
        return ((parameter(norm, "weight"), parameter(norm, "bias"), w_qkv, b_qkv, parameter(out, "weight"),
                 parameter(out, "bias")), dict(heads=a.num_heads, causal=False, norm="layer", eps=norm.eps))

    def _fuses(self, x, host) -> bool:
        """Where no mask reaches the layers: Audio Flamingo 3's encoder masks its padded frames (a mask it
        makes from ``input_features_mask``), which only the library's attention sees."""
        return super()._fuses(x, host) and host.mask_for(self.block) is None

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.self_attn_layer_norm.weight)
        out = _first(b.self_attn(hidden_states=b.self_attn_layer_norm(x), attention_mask=host.mask_for(b), **extra))
        return _dropout(out, b.dropout, b.training)

    def _modules(self, x):
        b = self.block
        out = _first(b.self_attn(hidden_states=b.self_attn_layer_norm(self._input(x, b.self_attn_layer_norm.weight))))
        return _dropout(out, b.dropout, b.training)


class _WhisperMlpHalf(_NormMlpHalf):
    def _mlp_norm(self):
        return _parts(self.block)["final_layer_norm"]

    def _projections(self):
        b = _parts(self.block)
        return b["fc1"], b["fc2"]

    def _dropouts(self):
        return float(self.block.activation_dropout or 0.0), float(self.block.dropout or 0.0)

    def _modules(self, x):
        b = self.block
        h = b.activation_fn(b.fc1(b.final_layer_norm(self._input(x, b.final_layer_norm.weight))))
        return _dropout(b.fc2(_dropout(h, b.activation_dropout, b.training)), b.dropout, b.training)


_HostWhisperBlock, _HostWhisperOrdinaryBlock = _host_block_mixins((_WhisperAttentionHalf, _WhisperMlpHalf))


class _HostWhisperEncoder(_HostDecoderModel):
    """WhisperEncoder: mel features in, no cache; its last hidden state, and the last of its hidden
    states, are its final layer norm's."""

    _rope, _tokens_input, _caches = False, False, False


def _convert_whisper(model, conversion, found=None):
    config, layers = model.config, model.layers
    if not len(layers):
        raise ValueError(f"revify: {type(model).__name__} has no layers")
    if float(getattr(config, "encoder_layerdrop", 0.0) or 0.0) > 0:
        raise NotImplementedError(f"revify: {type(model).__name__} with encoder_layerdrop="
                                  f"{config.encoder_layerdrop}: a reversible stack runs every layer (set it to 0)")
    require_layer_parts(layers, _LAYER_PARTS, "Whisper's encoder")
    attention = layers[0].self_attn
    spec = LayerSpec(fused_attention=(attention.head_dim * attention.num_heads == config.d_model
                                      and abs(float(attention.scaling) - attention.head_dim**-0.5) <= 1e-12),
                     activation=_HF_ACTIVATIONS.get(config.activation_function))
    for layer in layers:
        layer._revtriton_spec = replace(spec)
    _convert_hosted_layers(model, model, "layers", conversion, (_HostWhisperBlock, _HostWhisperOrdinaryBlock),
                           _HostWhisperEncoder)


FAMILY = Family("whisper", ("transformers Whisper's audio encoder (WhisperEncoder, the encoder of "
                            "WhisperForConditionalGeneration / WhisperModel / WhisperForAudioClassification; "
                            "the decoder: the bart family), and the audio towers with its layers of Qwen2-Audio, "
                            "Voxtral, Audio Flamingo 3 and Music Flamingo",), _convert_whisper,
                classes=tuple(("transformers", name) for name in _ENCODERS),
                pickled={name: entry for encoder, (module, layer) in _ENCODERS.items()
                         for name, entry in _pickled_host_classes(f"transformers.models.{module}.modeling_{module}",
                                                                  layer, (_HostWhisperBlock, _HostWhisperOrdinaryBlock),
                                                                  encoder, _HostWhisperEncoder).items()})
