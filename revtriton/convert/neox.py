"""Hugging Face GPT-NeoX (Pythia): pre-norm LayerNorm layers, parallel residual or not, partial
rotary, one q/k/v projection interleaved per head."""
from __future__ import annotations

from dataclasses import replace


from ..ops.attention import multi_head_attention_reference, norm_attention_couple
from ..halves.base import parameter
from .core import (Family, LayerSpec, _HF_ACTIVATIONS, _Half, _host_block_mixins, _layout_options, _NormMlpHalf, _p,
                   _parts, _pickled_host_classes, _refuse_meft3_with_parallel_layers, _rope_spec,
                   _scores_scaled_plainly)
from .host import _convert_hosted_layers, _HostAttention, _HostDecoderModel, _require_hosted_layer_loop


class _NeoXAttentionHalf(_Half):
    """GPT-NeoX attention: LayerNorm, one q/k/v projection with rows interleaved per head
    ([head][q, k, v][head_dim]), rotary on the first ``rotary_ndims`` of each head, biases."""

    takes_cond = True

    def _projections(self):
        a = _parts(_parts(self.block)["attention"])
        return a["query_key_value"], a["dense"]

    def _dropouts(self):
        return (float(getattr(self.block.attention, "attention_dropout", 0.0) or 0.0),
                _p(self.block.post_attention_dropout))

    def _beyond_fused(self, x):  # partial rotary or scaled RoPE: the kernels rotate whole heads by theta
        spec = self._spec()
        return spec.rope_dims != spec.head_dim or spec.rope_module is not None

    def _grouped_rows(self, t):
        """The interleaved q/k/v rows (or bias) regrouped as [q; k; v] (what the fused kernels read)."""
        heads = self._spec().heads
        return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    couple_op = norm_attention_couple

    def operands(self, x, layout=None):
        spec, norm = self._spec(), _parts(self.block)["input_layernorm"]
        qkv, out = self._projections()
        qkv_bias = parameter(qkv, "bias")
        b_qkv = None if qkv_bias is None else self._grouped_rows(qkv_bias)
        return ((parameter(norm, "weight"), parameter(norm, "bias"), self._grouped_rows(parameter(qkv, "weight")),
                 b_qkv, parameter(out, "weight"), parameter(out, "bias")),
                dict(heads=spec.heads, causal=True, rope_theta=spec.rope_theta, norm="layer", eps=norm.eps,
                     **_layout_options(layout)))

    def _modules(self, x):  # one sequence per row at positions 0..T-1 (a half called alone; an empty batch)
        b, a, spec = self.block, self.block.attention, self._spec()
        x = self._input(x, b.input_layernorm.weight)
        batch, tokens, _ = x.shape
        qkv = a.query_key_value(b.input_layernorm(x)).view(batch, tokens, spec.heads, 3 * spec.head_dim)
        q, k, v = (t.reshape(batch, tokens, -1) for t in qkv.chunk(3, dim=-1))
        rotary = spec.rope_module
        rope = dict(rope_theta=spec.rope_theta, rope_dims=spec.rope_dims)
        if rotary is not None:
            rope.update(rope_inv_freq=rotary.inv_freq, rope_scale=float(rotary.attention_scaling))
        o = multi_head_attention_reference(q, k, v, heads=spec.heads, kv_heads=spec.heads, causal=True,
                                           dropout=self._dropouts()[0] if b.training else 0.0, **rope)
        return b.post_attention_dropout(a.dense(o))


class _NeoXMlpHalf(_NormMlpHalf):
    def _mlp_norm(self):
        return _parts(self.block)["post_attention_layernorm"]

    def _projections(self):
        m = _parts(_parts(self.block)["mlp"])
        return m["dense_h_to_4h"], m["dense_4h_to_h"]

    def _dropouts(self):
        return (_p(self.block.post_mlp_dropout),)

    def _modules(self, x):
        b = self.block
        return b.post_mlp_dropout(b.mlp(b.post_attention_layernorm(self._input(x, b.post_attention_layernorm.weight))))


def _convert_neox(model, conversion, found=None):
    """GPT-NeoX (Pythia): pre-norm LayerNorm blocks with the parallel residual ``x + A(x) + M(x)``
    (or the sequential one, ``use_parallel_residual=False``), partial rotary, biases. A plain
    conversion couples attention (F) and MLP (G) as every family; a preserving one keeps the layer
    whole (meft1 / meft2: ``L(x)`` as one half, parallel or not); meft3 splits the layer into its
    two sublayers, which a parallel residual does not compose."""
    base = model.gpt_neox if hasattr(model, "gpt_neox") else model
    config, name = base.config, type(model).__name__
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no decoder layers")
    parallel = bool(config.use_parallel_residual)
    if parallel:
        _refuse_meft3_with_parallel_layers(f"{name} with use_parallel_residual=True", conversion)
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    attention = base.layers[0].attention
    if not _scores_scaled_plainly(attention, head_dim):
        raise NotImplementedError(f"revify: {name} with attention scaling {attention.scaling} != head_dim ** -0.5 "
                                  f"is not supported")
    _require_hosted_layer_loop(name)
    rope_dims = int(attention.rotary_ndims)
    activation = _HF_ACTIVATIONS.get(config.hidden_act)  # None: the MLP runs its own activation (module path)
    spec = LayerSpec(heads=heads, head_dim=head_dim, rope_dims=rope_dims, activation=activation,
                     **_rope_spec(config, name, base, rope_dims))
    for block in base.layers:
        block._revtriton_spec = replace(spec)
    _convert_hosted_layers(model, base, "layers", conversion, (_HostNeoXBlock, _HostNeoXOrdinaryBlock),
                           _HostDecoderModel)


class _HostNeoXAttentionHalf(_HostAttention, _NeoXAttentionHalf):
    _splits_samples = True  # ReversibleStack token_chunk: a few samples at a time (engine.rows)

    def _attention_module(self):
        return self.block.attention

    def _attention_norm(self):
        return self.block.input_layernorm

    def _branch_dropout(self):
        return self.block.post_attention_dropout


_HostNeoXBlock, _HostNeoXOrdinaryBlock = _host_block_mixins((_HostNeoXAttentionHalf, _NeoXMlpHalf))


FAMILY = Family("gpt_neox", ("transformers GPTNeoXForCausalLM / GPTNeoXModel",), _convert_neox,
                classes=(("transformers", "GPTNeoXForCausalLM"), ("transformers", "GPTNeoXModel")),
                pickled=_pickled_host_classes("transformers.models.gpt_neox.modeling_gpt_neox", "GPTNeoXLayer",
                                              (_HostNeoXBlock, _HostNeoXOrdinaryBlock), "GPTNeoXModel",
                                              _HostDecoderModel))
