"""Hugging Face ViT (``ViTModel``, ``ViTForImageClassification``; transformers 5): a pre-norm
encoder of ``ViTLayer``, run through the library's own forward."""
from __future__ import annotations

from ..ops.attention import norm_attention_couple
from ..ops.mlp import norm_mlp_couple
from ..halves.base import parameter
from .core import (Family, _concatenated_qkv, _Half, _HF_ACTIVATIONS, _host_block_mixins, _p, _parts,
                   _pickled_host_classes)
from .host import _first, _convert_hosted_layers, _HostAttention, _HostDecoderModel


class _HFViTAttentionHalf(_Half):
    def _projections(self):
        a = _parts(_parts(self.block)["attention"])
        return a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"]

    def _dropouts(self):
        return float(self.block.attention.attention_dropout or 0.0), _p(self.block.dropout)

    couple_op = norm_attention_couple

    def operands(self, x, layout=None):  # (ViT's rows carry no token layout)
        b = _parts(self.block)
        norm, a = b["layernorm_before"], b["attention"]
        q, k, v, out = self._projections()
        w_qkv, b_qkv = _concatenated_qkv(q, k, v)
        return ((parameter(norm, "weight"), parameter(norm, "bias"), w_qkv, b_qkv, parameter(out, "weight"),
                 parameter(out, "bias")), dict(heads=a.num_attention_heads, causal=False, norm="layer", eps=norm.eps))

    def _modules(self, x):
        b = self.block
        return b.dropout(b.attention(b.layernorm_before(self._input(x, b.layernorm_before.weight)))[0])


class _HFViTMlpHalf(_Half):
    rows_independent = True  # each token's MLP output from its own row (ReversibleStack token_chunk)

    def _projections(self):
        m = _parts(_parts(self.block)["mlp"])
        return m["fc1"], m["fc2"]

    def _dropouts(self):
        return (_p(self.block.dropout),)

    def _beyond_fused(self, x):
        return _HF_ACTIVATIONS.get(self.block.mlp.config.hidden_act) is None

    couple_op = norm_mlp_couple

    def operands(self, x, layout=None):
        b = _parts(self.block)
        norm, mlp = b["layernorm_after"], b["mlp"]
        inner, out = self._projections()
        return ((parameter(norm, "weight"), parameter(norm, "bias"), parameter(inner, "weight"),
                 parameter(inner, "bias"), parameter(out, "weight"), parameter(out, "bias")),
                dict(norm="layer", activation=_HF_ACTIVATIONS[mlp.config.hidden_act], eps=norm.eps))

    def _modules(self, x):
        b = self.block
        return b.dropout(b.mlp(b.layernorm_after(self._input(x, b.layernorm_after.weight))))


def _convert_hf_vit(model, conversion, found=None):
    base = next((getattr(model, name) for name in ("vit", "deit", "ijepa") if hasattr(model, name)), model)
    layers = getattr(base, "layers", None)
    if layers is None or not len(layers) or not hasattr(layers[0], "layernorm_before"):
        raise NotImplementedError(f"revify: this transformers version's {type(model).__name__} has no pre-norm "
                                  f"`layers` of ViTLayer (transformers 5 layout) to convert")
    attention = layers[0].attention
    if attention.head_dim * attention.num_attention_heads != base.config.hidden_size:
        raise NotImplementedError("revify: HF ViT with head_dim * heads != hidden_size is not supported")
    _convert_hosted_layers(model, base, "layers", conversion, (_HostViTBlock, _HostViTOrdinaryBlock), _HostViTModel)


class _HostViTAttentionHalf(_HostAttention, _HFViTAttentionHalf):
    _splits_samples = True  # ReversibleStack token_chunk: a few samples at a time (engine.rows)
    takes_cond = True  # the library's mask (an attention_mask given to ViTModel), no token layout

    def _attention_module(self):
        return self.block.attention

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.layernorm_before.weight)
        return b.dropout(_first(b.attention(b.layernorm_before(x), host.mask_for(b), **extra)))


_HostViTBlock, _HostViTOrdinaryBlock = _host_block_mixins((_HostViTAttentionHalf, _HFViTMlpHalf))


class _HostViTModel(_HostDecoderModel):
    """ViTModel: patches in, no cache; its last hidden state is the last layer's (before layernorm)."""

    _rope, _tokens_input, _caches, _tie_last = False, False, False, False


# The classes with ViT's layers (transformers' "Copied from" ViTLayer): (module, layer, base model, heads).
_VIT_LIKE = (("vit", "ViTLayer", "ViTModel", ("ViTForImageClassification",)),
             ("deit", "DeiTLayer", "DeiTModel", ("DeiTForImageClassification", "DeiTForImageClassificationWithTeacher",
                                                 "DeiTForMaskedImageModeling")),
             ("vit_mae", "ViTMAELayer", "ViTMAEModel", ("ViTMAEForPreTraining",)),
             ("ijepa", "IJepaLayer", "IJepaModel", ("IJepaForImageClassification",)),
             ("vit_msn", "ViTMSNLayer", "ViTMSNModel", ("ViTMSNForImageClassification",)))

FAMILY = Family("hf_vit", ("transformers ViTForImageClassification / ViTModel, and the models with its layers: DeiT "
                           "(its heads, distillation included), ViT-MAE (ViTMAEModel, ViTMAEForPreTraining: the "
                           "encoder), I-JEPA, ViT-MSN",), _convert_hf_vit,
                classes=tuple(("transformers", name) for _, _, base, heads in _VIT_LIKE for name in (base, *heads)),
                pickled={name: entry for module, layer, base, _ in _VIT_LIKE
                         for name, entry in _pickled_host_classes(f"transformers.models.{module}.modeling_{module}",
                                                                  layer, (_HostViTBlock, _HostViTOrdinaryBlock), base,
                                                                  _HostViTModel).items()})
