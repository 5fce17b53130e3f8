"""Hugging Face OPT (``OPTForCausalLM``, ``OPTModel``) with pre-norm layers (``do_layer_norm_before``,
every OPT but the 350M one): ``x + dropout(self_attn(self_attn_layer_norm(x)))``, then
``h + dropout(fc2(activation_fn(fc1(final_layer_norm(h)))))``, learned positions added before the
layer loop. Both halves run the layer's own modules (its attention with the library's mask and, while
decoding, its cache), run through the library's own forward (``model.decoder``). Post-norm layers
(``do_layer_norm_before=False``: OPT-350M) convert under ``preserve="meft1"`` / ``"meft2"``, the
whole layer one half (convert.postnorm)."""
from __future__ import annotations

from .core import Family, LayerSpec, _dropout, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .postnorm import _PostNormBlock, _PostNormOrdinaryBlock, require_whole_layer_mode


def _branch_dropout(block):
    """OPT's dropout on each branch's output (``F.dropout(h, p=block.dropout)``, the layer's training flag)."""
    return _dropout(block.dropout, block.training)


class _OPTAttentionHalf(_LibraryAttentionHalf):
    def _attention_norm(self):
        return self.block.self_attn_layer_norm

    def _branch_dropout(self):
        return _branch_dropout(self.block)


class _OPTMlpHalf(_LibraryHalf):
    def _modules(self, x):
        b = self.block
        x = self._input(x, b.final_layer_norm.weight)
        return _branch_dropout(b)(b.fc2(b.activation_fn(b.fc1(b.final_layer_norm(x)))))


_HostOPTBlock, _HostOPTOrdinaryBlock = _host_block_mixins((_OPTAttentionHalf, _OPTMlpHalf))


class _HostOPTDecoder(_HostDecoderModel):
    """OPTDecoder: its layers are ``layers``, learned positions are added before the loop."""

    _rope = False


def _convert_opt(model, conversion, found=None):
    inner = getattr(model, "model", model)
    base = getattr(inner, "decoder", inner)
    name, config = type(model).__name__, base.config
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no decoder layers")
    _require_hosted_layer_loop(name)
    if config.layerdrop:
        raise NotImplementedError(f"revify: {name} with layerdrop={config.layerdrop} skips layers at random in "
                                  f"training, where a reversible stack runs every layer: set layerdrop=0")
    if not config.do_layer_norm_before:  # OPT-350M: the whole layer as one half (meft1 / meft2)
        require_whole_layer_mode(conversion, f"{name} with do_layer_norm_before=False")
        for block in base.layers:
            block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False, attention="self_attn")
        _convert_hosted_layers(model, base, "layers", conversion, (_PostNormBlock, _PostNormOrdinaryBlock),
                               _HostOPTDecoder)
        return
    for block in base.layers:  # the layer's own modules, the model's mask (alone, a half refuses)
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _convert_hosted_layers(model, base, "layers", conversion, (_HostOPTBlock, _HostOPTOrdinaryBlock),
                           _HostOPTDecoder)


_MODULE = "transformers.models.opt.modeling_opt"
FAMILY = Family("opt", ("transformers OPTForCausalLM / OPTModel (pre-norm layers; post-norm ones under "
                        "preserve='meft1' / 'meft2', the whole layer one half)",), _convert_opt, halves="library",
                classes=(("transformers", "OPTForCausalLM"), ("transformers", "OPTModel")),
                pickled={**_pickled_host_classes(_MODULE, "OPTDecoderLayer", (_HostOPTBlock, _HostOPTOrdinaryBlock),
                                                 "OPTDecoder", _HostOPTDecoder),
                         **_pickled_host_classes(_MODULE, "OPTDecoderLayer", (_PostNormBlock, _PostNormOrdinaryBlock),
                                                 "OPTDecoder", _HostOPTDecoder)})
