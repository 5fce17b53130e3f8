"""Hugging Face NLLB-MoE: both stacks (``NllbMoeEncoder``, ``NllbMoeDecoder``, found as parts of
``NllbMoeForConditionalGeneration`` / ``NllbMoeModel``). The BART lineage's pre-norm layers under other
names, with a mixture of experts in every ``sparse_step``-th layer:
``x + attn_dropout(self_attn(self_attn_layer_norm(x)))``, in a decoder then
``+ attn_dropout(cross_attention(cross_attention_layer_norm(h), encoder states))``, then
``+ ff_dropout(ffn(ff_layer_norm(h)))``. F is the attention branch (a decoder's self- then
cross-attention), G the feed-forward; both run the layer's own modules through the library's forward.

The experts' router skips padded tokens by the layer's attention mask, so G takes the conditioning as
F does (the mask of the layer's inputs). The routers' logits are recorded by the library's hooks, only
without grad (as Switch Transformers': their losses' gradients would not reach the routers)."""
from __future__ import annotations

from .core import Family, LayerSpec, _host_block_mixins, _pickled_host_classes
from .host import (_convert_hosted_layers, _first, _HostDecoderModel, _LibraryAttentionHalf, _RecordsRouterLogits,
                   _require_hosted_layer_loop)
from .probe import require_layer_parts

_ENCODER_PARTS = {"self_attn", "attn_dropout", "self_attn_layer_norm", "ffn", "ff_layer_norm", "ff_dropout"}
_DECODER_PARTS = _ENCODER_PARTS | {"cross_attention", "cross_attention_layer_norm", "activation_fn"}  # (unused)


class _NllbMoeAttentionHalf(_LibraryAttentionHalf):
    """F: the self-attention branch, then (given an encoder's states) the cross-attention branch on the sum;
    while decoding both use the model's cache (the cross-attention's keys and values computed once)."""

    def _attention_module(self):
        return self.block.self_attn

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.self_attn_layer_norm.weight)
        attended = b.attn_dropout(_first(b.self_attn(hidden_states=b.self_attn_layer_norm(x),
                                                     attention_mask=host.mask_for(b), **extra)))
        states = host.layer_tensors.get("encoder_hidden_states")
        if states is None:  # an encoder's layer
            return attended
        normed = b.cross_attention_layer_norm(x + attended)
        crossed = b.cross_attention(hidden_states=normed, key_value_states=states,
                                    attention_mask=host.layer_tensors.get("encoder_attention_mask"), **extra)
        return attended + b.attn_dropout(_first(crossed))


class _NllbMoeFeedForwardHalf(_LibraryAttentionHalf):
    """G: the feed-forward branch, dense or (a sparse layer) the experts, whose router reads the layer's
    attention mask: a half on the conditioning, as the attention's (never the cache's)."""

    def _attention_module(self):  # (what the conditioning's checks read: the layer's self-attention)
        return self.block.self_attn

    def _library_call(self, x, host, extra):  # (``extra``: the cache while decoding, which it does not use)
        b = self.block
        h = b.ff_layer_norm(self._input(x, b.ff_layer_norm.weight))
        out = b.ffn(h, host.mask_for(b)) if b.is_sparse else b.ffn(h)
        return b.ff_dropout(out)


_HostNllbMoeBlock, _HostNllbMoeOrdinaryBlock = _host_block_mixins((_NllbMoeAttentionHalf, _NllbMoeFeedForwardHalf))


class _HostNllbMoeStack(_RecordsRouterLogits, _HostDecoderModel):
    """NllbMoeEncoder / NllbMoeDecoder: sinusoidal positions added before the loop; a decoder's cache while
    decoding and its layers' cross-attention to the encoder's states; the routers' logits recorded
    without grad only."""

    _rope = False

    @property
    def _caches(self):
        return type(self).__name__.endswith("Decoder")

    @property
    def _cross_attention(self):
        return self._caches


_STACKS = {"NllbMoeEncoder": ("encoder", _ENCODER_PARTS), "NllbMoeDecoder": ("decoder", _DECODER_PARTS)}


def _convert_nllb_moe(model, conversion, found=None):
    name = type(model).__name__
    stack = next(cls.__name__ for cls in type(model).__mro__ if cls.__name__ in _STACKS)
    role, parts = _STACKS[stack]
    if not len(model.layers):
        raise ValueError(f"revify: {name} has no layers")
    _require_hosted_layer_loop(name)
    require_layer_parts(model.layers, parts, name)
    if model.layerdrop:
        raise NotImplementedError(f"revify: {name} with {role}_layerdrop={model.layerdrop} skips layers at random "
                                  f"in training, where a reversible stack runs every layer: set {role}_layerdrop=0")
    for block in model.layers:
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _convert_hosted_layers(model, model, "layers", conversion, (_HostNllbMoeBlock, _HostNllbMoeOrdinaryBlock),
                           _HostNllbMoeStack)


_MODULE = "transformers.models.nllb_moe.modeling_nllb_moe"
FAMILY = Family("nllb_moe", ("transformers NLLB-MoE: both stacks (NllbMoeEncoder, NllbMoeDecoder with its "
                             "cross-attention) of NllbMoeForConditionalGeneration / NllbMoeModel, its experts' "
                             "feed-forward reading the layer's mask (their router logits only without grad)",),
                _convert_nllb_moe, halves="library",
                classes=tuple(("transformers", stack) for stack in _STACKS),
                pickled={name: entry for stack in _STACKS
                         for name, entry in _pickled_host_classes(
                             _MODULE, f"{stack}Layer", (_HostNllbMoeBlock, _HostNllbMoeOrdinaryBlock), stack,
                             _HostNllbMoeStack).items()})
