"""Hugging Face BLOOM (``BloomForCausalLM``, ``BloomModel`` and its other heads): pre-norm layers
``h = x + dropout(self_attention(input_layernorm(x)))``, then ``h + dropout(mlp(post_attention_layernorm(h)))``,
with ALiBi: the model builds the biases from the attention mask before its layer loop and hands them
to every layer (the conditioning carries them beside the mask). BLOOM's attention and MLP modules
add the residual themselves (their ``residual`` argument, after the branch's dropout): each half
passes a zero residual, so that the module returns its branch alone. Both halves run the layer's
own modules (the library path: the attention with the library's mask, ALiBi and, while decoding,
its cache). Layers with ``apply_residual_connection_post_layernorm`` add the norm's output, not the
layer's input, back: not an additive residual of the input, so they convert only under
``preserve="meft1"`` / ``"meft2"``, the whole layer one half (convert.postnorm), as post-norm layers do."""
from __future__ import annotations

from .core import Family, LayerSpec, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _first, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .postnorm import _PostNormBlock, _PostNormOrdinaryBlock, require_whole_layer_mode
from .probe import _check_block_loop


def _no_residual(x):
    """The ``residual`` BLOOM's modules add to their branch: a zero (it broadcasts, allocates nothing)."""
    return x.new_zeros(())


class _BloomAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.self_attention

    def _attention_norm(self):
        return self.block.input_layernorm

    def _library_call(self, x, host, extra: dict):
        """The layer's norm and attention with the model's mask and ALiBi (and, while decoding, its cache);
        the attention's dropout and residual add are its own, the residual zero."""
        norm = self.block.input_layernorm
        x = self._input(x, norm.weight)
        out = self.block.self_attention(norm(x), _no_residual(x), alibi=host.layer_tensors["alibi"],
                                        attention_mask=host.mask_for(self.block), **extra)
        return _first(out)


class _BloomMlpHalf(_LibraryHalf):
    def _modules(self, x):
        b = self.block
        x = self._input(x, b.post_attention_layernorm.weight)
        return b.mlp(b.post_attention_layernorm(x), _no_residual(x))


_HostBloomBlock, _HostBloomOrdinaryBlock = _host_block_mixins((_BloomAttentionHalf, _BloomMlpHalf))


class _HostBloomModel(_HostDecoderModel):
    """BloomModel: its layers are ``h``; ALiBi from the attention mask (no position ids, no RoPE)."""

    _layers = "h"
    _rope = False


def _convert_bloom(model, conversion, found=None):
    base = getattr(model, "transformer", model)
    name, config = type(model).__name__, base.config
    if not len(base.h):
        raise ValueError(f"revify: {name} has no layers")
    _require_hosted_layer_loop(name)
    tuples = _check_block_loop(base, tuples=True)  # transformers 5's loop reads outputs[0]
    if config.apply_residual_connection_post_layernorm:  # the whole layer as one half (meft1 / meft2)
        require_whole_layer_mode(conversion, f"{name} with apply_residual_connection_post_layernorm=True",
                                 "layers that add each norm's output back, not their input")
        for block in base.h:
            block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False, attention="self_attention")
        _convert_hosted_layers(model, base, "h", conversion, (_PostNormBlock, _PostNormOrdinaryBlock),
                               _HostBloomModel, layer_tuples=tuples)
        return
    for block in base.h:  # the layer's own modules, the model's mask and ALiBi (alone, a half refuses)
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _convert_hosted_layers(model, base, "h", conversion, (_HostBloomBlock, _HostBloomOrdinaryBlock), _HostBloomModel,
                           layer_tuples=tuples)


_MODULE = "transformers.models.bloom.modeling_bloom"
_CLASSES = ("BloomForCausalLM", "BloomModel", "BloomForSequenceClassification", "BloomForTokenClassification",
            "BloomForQuestionAnswering")
FAMILY = Family("bloom", ("transformers BloomForCausalLM / BloomModel and its other heads (ALiBi; layers adding their "
                          "norm's output back under preserve='meft1' / 'meft2', the whole layer one half)",),
                _convert_bloom,
                halves="library", classes=tuple(("transformers", name) for name in _CLASSES),
                pickled={**_pickled_host_classes(_MODULE, "BloomBlock", (_HostBloomBlock, _HostBloomOrdinaryBlock),
                                                 "BloomModel", _HostBloomModel),
                         **_pickled_host_classes(_MODULE, "BloomBlock", (_PostNormBlock, _PostNormOrdinaryBlock),
                                                 "BloomModel", _HostBloomModel)})
