"""Hugging Face MPT (``MptForCausalLM``, ``MptModel`` and its other heads): pre-norm blocks
``h = x + resid_attn_dropout(attn(norm_1(x)))``, then ``h + ffn(norm_2(h))``, with ALiBi: the model
builds the biases before its block loop and hands them to every block (``position_bias``: the
conditioning carries them beside the mask). MPT's MLP adds the residual itself (its ``residual``
argument, after its dropout): the MLP half passes a zero residual, so that it returns its branch
alone. Both halves run the block's own modules (the library path: the attention with the library's
mask, ALiBi and, while decoding, its cache)."""
from __future__ import annotations

from .bloom import _no_residual
from .core import Family, LayerSpec, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _convert_hosted_layers, _first, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .probe import _check_block_loop, require_layer_parts

_MPT_BLOCK_PARTS = {"norm_1", "attn", "norm_2", "ffn", "resid_attn_dropout"}


class _MptAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.attn

    def _attention_norm(self):
        return self.block.norm_1

    def _library_call(self, x, host, extra: dict):
        """The block's norm and attention with the model's mask and ALiBi (while decoding, its cache, which
        the block hands its attention as ``cache``), then the block's dropout on the branch."""
        b = self.block
        x = self._input(x, b.norm_1.weight)
        out = b.attn(b.norm_1(x), position_bias=host.layer_tensors["position_bias"],
                     attention_mask=host.mask_for(b), cache=extra.get("layer_past"))
        return b.resid_attn_dropout(_first(out))


class _MptMlpHalf(_LibraryHalf):
    def _modules(self, x):
        b = self.block
        x = self._input(x, b.norm_2.weight)
        return b.ffn(b.norm_2(x), _no_residual(x))


_HostMptBlock, _HostMptOrdinaryBlock = _host_block_mixins((_MptAttentionHalf, _MptMlpHalf))


class _HostMptModel(_HostDecoderModel):
    """MptModel: its blocks are ``blocks``; ALiBi built before the loop (no position ids, no RoPE)."""

    _layers = "blocks"
    _rope = False


def _convert_mpt(model, conversion, found=None):
    base = getattr(model, "transformer", model)
    name = type(model).__name__
    if not len(base.blocks):
        raise ValueError(f"revify: {name} has no blocks")
    _require_hosted_layer_loop(name)
    require_layer_parts(base.blocks, _MPT_BLOCK_PARTS, "MPT")
    tuples = _check_block_loop(base, tuples=True)  # (its loop reads outputs[0])
    for block in base.blocks:  # the block's own modules, the model's mask and ALiBi (alone, a half refuses)
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _convert_hosted_layers(model, base, "blocks", conversion, (_HostMptBlock, _HostMptOrdinaryBlock), _HostMptModel,
                           layer_tuples=tuples)


_CLASSES = ("MptForCausalLM", "MptModel", "MptForSequenceClassification", "MptForTokenClassification",
            "MptForQuestionAnswering")
FAMILY = Family("mpt", ("transformers MptForCausalLM / MptModel and its other heads (ALiBi)",), _convert_mpt,
                halves="library", classes=tuple(("transformers", name) for name in _CLASSES),
                pickled=_pickled_host_classes("transformers.models.mpt.modeling_mpt", "MptBlock",
                                              (_HostMptBlock, _HostMptOrdinaryBlock), "MptModel", _HostMptModel))
