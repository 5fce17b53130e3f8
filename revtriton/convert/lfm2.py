"""Hugging Face LFM2 (``Lfm2ForCausalLM``, ``Lfm2Model``) and LFM2-MoE: hybrid decoders whose pre-norm
layers run one of two operators, attention or a gated short convolution (``config.layer_types``:
``full_attention`` / ``conv``): ``h = x + operator(operator_norm(x))``, then ``h + feed_forward(ffn_norm(h))``.
Both halves run the layer's own modules (the library path): the operator with the model's mask of its
kind (the attention's causal mask, the convolution's padding mask, ``create_recurrent_attention_mask``)
and rotary embedding and, while decoding, its cache (the attention's keys and values, the convolution's
state). The convolution mixes each token with the ``conv_L_cache - 1`` before it: its layers keep whole
samples together, as attention's do (``ReversibleStack(token_chunk=...)``)."""
from __future__ import annotations

from .core import Family, LayerSpec, _host_block_mixins, _LibraryMlpHalf, _parts, _pickled_models
from .host import _convert_hosted_layers, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .probe import _check_layer_slice, require_layer_parts

_SHARED_PARTS = {"feed_forward", "operator_norm", "ffn_norm"}


def _is_attention_layer(block) -> bool:
    return "self_attn" in _parts(block)


class _Lfm2OperatorHalf(_LibraryAttentionHalf):
    """The layer's operator on its normalised input: its attention (the library's attention call: mask,
    rotary embedding, position ids) or its short convolution (the padding mask: padded positions are
    zeroed before the convolution reads them)."""

    def _attention_module(self):
        parts = _parts(self.block)
        return parts["self_attn"] if "self_attn" in parts else parts["conv"]

    def _attention_norm(self):
        return self.block.operator_norm

    def _library_call(self, x, host, extra: dict):
        if _is_attention_layer(self.block):
            return super()._library_call(x, host, extra)
        b = self.block
        x = self._input(x, b.operator_norm.weight)
        return b.conv(hidden_states=b.operator_norm(x), attention_mask=host.mask_for(b), **extra)


class _Lfm2FeedForwardHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "ffn_norm", "feed_forward"
    rows_independent = True  # each token's output from its own row (ReversibleStack token_chunk)


_HostLfm2Block, _HostLfm2OrdinaryBlock = _host_block_mixins((_Lfm2OperatorHalf, _Lfm2FeedForwardHalf))


def _convert_lfm2(model, conversion, found=None):
    base = getattr(model, "model", model)
    name = type(model).__name__
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no decoder layers")
    _require_hosted_layer_loop(name)
    _check_layer_slice(base)
    attention = [block for block in base.layers if _is_attention_layer(block)]
    convolution = [block for block in base.layers if not _is_attention_layer(block)]
    for blocks, operator in ((attention, "self_attn"), (convolution, "conv")):
        if blocks:
            require_layer_parts(blocks, _SHARED_PARTS | {operator}, "LFM2")
    for block in base.layers:
        # The mask of the layer's kind: the model's causal mask for attention, its padding mask for the
        # convolution (the conditioning tells two kinds apart by a window, which no kernel reads here).
        window = None if _is_attention_layer(block) else block.conv.conv_kernel_size
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False, window=window)
    _convert_hosted_layers(model, base, "layers", conversion, (_HostLfm2Block, _HostLfm2OrdinaryBlock),
                           _HostDecoderModel)


FAMILY = Family("lfm2", ("transformers Lfm2ForCausalLM / Lfm2Model and the LFM2-MoE equivalents (attention and "
                         "short-convolution layers)",), _convert_lfm2,
                halves="library", classes=tuple(("transformers", f"{prefix}{kind}") for prefix in ("Lfm2", "Lfm2Moe")
                                                for kind in ("ForCausalLM", "Model")),
                pickled=_pickled_models((_HostLfm2Block, _HostLfm2OrdinaryBlock),
                                        [("lfm2", "Lfm2DecoderLayer", "Lfm2Model", _HostDecoderModel),
                                         ("lfm2_moe", "Lfm2MoeDecoderLayer", "Lfm2MoeModel", _HostDecoderModel)]))
