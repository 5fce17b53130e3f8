"""Hugging Face decoders whose layers normalise each branch's output ("sandwich" norms).

Gemma 2 and Gemma 3: ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``, then
``h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`` (Gemma 3's sliding and full
attention layers each with a RoPE of their own: the conditioning carries one per attention kind,
as it does their masks). OLMo 2: the same without the
norms before the branches, ``x + post_attention_layernorm(attn(x))`` and
``h + post_feedforward_layernorm(mlp(h))``. GLM-4 (and Kolibri 1): the same norms named otherwise,
``x + post_self_attn_layernorm(attn(input_layernorm(x)))`` then
``h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))`` (its post_attention_layernorm is the
MLP's norm before, as LLaMA's); AFMoE and HyperCLOVA X the same under their names (HyperCLOVA X's
residual_multiplier on both branches, as GraniteMoE's). Apertus and VaultGemma: LLaMA's pre-norm
layer, its two norms named otherwise (no norm after a branch); GraniteMoE and JetMoE: LLaMA's with
its branches named otherwise (``block_sparse_moe``, ``self_attention``), GraniteMoE's
residual_multiplier on both (GraniteMoE-Shared adds a ``shared_mlp`` beside its experts; Llama 4
names its MLP ``feed_forward``, its chunked-attention layers a kind of their own with the library's
mask, as Gemma's sliding ones). A norm after a
branch is still an additive residual:
each branch with its norms is a coupling half (attention F, MLP G). Both run the layer's own
modules (the library path: its attention with the library's mask, rotary embedding, soft-capping
and cache); each layer is probed against its own forward at conversion.
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from .core import Family, LayerSpec, _host_block_mixins, _LibraryHalf
from .host import _convert_hosted_layers, _first, _HostDecoderModel, _LibraryAttentionHalf, _require_hosted_layer_loop
from .llama import _sliding_windows
from .probe import _check_layer_slice, _library_layers, _probe_layers, _rotary_layer_inputs

# The norms' names, (before the attention, after it, before the MLP, after it; None: none there).
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
_GLM4_NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")
_AFMOE_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm")
_HYPERCLOVAX_NORMS = ("input_layernorm", "post_norm1", "post_attention_layernorm", "post_norm2")
_LLAMA_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)
# The layers this family takes, by their parts exactly -> their norms' names.
_NORMS_BY_PARTS = {
    frozenset({"self_attn", "mlp", *_GEMMA_NORMS}): _GEMMA_NORMS,  # Gemma 2, Gemma 3
    frozenset({"self_attn", "mlp", *_GEMMA_NORMS[1::2]}): (None, _GEMMA_NORMS[1], None, _GEMMA_NORMS[3]),  # OLMo 2
    frozenset({"self_attn", "mlp", *_GLM4_NORMS}): _GLM4_NORMS,  # GLM-4, Kolibri 1
    frozenset({"self_attn", "mlp", *_AFMOE_NORMS}): _AFMOE_NORMS,  # AFMoE
    frozenset({"self_attn", "mlp", *_HYPERCLOVAX_NORMS}): _HYPERCLOVAX_NORMS,  # HyperCLOVA X (residual_multiplier)
    # LLaMA's pre-norm layer with its norms named otherwise (no norm after a branch): Apertus, VaultGemma
    frozenset({"self_attn", "mlp", "attention_layernorm", "feedforward_layernorm"}):
        ("attention_layernorm", None, "feedforward_layernorm", None),
    frozenset({"self_attn", "mlp", "input_layernorm", "pre_feedforward_layernorm"}):
        ("input_layernorm", None, "pre_feedforward_layernorm", None),
    # LLaMA's pre-norm layer with its branches named otherwise: GraniteMoE's block_sparse_moe (and its
    # residual_multiplier on both branches), JetMoE's self_attention
    frozenset({"self_attn", "block_sparse_moe", "input_layernorm", "post_attention_layernorm"}): _LLAMA_NORMS,
    # GraniteMoE-Shared's: a shared MLP beside the experts, on the same normed input
    frozenset({"self_attn", "block_sparse_moe", "shared_mlp", "input_layernorm", "post_attention_layernorm"}):
        _LLAMA_NORMS,
    frozenset({"self_attention", "mlp", "input_layernorm", "post_attention_layernorm"}): _LLAMA_NORMS,
    # Llama 4's feed_forward (a dense MLP or experts with a shared one)
    frozenset({"self_attn", "feed_forward", "input_layernorm", "post_attention_layernorm"}): _LLAMA_NORMS,
}


def _parts_of(block) -> frozenset:
    return frozenset(name for name, _ in block.named_children())


def _norm(block, which: int) -> nn.Module:
    """A norm of the block's (``which``: an index into its names, kept at conversion), or Identity where
    the layer has none there."""
    names = vars(block).get("_revtriton_norms")
    if names is None:  # (a block converted before the names were kept: Gemma 2's, OLMo 2's or GLM-4's)
        names = _GLM4_NORMS if "post_mlp_layernorm" in block._modules else _GEMMA_NORMS
    norm = None if names[which] is None else block._modules.get(names[which])
    return nn.Identity() if norm is None else norm


def _branch(block, names: tuple) -> nn.Module:
    """The block's attention or MLP module: the first of ``names`` it has."""
    return next(block._modules[name] for name in names if name in block._modules)


def _scaled(block, out):
    """A branch's output times the layer's residual_multiplier (GraniteMoE's), where it has one."""
    multiplier = vars(block).get("residual_multiplier")
    return out if multiplier is None else out * multiplier


class _SandwichAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return _branch(self.block, ("self_attn", "self_attention"))

    def _attention_norm(self):
        return _norm(self.block, 0)

    def _branch_output(self):
        after = _norm(self.block, 1)
        return lambda out: _scaled(self.block, after(out))


class _SandwichMlpHalf(_LibraryHalf):
    def _modules(self, x):
        b = self.block
        after = _norm(b, 3)
        x = self._input(x, getattr(after, "weight", None))
        h = _norm(b, 2)(x)
        # (Llama 4's experts return their router's scores too, and their rows flattened)
        out = _first(_branch(b, ("mlp", "block_sparse_moe", "feed_forward"))(h)).view(h.shape)
        shared = b._modules.get("shared_mlp")
        if shared is not None:  # (GraniteMoE-Shared's, beside its experts)
            out = out + shared(h)
        return _scaled(b, after(out))


_HostSandwichBlock, _HostSandwichOrdinaryBlock = _host_block_mixins((_SandwichAttentionHalf, _SandwichMlpHalf),
                                                                    "RevifiedHostSandwich")


def _sandwich_convention(model: nn.Module):
    """The base model of a Hugging Face decoder whose ``layers`` have exactly the parts of a layer this
    family takes (``_NORMS_BY_PARTS``) and a rotary embedding, whatever its class, or None."""
    found = _library_layers(model, "model", "layers")
    if found is None or getattr(found[0], "rotary_emb", None) is None:
        return None
    if _parts_of(found[1][0]) not in _NORMS_BY_PARTS:
        return None
    _check_layer_slice(found[0])
    return found[0]


def _convert_sandwich(model, conversion, found):
    """A decoder with sandwich-norm layers (``found``: its base model): every branch on the layer's
    own modules, each layer probed against its own forward; sliding-window layers get the library's
    sliding mask (``layer_types``)."""
    base, name = found, type(model).__name__
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no decoder layers")
    _require_hosted_layer_loop(name)
    spec = LayerSpec(fused_attention=False, fused_mlp=False, library_rope=True)
    for i, (block, window) in enumerate(zip(base.layers, _sliding_windows(base.config, len(base.layers),
                                                                                        chunked=True))):
        names = _NORMS_BY_PARTS.get(_parts_of(block))
        if names is None:
            raise NotImplementedError(f"revify: {name} layer {i} has parts {sorted(_parts_of(block))}, not those of "
                                      f"its layer 0 {sorted(_parts_of(base.layers[0]))}: not supported")
        block._revtriton_spec, block._revtriton_norms = replace(spec, window=window), names
    _probe_layers(base, name, base.layers, (_SandwichAttentionHalf, _SandwichMlpHalf), _rotary_layer_inputs(base),
                  "a sandwich-norm layer x + post_norm(attention(norm(x))), then + post_norm(mlp(norm(h)))")
    _convert_hosted_layers(model, base, "layers", conversion, (_HostSandwichBlock, _HostSandwichOrdinaryBlock),
                           _HostDecoderModel)


FAMILY = Family(
    "sandwich", ("decoders whose layers normalise each branch's output (self_attn, mlp, post_attention_layernorm, "
                 "post_feedforward_layernorm, with or without input_layernorm / pre_feedforward_layernorm before "
                 "the branches: Gemma 2, Gemma 3, OLMo 2; GLM-4's names, post_self_attn_layernorm / "
                 "post_mlp_layernorm after the branches: GLM-4, Kolibri 1; AFMoE's pre_mlp_layernorm / "
                 "post_mlp_layernorm around the MLP; HyperCLOVA X's post_norm1 / post_norm2 after the branches, "
                 "its residual_multiplier on both), and LLaMA's pre-norm layers with "
                 "their norms or branches named otherwise (attention_layernorm / feedforward_layernorm: Apertus; "
                 "input_layernorm / pre_feedforward_layernorm: VaultGemma; block_sparse_moe: GraniteMoE, with "
                 "a shared_mlp: GraniteMoE-Shared; self_attention: JetMoE; feed_forward: Llama 4, its chunked "
                 "attention layers with their mask)",), _convert_sandwich,
    detect=_sandwich_convention,
    halves="library",
    conventions={("HostSandwich", None, "DecoderLayer"): _HostSandwichBlock,
                 ("HostSandwich", "Ordinary", "DecoderLayer"): _HostSandwichOrdinaryBlock})
