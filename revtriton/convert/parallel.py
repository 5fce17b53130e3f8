"""Hugging Face decoders with parallel layers (one norm, attention and MLP side by side).

``x + attn(norm(x)) + mlp(norm(x))`` (GPT-NeoX's parallel residual with one norm shared by both
branches), RoPE from the model's rotary embedding: GPT-J and CodeGen (``h`` of blocks with exactly
ln_1, attn, mlp), Phi, Cohere and StableLM with ``use_parallel_residual`` (``layers`` of layers with
exactly input_layernorm, self_attn, mlp; Phi's resid_dropout on each branch, StableLM's dropout on
the MLP branch), Falcon (``h`` of layers with input_layernorm, self_attention, mlp, or with a norm
for each branch, ln_attn and ln_mlp: its new decoder architecture; RoPE or ALiBi, which its model
adds to the mask; its ``hidden_dropout`` on the branches' sum becomes a dropout on each branch; its
loop reads ``outputs[0]``). Falcon's sequential layers (``parallel_attn=False``: post_attention_layernorm
before the MLP, ``h = x + A(x)`` then ``h + M(h)``) take the same halves. Both branches run the
layer's own modules (interleaved or partial rotary, one norm for both or one each); the attention
half is ``_HostParallelAttentionHalf`` (with the other halves that take the model's inputs).
"""
from __future__ import annotations

from torch import nn

from .core import (Family, LayerSpec, _dropout, _host_block_mixins, _LibraryHalf, _refuse_meft3_with_parallel_layers,
                   _residual_dropout, _spec_of)
from .host import _convert_hosted_layers, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .probe import _check_block_loop, _check_layer_slice, _library_layers, _probe_layers, _rotary_layer_inputs


def _parallel_norm(block, mlp: bool = False) -> nn.Module:
    """The norm before the attention, or before the MLP (``mlp``: its own where the layer has one)."""
    spec = _spec_of(block)
    return getattr(block, (mlp and spec.mlp_norm) or spec.norm)


class _ParallelMlpHalf(_LibraryHalf):
    def _modules(self, x):
        b, norm = self.block, _parallel_norm(self.block, mlp=True)
        return _branch_dropout(b, mlp=True)(b.mlp(norm(self._input(x, getattr(norm, "weight", None)))))


def _branch_dropout(block, mlp: bool):
    """Phi's ``resid_dropout`` (on both branches), StableLM's ``dropout`` (on the MLP branch only), or
    Falcon's ``hidden_dropout`` (a probability its layer applies to the branches' sum: here each
    branch draws its own mask, as the two halves run apart; in its sequential layers to the MLP's
    output, and ``config.attention_dropout`` to the attention's); Identity where the layer has none."""
    if not mlp and not _spec_of(block).parallel:  # Falcon's sequential layers
        return _dropout(block.config.attention_dropout, block.training)
    names = ("resid_dropout", "dropout", "hidden_dropout") if mlp else ("resid_dropout", "hidden_dropout")
    return _residual_dropout(block, next((name for name in names if hasattr(block, name)), "resid_dropout"))


# Where the layers are, and their parts (norm, attention, mlp and, where the MLP has a norm of its
# own, that norm), besides the branch dropouts. The last: Falcon's sequential layers (parallel_attn=False).
_PARALLEL_CONVENTIONS = (("transformer", "h", ("ln_1", "attn", "mlp")),  # GPT-J, CodeGen
                         ("model", "layers", ("input_layernorm", "self_attn", "mlp")),  # Phi, Cohere, StableLM
                         ("transformer", "h", ("input_layernorm", "self_attention", "mlp")),  # Falcon
                         ("transformer", "h", ("ln_attn", "self_attention", "mlp", "ln_mlp")),  # Falcon's new one
                         ("transformer", "h", ("input_layernorm", "self_attention", "mlp", "post_attention_layernorm")))
_SEQUENTIAL_MLP_NORM = "post_attention_layernorm"  # (Falcon's sequential layers: its MLP's norm)
_BRANCH_DROPOUTS = {"resid_dropout", "dropout"}  # Phi's on both branches; StableLM's on the MLP branch


def _parallel_convention(model: nn.Module):
    """``(base model, layers attribute, (norm, attention, MLP norm) part names, whether its loop reads
    ``outputs[0]``)`` of a Hugging Face decoder whose layers have exactly one norm (or one a branch),
    an attention and an MLP (see the section's comment), whatever its class, or None. The MLP norm
    ``post_attention_layernorm`` marks Falcon's sequential layers."""
    for owner, attribute, parts in _PARALLEL_CONVENTIONS:
        found = _library_layers(model, owner, attribute)
        if found is None:
            continue
        base, layers = found
        if {name for name, _ in layers[0].named_children()} - _BRANCH_DROPOUTS != set(parts):
            continue
        tuples = False
        if attribute == "h":
            tuples = _check_block_loop(base, tuples=True)
        else:
            _check_layer_slice(base)
        return base, attribute, (*parts[:2], parts[3] if len(parts) > 3 else ""), tuples
    return None


def _convert_parallel(model, conversion, found):
    """A decoder with parallel layers (``found``: what :func:`_parallel_convention` found in it): each
    layer probed against its own forward; a plain conversion couples attention (F) and MLP (G), a
    preserving one keeps the layer whole (meft1 / meft2); meft3 splits a layer into sublayers, which a
    parallel residual does not compose (Falcon's sequential layers take it)."""
    base, attribute, (norm, attention, mlp_norm), tuples = found
    config, name = base.config, type(model).__name__
    parallel = mlp_norm != _SEQUENTIAL_MLP_NORM
    _require_hosted_layer_loop(name)
    if parallel:
        _refuse_meft3_with_parallel_layers(name, conversion)
    layers = getattr(base, attribute)
    for block in layers:
        block._revtriton_spec = LayerSpec(parallel=parallel, fused_attention=False, fused_mlp=False, norm=norm,
                                          attention=attention, mlp_norm=mlp_norm)
    kind = (f"a parallel layer x + {attention}({norm}(x)) + mlp({mlp_norm or norm}(x))" if parallel else
            f"a sequential layer h = x + {attention}({norm}(x)), then h + mlp({mlp_norm}(h))")
    _probe_layers(base, name, layers, (_HostParallelAttentionHalf, _ParallelMlpHalf), _rotary_layer_inputs(base),
                  kind, parallel=parallel)
    _convert_hosted_layers(model, base, attribute, conversion, (_HostParallelBlock, _HostParallelOrdinaryBlock),
                           _HostParallelModel, layer_tuples=tuples)


class _HostParallelAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return getattr(self.block, self._spec().attention)

    def _attention_norm(self):
        return _parallel_norm(self.block)

    def _branch_dropout(self):
        return _branch_dropout(self.block, mlp=False)


_HostParallelBlock, _HostParallelOrdinaryBlock = _host_block_mixins((_HostParallelAttentionHalf, _ParallelMlpHalf),
                                                                    "RevifiedHostParallel")


class _HostParallelModel(_HostDecoderModel):
    """A decoder with parallel layers (GPTJModel, CodeGenModel, FalconModel: layers ``h``; PhiModel,
    CohereModel, StableLmModel: ``layers``), RoPE from position ids (Falcon's ALiBi: in its mask)."""

    _class_prefix = "RevifiedHostParallel"
    _layers = ("h", "layers")


FAMILY = Family(
    "parallel", ("decoders with parallel layers (ln_1, attn, mlp: GPT-J, CodeGen; input_layernorm, self_attn, mlp: "
                 "Phi, Cohere, StableLM with use_parallel_residual; input_layernorm, or a norm per branch ln_attn and "
                 "ln_mlp, with self_attention, mlp: Falcon; also Falcon's sequential layers, parallel_attn=False)",),
    _convert_parallel,
    detect=_parallel_convention, halves="library",
    conventions={("HostParallel", None, "Block"): _HostParallelBlock,  # GPT-J's blocks
                 ("HostParallel", "Ordinary", "Block"): _HostParallelOrdinaryBlock,
                 ("HostParallel", None, "DecoderLayer"): _HostParallelBlock,  # Phi's and Cohere's layers
                 ("HostParallel", "Ordinary", "DecoderLayer"): _HostParallelOrdinaryBlock,
                 ("HostParallel", None, "Model"): _HostParallelModel})
