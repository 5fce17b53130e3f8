"""The audio towers of Qwen2.5-Omni, Qwen3-Omni and Qwen3-ASR (``Qwen2_5OmniAudioEncoder``,
``Qwen3OmniMoeAudioEncoder``, ``Qwen3ASREncoder``, found as the ``audio_tower`` of their models): Whisper's
layer parts (``x + self_attn(self_attn_layer_norm(x))``, then ``h + fc2(act(fc1(final_layer_norm(h))))``)
over every audio chunk's frames packed in one row (``[frames, dim]``), each chunk attending to itself: the
loop hands every layer the chunks' boundaries (``cu_seqlens``, carried as the conditioning's mask) and the
longest one's length (``max_seqlen``), and reads ``outputs[0]``. These layers apply no dropout in their
forward (whatever the config's rates), so neither do the halves: the attention runs the layer's own module,
the MLP the fused kernels where they compute it. The fp16 clamp after each layer has no reversible form:
the halves leave it out, as Whisper's (convert.whisper)."""
from __future__ import annotations

from dataclasses import replace

from .core import Family, LayerSpec, _HF_ACTIVATIONS, _pickled_models
from .host import (_blocks_renaming_a_loop_input, _convert_library_tower, _first, _HostTowerModel,
                   _LibraryAttentionHalf)
from .whisper import _LAYER_PARTS, _WhisperMlpHalf


class _PackedAudioAttentionHalf(_LibraryAttentionHalf):
    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.self_attn_layer_norm.weight)
        return _first(b.self_attn(hidden_states=b.self_attn_layer_norm(x), cu_seqlens=host.mask_for(b),
                                  max_seqlen=host.max_seqlen_for(b)))


class _PackedAudioMlpHalf(_WhisperMlpHalf):
    def _dropouts(self):
        return 0.0, 0.0  # (the layers' forward applies none)

    def _modules(self, x):
        b = self.block
        return b.fc2(b.activation_fn(b.fc1(b.final_layer_norm(self._input(x, b.final_layer_norm.weight)))))


_HostPackedAudioBlock, _HostPackedAudioOrdinaryBlock = _blocks_renaming_a_loop_input(
    (_PackedAudioAttentionHalf, _PackedAudioMlpHalf), "cu_seqlens", "attention_mask", "_HostPackedAudio")


class _HostPackedAudioEncoder(_HostTowerModel):
    """A packed audio tower (its loop over ``layers``): the chunks' boundaries and longest length its own."""


def _convert_qwen_audio(model, conversion, found=None):
    activation = _HF_ACTIVATIONS.get(model.config.activation_function)
    specs = [replace(LayerSpec(fused_attention=False), activation=activation) for _ in model.layers]
    _convert_library_tower(model, model, "layers", _LAYER_PARTS, conversion,
                           (_HostPackedAudioBlock, _HostPackedAudioOrdinaryBlock), _HostPackedAudioEncoder, specs,
                           layer_tuples=True)


# (transformers module, layer class, encoder class)
_ENCODERS = (("qwen2_5_omni", "Qwen2_5OmniAudioEncoderLayer", "Qwen2_5OmniAudioEncoder"),
             ("qwen3_omni_moe", "Qwen3OmniMoeAudioEncoderLayer", "Qwen3OmniMoeAudioEncoder"),
             ("qwen3_asr", "Qwen3ASRAudioEncoderLayer", "Qwen3ASREncoder"))
FAMILY = Family("qwen_audio", ("the audio towers of transformers Qwen2.5-Omni, Qwen3-Omni and Qwen3-ASR: Whisper's "
                               "layers over the audio chunks' frames packed in one row",),
                _convert_qwen_audio, classes=tuple(("transformers", encoder) for *_, encoder in _ENCODERS),
                pickled=_pickled_models((_HostPackedAudioBlock, _HostPackedAudioOrdinaryBlock),
                                        ((*encoder, _HostPackedAudioEncoder) for encoder in _ENCODERS)))
