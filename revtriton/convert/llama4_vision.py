"""Llama 4's vision tower (``Llama4VisionModel``, the ``vision_model`` of ``Llama4ForConditionalGeneration``,
found as its part): pre-norm layers ``x + self_attn(input_layernorm(x))`` then
``h + mlp(post_attention_layernorm(h))`` over each tile's patches and class token, the attention with the
tower's 2-D rotary frequencies (``freqs_ci``, complex) and no mask. Its loop is ``model``
(``Llama4VisionEncoder``), which hands every layer the frequencies and reads ``outputs[0]``; the
conditioning carries the frequencies as the rotary embedding, and both halves run the layer's own modules."""
from __future__ import annotations

from .core import Family, _LibraryMlpHalf, _pickled_host_classes
from .host import (_blocks_renaming_a_loop_input, _convert_library_tower, _first, _HostTowerModel,
                   _LibraryAttentionHalf)

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


class _Llama4VisionAttentionHalf(_LibraryAttentionHalf):
    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.input_layernorm.weight)
        return _first(b.self_attn(b.input_layernorm(x), freqs_ci=host.rotary_for(b), attention_mask=host.mask_for(b)))


class _Llama4VisionMlpHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "post_attention_layernorm", "mlp"


# The loop hands each layer the tower's rotary frequencies as freqs_ci: the conditioning's rotary embedding.
_HostLlama4VisionBlock, _HostLlama4VisionOrdinaryBlock = _blocks_renaming_a_loop_input(
    (_Llama4VisionAttentionHalf, _Llama4VisionMlpHalf), "freqs_ci", "position_embeddings", "_HostLlama4Vision")


class _HostLlama4VisionEncoder(_HostTowerModel):
    """Llama4VisionEncoder (the tower's loop): no mask, the tower's rotary frequencies."""


def _convert_llama4_vision(model, conversion, found=None):
    _convert_library_tower(model, model.model, "layers", _LAYER_PARTS, conversion,
                           (_HostLlama4VisionBlock, _HostLlama4VisionOrdinaryBlock), _HostLlama4VisionEncoder,
                           layer_tuples=True)


_MODULE = "transformers.models.llama4.modeling_llama4"
FAMILY = Family("llama4_vision", ("transformers Llama4VisionModel: Llama 4's vision tower (its 2-D rotary "
                                  "frequencies, complex, handed to every layer)",),
                _convert_llama4_vision, halves="library", classes=(("transformers", "Llama4VisionModel"),),
                pickled=_pickled_host_classes(_MODULE, "Llama4VisionEncoderLayer", (_HostLlama4VisionBlock,
                                                                                    _HostLlama4VisionOrdinaryBlock),
                                              "Llama4VisionEncoder", _HostLlama4VisionEncoder))
