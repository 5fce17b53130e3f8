"""Hugging Face LLaMA and the decoders that share its layer conventions (Mistral, Qwen2, Qwen3,
Gemma, Phi-3 by class; Granite, OLMo, SmolLM3, ... admitted by their layers and probed)."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..ops.attention import multi_head_attention_reference, norm_attention_couple
from ..ops.mlp import swiglu_mlp_couple
from ..halves.base import parameter
from .core import (Family, LayerSpec, _branch_p, _concatenated_qkv, _Half, _host_block_mixins,
                   _layout_options, _norm_eps, _parts, _pickled_host_classes, _residual_dropout, _rope_spec,
                   _scores_scaled_plainly)
from .host import _convert_hosted_layers, _first, _HostAttention, _HostDecoderModel, _require_hosted_layer_loop
from .probe import (_check_layer_slice, _has_layer_parts, _library_layers, _probe_layers, _rotary_layer_inputs,
                    require_layer_parts)


def _is_plain_rms_norm(norm) -> bool | None:
    """Whether ``norm`` computes ``x * rsqrt(mean(x^2) + eps) * weight`` (what the fused kernels
    compute), checked on a probe: Gemma's scales by ``1 + weight`` instead. None when it cannot be
    probed yet (weights on the meta device or sharded: decided at the first call)."""
    weight = getattr(norm, "weight", None)
    if weight is None or weight.dim() != 1:
        return False
    if weight.device.type == "meta" or type(weight).__name__ == "DTensor" or type(weight.data).__name__ == "DTensor":
        return None
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(2, weight.numel(), generator=generator).to(device=weight.device, dtype=torch.float32)
    with torch.no_grad():
        got = norm(probe.to(weight.dtype)).float()
        expected = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + _norm_eps(norm)) * weight.float()
    return torch.allclose(got, expected, rtol=1e-2, atol=1e-3)  # bf16 weights round


def _layer_norms_are_plain(block):
    """True / False, or None while the norms' weights cannot be probed (meta device, sharded)."""
    verdicts = [_is_plain_rms_norm(norm) for norm in (block.input_layernorm, block.post_attention_layernorm)]
    return None if None in verdicts else all(verdicts)


class _LlamaHalf(_Half):
    def _spec(self) -> LayerSpec:
        """The layer's spec; ``fused_norm`` left undecided at conversion (weights on the meta device,
        sharded) is probed now."""
        spec = super()._spec()
        if spec.fused_norm is None:
            spec.fused_norm = _layer_norms_are_plain(self.block)
        return spec


class _LlamaAttentionHalf(_LlamaHalf):
    takes_cond = True

    def _projections(self):
        a = _parts(_parts(self.block)["self_attn"])
        if "qkv_proj" in a:  # Phi-3: one q/k/v projection, rows [q, k, v]
            return a["qkv_proj"], a["o_proj"]
        return a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"]

    def _dropouts(self):
        return (float(getattr(_parts(self.block)["self_attn"], "attention_dropout", 0.0) or 0.0),
                _branch_p(self.block, "resid_attn_dropout"))

    def _beyond_fused(self, x):
        spec = self._spec()
        window = spec.window
        return (spec.qk_norm or not spec.fused_heads or not spec.fused_norm or spec.rope_module is not None
                or not spec.fused_attention or (window is not None and x.shape[-2] > window))

    def _qkv_weights(self):
        a = _parts(_parts(self.block)["self_attn"])
        if "qkv_proj" in a:
            return parameter(a["qkv_proj"], "weight"), parameter(a["qkv_proj"], "bias")
        return _concatenated_qkv(a["q_proj"], a["k_proj"], a["v_proj"])

    def _qkv(self, n):
        a, spec = self.block.self_attn, self._spec()
        if hasattr(a, "qkv_proj"):
            q_width, kv_width = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
            return a.qkv_proj(n).split([q_width, kv_width, kv_width], dim=-1)
        return a.q_proj(n), a.k_proj(n), a.v_proj(n)

    def _rope(self) -> dict:
        """The reference's RoPE options: theta, or the model's own scaled frequencies (read at call time:
        the buffer follows the model's device)."""
        spec = self._spec()
        rotary = spec.rope_module
        if rotary is None:
            return dict(rope_theta=spec.rope_theta)
        return dict(rope_theta=spec.rope_theta, rope_inv_freq=rotary.inv_freq,
                    rope_scale=float(rotary.attention_scaling))

    couple_op = norm_attention_couple

    def operands(self, x, layout=None):
        b, spec = _parts(self.block), self._spec()
        norm, out = b["input_layernorm"], _parts(b["self_attn"])["o_proj"]
        w_qkv, b_qkv = self._qkv_weights()
        return ((parameter(norm, "weight"), None, w_qkv, b_qkv, parameter(out, "weight"), parameter(out, "bias")),
                dict(heads=spec.heads, kv_heads=spec.kv_heads, causal=True, rope_theta=spec.rope_theta, norm="rms",
                     eps=_norm_eps(norm), **_layout_options(layout)))

    def _modules(self, x):  # one sequence per row at positions 0..T-1 (a half called alone; an empty batch)
        b, a, spec = self.block, self.block.self_attn, self._spec()
        x = self._input(x, getattr(b.input_layernorm, "weight", None))
        n = b.input_layernorm(x)
        qk_norm = (a.q_norm, a.k_norm) if spec.qk_norm else None
        q, k, v = self._qkv(n)
        out = _residual_dropout(b, "resid_attn_dropout")
        o = multi_head_attention_reference(q, k, v, heads=spec.heads,
                                           kv_heads=spec.kv_heads, causal=True,
                                           dropout=self._dropouts()[0] if b.training else 0.0,
                                           window=spec.window, qk_norm=qk_norm, **self._rope())
        return out(a.o_proj(o))


def _multiplied(block, branch):
    """``branch`` (a branch's output module), then Granite's ``residual_multiplier`` (MiniCPM3's
    ``residual_scale``) where the layer has one: each branch's output times it before the residual add.
    The fused kernels add a branch as it is: the probe at conversion finds them off for such a layer,
    which keeps its modules."""
    own = vars(block)
    multiplier = float(own.get("residual_multiplier", own.get("residual_scale", 1.0)))
    return branch if multiplier == 1.0 else (lambda out: branch(out) * multiplier)


def _mlp_branch_dropout_name(block) -> str:
    """The name of the dropout on the MLP branch's output: Phi-3's ``resid_mlp_dropout``, StableLM's
    ``dropout`` (its ``hidden_dropout``; the attention branch has none there)."""
    return "resid_mlp_dropout" if "resid_mlp_dropout" in _parts(block) else "dropout"


def _mlp_branch_dropout(block):
    return _residual_dropout(block, _mlp_branch_dropout_name(block))


class _LlamaMlpHalf(_LlamaHalf):
    rows_independent = True  # each token's MLP output from its own row (ReversibleStack token_chunk)

    def _projections(self):
        m = _parts(_parts(self.block)["mlp"])
        if "gate_up_proj" in m:  # Phi-3: one gate/up projection, rows [gate, up]
            return m["gate_up_proj"], m["down_proj"]
        return tuple(m[name] for name in ("gate_proj", "up_proj", "down_proj") if name in m)  # (none: experts)

    def _dropouts(self):
        return (_branch_p(self.block, _mlp_branch_dropout_name(self.block)),)

    def _beyond_fused(self, x):  # Gemma: GeGLU, and RMSNorm scaling by 1 + weight
        spec = self._spec()
        return not (spec.fused_mlp and spec.fused_norm)

    couple_op = swiglu_mlp_couple

    def operands(self, x, layout=None):
        b = _parts(self.block)
        m, norm = _parts(b["mlp"]), b["post_attention_layernorm"]
        if "gate_up_proj" in m:
            w_gate, w_up = parameter(m["gate_up_proj"], "weight").chunk(2, dim=0)
        else:
            w_gate, w_up = parameter(m["gate_proj"], "weight"), parameter(m["up_proj"], "weight")
        return (parameter(norm, "weight"), w_gate, w_up, parameter(m["down_proj"], "weight")), dict(eps=_norm_eps(norm))

    def _modules(self, x):
        b = self.block
        # (a mixture of experts may return its router's scores too: GPT-OSS's, which the layer drops)
        h = _first(b.mlp(b.post_attention_layernorm(self._input(x, getattr(b.post_attention_layernorm, "weight",
                                                                                None)))))
        return _multiplied(b, _mlp_branch_dropout(b))(h)


def _sliding_windows(config, depth, chunked: bool = False) -> list:
    """Each layer's sliding window (None: full attention), as the library's masks apply them:
    ``layer_types`` when the config has them (Qwen2 / Qwen3), else ``sliding_window`` for every layer
    (Mistral; LLaMA has none). ``chunked``: Llama 4's chunked-attention layers (attending within
    chunks of ``attention_chunk_size``) are the other kind too, for halves that run the library's
    modules with the mask of their kind (a window tells the kinds apart; no kernel reads it)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * depth
    known = {"full_attention", "sliding_attention", *(("chunked_attention",) if chunked else ())}
    kinds = set(layer_types) - known
    if kinds or {"sliding_attention", "chunked_attention"} <= set(layer_types):
        raise NotImplementedError(f"revify: attention layer types {sorted(kinds or set(layer_types))} are not "
                                  f"supported")
    chunk = getattr(config, "attention_chunk_size", None)
    return [window if kind == "sliding_attention" else chunk if kind == "chunked_attention" else None
            for kind in layer_types]


def _fused_parts(block, plain_attention: bool, silu_mlp: bool) -> dict:
    """What the fused kernels compute of one layer, from its own parts: layers of a model may differ
    (DeepSeek's first layers have a gated MLP, the rest a mixture of experts that runs on its own
    modules)."""
    attention, mlp = _parts(block)["self_attn"], _parts(block)["mlp"]
    gated = hasattr(mlp, "gate_up_proj") or all(hasattr(mlp, part) for part in ("gate_proj", "up_proj", "down_proj"))
    projections = hasattr(attention, "o_proj") and (
        hasattr(attention, "qkv_proj") or all(hasattr(attention, part) for part in ("q_proj", "k_proj", "v_proj")))
    return dict(fused_norm=_layer_norms_are_plain(block), fused_attention=projections and plain_attention,
                fused_mlp=silu_mlp and gated)


def _convert_llama(model, conversion, found=None):
    """LLaMA and the decoders that share its layer conventions (pre-norm RMSNorm, q/k/v/o projections
    with RoPE and GQA, gated MLP): Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (qk-norm), Gemma
    (RMSNorm by 1 + weight, GeGLU), Phi-3 (fused qkv and gate/up projections, residual dropout).
    What the fused kernels lack (qk-norm, another norm or activation, scaled RoPE, a window shorter
    than the rows, head_dim * heads != width) runs on the library path (``_Half._beyond_fused``).
    ``found``: the base model of a decoder admitted by its layer conventions, not its class
    (:func:`_llama_convention_base`): each layer must compute what its halves do on a probe
    (:func:`_probe_layers`), else nothing changes and NotImplementedError says so."""
    probe = found is not None
    base = found if probe else model.model if hasattr(model, "model") else model
    config, name = base.config, type(model).__name__
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no decoder layers")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = base.layers[0].self_attn if len(base.layers) else None
    # What the fused kernels lack, on the layers' own modules (the library path).
    plain_attention = (getattr(config, "attn_logit_softcapping", None) is None
                       and _scores_scaled_plainly(attention, head_dim))
    _require_hosted_layer_loop(name)
    qk_norm = attention is not None and hasattr(attention, "q_norm")
    silu_mlp = getattr(config, "hidden_act", None) == "silu" and not getattr(config, "mlp_bias", False)
    spec = LayerSpec(heads=heads, kv_heads=kv_heads, head_dim=head_dim, qk_norm=qk_norm,
                     fused_heads=head_dim * heads == config.hidden_size, **_rope_spec(config, name, base, head_dim))
    for block, window in zip(base.layers, _sliding_windows(config, len(base.layers))):
        block._revtriton_spec = replace(spec, window=window, **_fused_parts(block, plain_attention, silu_mlp))
    if probe:
        _probe_layers(base, name, base.layers, (_HostLlamaAttentionHalf, _LlamaMlpHalf), _rotary_layer_inputs(base),
                      "LLaMA's pre-norm layer x + attention(norm(x)), then + mlp(norm(h))")
    _convert_hosted_layers(model, base, "layers", conversion, (_HostLlamaBlock, _HostLlamaOrdinaryBlock),
                           _HostDecoderModel)


_LLAMA_LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
# Dropouts on the branches: Phi-3's two, StableLM's one on the MLP branch.
_LLAMA_LAYER_EXTRAS = ("resid_attn_dropout", "resid_mlp_dropout", "dropout")


def _llama_convention_base(model: nn.Module):
    """The base model of a Hugging Face decoder whose layers look like LLaMA's (``layers`` of layers
    with exactly self_attn, mlp, input_layernorm and post_attention_layernorm; a rotary embedding),
    whatever its class, or None when it does not look like one. Raises NotImplementedError naming
    what differs for one that nearly does (other parts in its layers: Gemma 2's sandwich norms; a
    forward that does not run its layers as one slice or loop)."""
    found = _library_layers(model, "model", "layers")
    if (found is None or getattr(found[0], "rotary_emb", None) is None
            or not _has_layer_parts(found[1][0], _LLAMA_LAYER_PARTS, "LLaMA", _LLAMA_LAYER_EXTRAS)):
        return None
    # Every layer, not the first alone: Mllama's language model has cross-attention layers among them
    require_layer_parts(found[1], set(_LLAMA_LAYER_PARTS), "LLaMA", _LLAMA_LAYER_EXTRAS)
    _check_layer_slice(found[0])
    return found[0]


class _HostLlamaAttentionHalf(_HostAttention, _LlamaAttentionHalf):
    _splits_samples = True  # ReversibleStack token_chunk: a few samples at a time (engine.rows)

    def _attention_module(self):
        return self.block.self_attn

    def _attention_norm(self):
        return self.block.input_layernorm

    def _branch_dropout(self):
        return _residual_dropout(self.block, "resid_attn_dropout")

    def _branch_output(self):
        return _multiplied(self.block, self._branch_dropout())


_HostLlamaBlock, _HostLlamaOrdinaryBlock = _host_block_mixins((_HostLlamaAttentionHalf, _LlamaMlpHalf))


# LLaMA and the decoders with its layer conventions taken by their class: transformers module -> class prefix.
_BY_CLASS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
             "phi3": "Phi3"}


def _pickled_by_class() -> dict:
    pickled = {}
    for module, prefix in _BY_CLASS.items():
        path = f"transformers.models.{module}.modeling_{module}"
        pickled.update(_pickled_host_classes(path, f"{prefix}DecoderLayer", (_HostLlamaBlock, _HostLlamaOrdinaryBlock),
                                             f"{prefix}Model", _HostDecoderModel))
    return pickled


FAMILY = Family(
    "llama", ("transformers LlamaForCausalLM / LlamaModel and the Mistral, Qwen2, Qwen3, Gemma and Phi3 equivalents",
              "other decoders whose layers have LLaMA's parts (self_attn, mlp, input_layernorm, "
              "post_attention_layernorm) and compute its pre-norm layer (Granite, its residual_multiplier on both "
              "branches; MiniCPM3, its residual_scale; OLMo, SmolLM3, ...; "
              "mixture-of-experts MLPs too: Mixtral, Qwen2-MoE, DeepSeek-V3, GPT-OSS)"),
    _convert_llama, classes=tuple(("transformers", f"{prefix}{kind}") for prefix in _BY_CLASS.values()
                                  for kind in ("ForCausalLM", "Model")),
    detect=_llama_convention_base, pickled=_pickled_by_class(),
    conventions={("Host", None, "DecoderLayer"): _HostLlamaBlock,
                 ("Host", "Ordinary", "DecoderLayer"): _HostLlamaOrdinaryBlock,
                 ("Host", None, "Model"): _HostDecoderModel,
                 # an audio encoder with LLaMA's layers, found as a model's part (GLM-ASR's)
                 ("Host", None, "EncoderLayer"): _HostLlamaBlock,
                 ("Host", "Ordinary", "EncoderLayer"): _HostLlamaOrdinaryBlock,
                 ("Host", None, "Encoder"): _HostDecoderModel})
