"""Hugging Face OPT (``OPTForCausalLM``, ``OPTModel``) with pre-norm layers (``do_layer_norm_before``,
every OPT but the 350M one): ``x + dropout(self_attn(self_attn_layer_norm(x)))``, then
``h + dropout(fc2(activation_fn(fc1(final_layer_norm(h)))))``, learned positions added before the
layer loop. Both halves run the layer's own modules (its attention with the library's mask and, while
decoding, its cache), run through the library's own forward (``model.decoder``). Post-norm layers
(``do_layer_norm_before=False``: OPT-350M) convert under ``preserve="meft1"`` / ``"meft2"``, the
whole layer one half (convert.postnorm). XGLM and BioGPT have OPT's pre-norm layers (the same parts,
a dropout after the activation too: ``activation_dropout``), sinusoidal or learned positions added
before their loops; their layers' cross-attention (XGLM's ``add_cross_attention``) is refused."""
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
        inner = _dropout(getattr(b, "activation_dropout", 0.0), b.training)  # (XGLM's, BioGPT's; OPT has none)
        return _branch_dropout(b)(b.fc2(inner(b.activation_fn(b.fc1(b.final_layer_norm(x))))))


_HostOPTBlock, _HostOPTOrdinaryBlock = _host_block_mixins((_OPTAttentionHalf, _OPTMlpHalf))


class _HostOPTDecoder(_HostDecoderModel):
    """OPTDecoder: its layers are ``layers``, learned positions are added before the loop."""

    _rope = False


def _decoder_of(model):
    """The module whose ``layers`` the model's loop runs: OPT's ``model.decoder`` (``decoder`` of an
    OPTModel, as a sequence classifier's part), XGLM's ``model``, BioGPT's ``biogpt``, or the model itself
    (a base model)."""
    for path in ("model.decoder", "decoder", "model", "biogpt"):
        try:
            found = model.get_submodule(path)
        except AttributeError:
            continue
        if hasattr(found, "layers"):
            return found
    return model


def _convert_opt(model, conversion, found=None):
    base = _decoder_of(model)
    name, config = type(model).__name__, base.config
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no decoder layers")
    if any(hasattr(layer, "encoder_attn") for layer in base.layers):
        raise NotImplementedError(f"revify: {name}'s layers attend to an encoder's states (add_cross_attention): "
                                  f"cross-attention layers are not supported")
    _require_hosted_layer_loop(name)
    if config.layerdrop:
        raise NotImplementedError(f"revify: {name} with layerdrop={config.layerdrop} skips layers at random in "
                                  f"training, where a reversible stack runs every layer: set layerdrop=0")
    if not getattr(config, "do_layer_norm_before", True):  # OPT-350M: the whole layer as one half (meft1 / meft2)
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
# The models with OPT's pre-norm layers: (module, layer, the model its loop is in, classes revify takes).
_OPT_LIKE = (("xglm", "XGLMDecoderLayer", "XGLMModel", ("XGLMForCausalLM", "XGLMModel")),
             ("biogpt", "BioGptDecoderLayer", "BioGptModel", ("BioGptForCausalLM", "BioGptModel",
                                                               "BioGptForSequenceClassification",
                                                               "BioGptForTokenClassification")))
FAMILY = Family("opt", ("transformers OPTForCausalLM / OPTModel (pre-norm layers; post-norm ones under "
                        "preserve='meft1' / 'meft2', the whole layer one half), and the models with OPT's pre-norm "
                        "layers: XGLM (XGLMForCausalLM / XGLMModel), BioGPT (its causal LM, base model, sequence "
                        "and token classifiers)",), _convert_opt, halves="library",
                classes=(("transformers", "OPTForCausalLM"), ("transformers", "OPTModel"),
                         *(("transformers", name) for *_, classes in _OPT_LIKE for name in classes)),
                pickled={**_pickled_host_classes(_MODULE, "OPTDecoderLayer", (_HostOPTBlock, _HostOPTOrdinaryBlock),
                                                 "OPTDecoder", _HostOPTDecoder),
                         **_pickled_host_classes(_MODULE, "OPTDecoderLayer", (_PostNormBlock, _PostNormOrdinaryBlock),
                                                 "OPTDecoder", _HostOPTDecoder),
                         **{name: entry for module, layer, base, _ in _OPT_LIKE
                            for name, entry in _pickled_host_classes(f"transformers.models.{module}.modeling_{module}",
                                                                     layer, (_HostOPTBlock, _HostOPTOrdinaryBlock),
                                                                     base, _HostOPTDecoder).items()}})
