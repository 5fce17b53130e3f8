"""Hugging Face decoders with parallel layers (one norm, attention and MLP side by side).

``x + attn(norm(x)) + mlp(norm(x))`` (GPT-NeoX's parallel residual with one norm shared by both
branches), RoPE from the model's rotary embedding: GPT-J and CodeGen (``h`` of blocks with exactly
ln_1, attn, mlp), Phi, Cohere and StableLM with ``use_parallel_residual`` (``layers`` of layers with
exactly input_layernorm, self_attn, mlp; Phi's resid_dropout on each branch, StableLM's dropout on
the MLP branch). Both branches run the layer's own modules (interleaved or
partial rotary, one norm for both); the attention half is ``_HostParallelAttentionHalf`` (with the
other halves that take the model's inputs).
"""
from __future__ import annotations

from torch import nn

from .core import (Family, LayerSpec, _Half, _host_block_mixins, _refuse_meft3_with_parallel_layers, _residual_dropout,
                   _spec_of)
from .host import _convert_hosted_layers, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .probe import _check_block_loop, _check_layer_slice, _library_layers, _probe_layers, _rotary_layer_inputs


def _parallel_norm(block) -> nn.Module:
    return getattr(block, _spec_of(block).norm)


class _ParallelMlpHalf(_Half):
    def _beyond_fused(self, x):
        return True

    def _modules(self, x):
        b, norm = self.block, _parallel_norm(self.block)
        return _mlp_branch_dropout(b)(b.mlp(norm(self._input(x, getattr(norm, "weight", None)))))


def _mlp_branch_dropout(block):
    """Phi's ``resid_dropout`` (on both branches), else StableLM's ``dropout`` (on the MLP branch only)."""
    return _residual_dropout(block, "resid_dropout" if hasattr(block, "resid_dropout") else "dropout")


# Where the layers are, and their parts (norm, attention, mlp), besides the branch dropouts.
_PARALLEL_CONVENTIONS = (("transformer", "h", ("ln_1", "attn", "mlp")),  # GPT-J, CodeGen
                         ("model", "layers", ("input_layernorm", "self_attn", "mlp")))  # Phi, Cohere, StableLM
_BRANCH_DROPOUTS = {"resid_dropout", "dropout"}  # Phi's on both branches; StableLM's on the MLP branch


def _parallel_convention(model: nn.Module):
    """``(base model, layers attribute, (norm, attention) part names)`` of a Hugging Face decoder whose
    layers have exactly one norm, an attention and an MLP (see the section's comment), whatever its
    class, or None."""
    for owner, attribute, parts in _PARALLEL_CONVENTIONS:
        found = _library_layers(model, owner, attribute)
        if found is None:
            continue
        base, layers = found
        if {name for name, _ in layers[0].named_children()} - _BRANCH_DROPOUTS != set(parts):
            continue
        if attribute == "h":
            _check_block_loop(base)
        else:
            _check_layer_slice(base)
        return base, attribute, parts[:2]
    return None


def _convert_parallel(model, conversion, found):
    """A decoder with parallel layers (``found``: what :func:`_parallel_convention` found in it): each
    layer probed against its own forward; a plain conversion couples attention (F) and MLP (G), a
    preserving one keeps the layer whole (meft1 / meft2); meft3 splits a layer into sublayers, which a
    parallel residual does not compose."""
    base, attribute, (norm, attention) = found
    config, name = base.config, type(model).__name__
    _require_hosted_layer_loop(name)
    _refuse_meft3_with_parallel_layers(name, conversion)
    layers = getattr(base, attribute)
    for block in layers:
        block._revtriton_spec = LayerSpec(parallel=True, fused_attention=False, fused_mlp=False, norm=norm,
                                          attention=attention)
    _probe_layers(base, name, layers, (_HostParallelAttentionHalf, _ParallelMlpHalf), _rotary_layer_inputs(base),
                  f"a parallel layer x + {attention}({norm}(x)) + mlp({norm}(x))", parallel=True)
    _convert_hosted_layers(model, base, attribute, conversion, (_HostParallelBlock, _HostParallelOrdinaryBlock),
                           _HostParallelModel)


class _HostParallelAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return getattr(self.block, self._spec().attention)

    def _attention_norm(self):
        return _parallel_norm(self.block)

    def _branch_dropout(self):
        return _residual_dropout(self.block, "resid_dropout")


_HostParallelBlock, _HostParallelOrdinaryBlock = _host_block_mixins((_HostParallelAttentionHalf, _ParallelMlpHalf),
                                                                    "RevifiedHostParallel")


class _HostParallelModel(_HostDecoderModel):
    """A decoder with parallel layers (GPTJModel, CodeGenModel: layers ``h``; PhiModel, CohereModel,
    StableLmModel: ``layers``), RoPE from position ids."""

    _class_prefix = "RevifiedHostParallel"
    _layers = ("h", "layers")


FAMILY = Family(
    "parallel", ("decoders with parallel layers of one norm (ln_1, attn, mlp: GPT-J, CodeGen; input_layernorm, "
                 "self_attn, mlp: Phi, Cohere, StableLM with use_parallel_residual)",), _convert_parallel,
    detect=_parallel_convention, halves="library",
    conventions={("HostParallel", None, "Block"): _HostParallelBlock,  # GPT-J's blocks
                 ("HostParallel", "Ordinary", "Block"): _HostParallelOrdinaryBlock,
                 ("HostParallel", None, "DecoderLayer"): _HostParallelBlock,  # Phi's and Cohere's layers
                 ("HostParallel", "Ordinary", "DecoderLayer"): _HostParallelOrdinaryBlock,
                 ("HostParallel", None, "Model"): _HostParallelModel})
