"""Hugging Face GPT-2 and the decoders with its layer conventions (``h`` of blocks with ln_1, attn,
ln_2, mlp: GPTBigCode, GPT-Neo, ImageGPT), run through the library's own forward."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.attention import multi_head_attention_reference, norm_attention_couple
from ..ops.mlp import norm_mlp_couple
from ..halves.base import parameter
from .core import (Family, LayerSpec, _HF_ACTIVATIONS, _Half, _host_block_mixins, _p, _parts,
                   _pickled_host_classes)
from .host import _convert_hosted_layers, _first, _HostAttention, _HostDecoderModel, _require_hosted_layer_loop
from .probe import _causal_layer_inputs, _check_block_loop, _has_layer_parts, _library_layers, _probe_layers


class _GPT2AttentionHalf(_Half):
    takes_cond = True

    def _projections(self):
        a = _parts(_parts(self.block)["attn"])
        return a["c_attn"], a["c_proj"]

    def _beyond_fused(self, x):  # scores not scaled by head_dim ** -0.5 (converted with the library's forward)
        return not self._spec().fused_attention

    def _dropouts(self):  # (not fused: the layer's own modules anyway; GPT-Neo's keep theirs deeper)
        if not self._spec().fused_attention:
            return ()
        return _p(self.block.attn.attn_dropout), _p(self.block.attn.resid_dropout)

    couple_op = norm_attention_couple

    def operands(self, x, layout=None):
        b = _parts(self.block)
        norm, a = b["ln_1"], b["attn"]
        qkv, out = _parts(a)["c_attn"], _parts(a)["c_proj"]
        segments = None if layout is None else layout[1]  # positions entered with the position embeddings
        # Conv1D keeps weights as [in, out]: transpose to nn.Linear's [out, in].
        return ((parameter(norm, "weight"), parameter(norm, "bias"), parameter(qkv, "weight").t(),
                 parameter(qkv, "bias"), parameter(out, "weight").t(), parameter(out, "bias")),
                dict(heads=a.num_heads, causal=True, norm="layer", eps=norm.eps, segments=segments))

    def _modules(self, x):  # one sequence per row (a half called alone; an empty batch)
        b, a = self.block, self.block.attn
        x = self._input(x, b.ln_1.weight)
        q, k, v = a.c_attn(b.ln_1(x)).split(x.shape[-1], dim=-1)
        o = multi_head_attention_reference(q, k, v, heads=a.num_heads, kv_heads=a.num_heads, causal=True,
                                           rope_theta=None, dropout=_p(a.attn_dropout) if b.training else 0.0)
        return a.resid_dropout(a.c_proj(o))


def _out_in(projection) -> torch.Tensor:
    """A projection's weight as nn.Linear keeps it, [out, in] (transformers' Conv1D keeps [in, out])."""
    weight = parameter(projection, "weight")
    return weight if isinstance(projection, nn.Linear) else weight.t()


class _GPT2MlpHalf(_Half):
    rows_independent = True  # each token's MLP output from its own row (ReversibleStack token_chunk)

    def _projections(self):
        m = _parts(_parts(self.block)["mlp"])
        return m["c_fc"], m["c_proj"]

    def _beyond_fused(self, x):  # an activation the fused kernels do not have, other projections
        return not self._spec().fused_mlp

    def _dropouts(self):
        return (_p(self.block.mlp.dropout),)

    couple_op = norm_mlp_couple

    def operands(self, x, layout=None):
        b = _parts(self.block)
        norm, m = b["ln_2"], _parts(b["mlp"])
        inner, out = m["c_fc"], m["c_proj"]
        return ((parameter(norm, "weight"), parameter(norm, "bias"), _out_in(inner), parameter(inner, "bias"),
                 _out_in(out), parameter(out, "bias")), dict(norm="layer", activation=self._spec().activation,
                                                             eps=norm.eps))

    def _modules(self, x):
        b = self.block
        return b.mlp(b.ln_2(self._input(x, b.ln_2.weight)))


def _convert_gpt2(model, conversion, found=None):
    """GPT-2 and the decoders that share its layer conventions (``h`` of blocks with ln_1, attn, ln_2,
    mlp: GPTBigCode, GPT-Neo, ImageGPT). The fused kernels run GPT-2's own projections (transformers' Conv1D, q/k/v
    side by side) with head_dim ** -0.5 scores and a GELU / ReLU MLP; anything else runs the layer's
    own modules. ``found``: the base model of a decoder admitted by its conventions
    (:func:`_gpt2_convention_base`), each layer checked against its own forward (:func:`_probe_layers`)."""
    from transformers.pytorch_utils import Conv1D

    probe = found is not None
    base = found if probe else model.transformer if hasattr(model, "transformer") else model
    config, name = base.config, type(model).__name__
    _require_hosted_layer_loop(name)
    if getattr(config, "add_cross_attention", False) and probe:  # (GPT-2's own: its halves attend, below)
        raise NotImplementedError(f"revify: {name} with add_cross_attention=True is not supported")
    if not len(base.h):
        raise ValueError(f"revify: {name} has no decoder layers")
    # What the fused kernels lack runs on the library's own modules: another activation, other scores' scaling.
    plain_scaling = getattr(config, "scale_attn_weights", True) and not getattr(
        config, "scale_attn_by_inverse_layer_idx", False)
    activation = _HF_ACTIVATIONS.get(getattr(config, "activation_function", None))
    hidden = config.hidden_size
    for block in base.h:
        a, m = block.attn, block.mlp
        gpt2_attention = (all(isinstance(getattr(a, part, None), Conv1D) for part in ("c_attn", "c_proj"))
                          and tuple(a.c_attn.weight.shape) == (hidden, 3 * hidden))
        gpt2_mlp = all(isinstance(getattr(m, part, None), (Conv1D, nn.Linear)) for part in ("c_fc", "c_proj"))
        block._revtriton_spec = LayerSpec(fused_attention=plain_scaling and gpt2_attention, gpt2_layout=gpt2_attention,
                                          fused_mlp=gpt2_mlp and activation is not None, activation=activation)
    # GPT-Neo's loop reads each layer's output as outputs[0] (its layers return the attention weights too)
    tuples = probe and _check_block_loop(base, tuples=True)
    if probe:
        _probe_layers(base, name, base.h, (_HostGPT2AttentionHalf, _GPT2MlpHalf), _causal_layer_inputs(base),
                      "GPT-2's pre-norm layer x + attn(ln_1(x)), then + mlp(ln_2(h))")
    mixins, model_mixin = (_HostGPT2StyleBlock, _HostGPT2StyleOrdinaryBlock), _HostGPT2StyleModel
    if not probe:
        mixins, model_mixin = (_HostGPT2Block, _HostGPT2OrdinaryBlock), _HostGPT2Model
    _convert_hosted_layers(model, base, "h", conversion, mixins, model_mixin, layer_tuples=tuples)


_GPT2_LAYER_PARTS = ("ln_1", "attn", "ln_2", "mlp")


def _gpt2_convention_base(model: nn.Module):
    """The base model of a Hugging Face decoder whose layers look like GPT-2's (``h`` of blocks with
    exactly ln_1, attn, ln_2 and mlp), whatever its class, or None. Raises NotImplementedError naming
    what differs for one that nearly does (other parts; a layer loop that does not take each layer's
    output as the next hidden states, directly or as ``outputs[0]`` as GPT-Neo's does)."""
    found = _library_layers(model, "transformer", "h")
    if found is None or not _has_layer_parts(found[1][0], _GPT2_LAYER_PARTS, "GPT-2"):
        return None
    _check_block_loop(found[0], tuples=True)
    return found[0]


class _HostGPT2AttentionHalf(_HostAttention, _GPT2AttentionHalf):
    _splits_samples = True  # ReversibleStack token_chunk: a few samples at a time (engine.rows)

    def _attention_module(self):
        return self.block.attn

    def _attention_norm(self):
        return self.block.ln_1

    def _modules(self, x):  # an empty batch of a GPT-2-style model (GPTBigCode's q/k/v are not GPT-2's)
        if not self._spec().gpt2_layout:
            return torch.zeros_like(x)
        return super()._modules(x)

    def _fuses(self, x, host) -> bool:  # given an encoder's states, the layer's own modules (its cross-attention)
        return host.layer_tensors.get("encoder_hidden_states") is None and super()._fuses(x, host)

    def _library_call(self, x, host, extra):
        """The self-attention branch, then (given an encoder's states: add_cross_attention, a vision
        encoder-decoder's GPT-2) the cross-attention branch on the sum, as GPT2Block runs them."""
        attended = super()._library_call(x, host, extra)
        states = host.layer_tensors.get("encoder_hidden_states")
        if states is None:
            return attended
        b = self.block
        h = self._input(x, b.ln_cross_attn.weight) + attended
        cache = {"cache": extra["cache"]} if extra.get("cache") is not None else {}  # (while decoding)
        out = b.crossattention(b.ln_cross_attn(h), attention_mask=host.mask_for(b), encoder_hidden_states=states,
                               encoder_attention_mask=host.layer_tensors.get("encoder_attention_mask"), **cache)
        return attended + _first(out)


_HostGPT2Block, _HostGPT2OrdinaryBlock = _host_block_mixins((_HostGPT2AttentionHalf, _GPT2MlpHalf))
# Decoders admitted by GPT-2's layer conventions (GPTBigCode): their own names, found again on unpickling.
_HostGPT2StyleBlock, _HostGPT2StyleOrdinaryBlock = _host_block_mixins((_HostGPT2AttentionHalf, _GPT2MlpHalf),
                                                                      "RevifiedHostGPT2Style")


class _HostGPT2Model(_HostDecoderModel):
    """GPT2Model: its layers are ``h``, position embeddings are added before the loop."""

    _layers, _rope = "h", False

    @property
    def _cross_attention(self):  # (add_cross_attention: its layers attend to an encoder's states)
        return bool(getattr(self.config, "add_cross_attention", False))


class _HostGPT2StyleModel(_HostGPT2Model):
    """A decoder admitted by GPT-2's layer conventions (GPTBigCodeModel)."""

    _class_prefix = "RevifiedHostGPT2Style"


FAMILY = Family(
    "gpt2", ("transformers GPT2LMHeadModel", "transformers GPT2Model (with add_cross_attention too: a vision "
             "encoder-decoder's decoder)",
             "decoders with GPT-2's layers (ln_1, attn, ln_2, mlp: GPTBigCode, GPT-Neo with its local attention "
             "layers, ImageGPT)"), _convert_gpt2,
    classes=(("transformers", "GPT2LMHeadModel"), ("transformers", "GPT2Model")), detect=_gpt2_convention_base,
    pickled=_pickled_host_classes("transformers.models.gpt2.modeling_gpt2", "GPT2Block",
                                  (_HostGPT2Block, _HostGPT2OrdinaryBlock), "GPT2Model", _HostGPT2Model),
    conventions={("HostGPT2Style", None, "Block"): _HostGPT2StyleBlock,
                 ("HostGPT2Style", "Ordinary", "Block"): _HostGPT2StyleOrdinaryBlock,
                 ("HostGPT2Style", None, "Model"): _HostGPT2StyleModel})
