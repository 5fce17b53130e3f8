"""Hugging Face T5, mT5, UMT5, Pop2Piano and LongT5: both stacks (``T5Stack``: the encoder and the decoder,
found as parts of ``T5ForConditionalGeneration``, ``T5Model``, ``T5EncoderModel`` and the other heads).
Each block is pre-norm: ``x + dropout(SelfAttention(layer_norm(x)))``, in a decoder then
``+ dropout(EncDecAttention(layer_norm(h), encoder states))``, then
``+ dropout(DenseReluDense(layer_norm(h)))``. F is the attention branch (a decoder's self- then
cross-attention), G the feed-forward; both run the block's own modules through the library's forward
(its mask, its cache while decoding).

The relative position bias is shared: the first block's self-attention makes it (from its
``relative_attention_bias`` table) and the stack's loop hands it to the others. The first block's
stand-in makes it before the stack runs (:meth:`_T5Loop._loop_inputs`), so every half reads the same
bias from the conditioning and its gradient reaches the table. The cross-attention has no relative bias
(zeros, as the library's). UMT5's blocks each make their own bias (a table a block): nothing is shared.
LongT5's decoder is T5's; its encoder attends locally (each token to ``local_radius`` tokens each way,
block by block) or transient-globally (also to each ``global_block_size`` block's mean token): its
first block's bias holds the stack's local mask (and the global tokens' part), which the loop hands on
as T5's, so the stand-in makes it the library's way. Switch Transformers' stacks are T5's with a
feed-forward of experts in every ``sparse_step``-th block (a top-1 router; its jitter noise drawn again
in the rebuild as dropout is); the library records the routers' logits by hooks, which the swapped
stack keeps, and only without grad (their losses' gradients would not reach the routers).
T5's fp16 clamps between the branches have no reversible form: the halves leave them out (they act only
on values past fp16's range)."""
from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .core import Family, LayerSpec, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import (_convert_hosted_layers, _HostDecoderModel, _LibraryAttentionHalf, _RecordsRouterLogits,
                   _require_hosted_layer_loop)


class _T5AttentionHalf(_LibraryAttentionHalf):
    """F: the self-attention branch with the shared relative position bias, then (given an encoder's
    states) the cross-attention branch on the sum."""

    def _attention_module(self):
        return self.block.layer[0].SelfAttention

    def _library_call(self, x, host, extra):
        # scaled_dot_product_attention picks its kernel by whether its mask (here the bias, with the
        # causal or padding mask in it) needs grad: the forward runs without grad, the rebuild with it.
        # One kernel for both, so that the rebuild computes the forward's bits (exact streams check them).
        with sdpa_kernel(SDPBackend.MATH):
            return self._branches(x, host, extra)

    def _branches(self, x, host, extra):
        cache = {"cache": extra["cache"]} if extra.get("cache") is not None else {}  # (while decoding)
        attention = self.block.layer[0]
        x = self._input(x, attention.layer_norm.weight)
        attended = attention.dropout(self._self_attention(attention.layer_norm(x), host, cache))
        states = host.layer_tensors.get("encoder_hidden_states")
        if states is None:  # an encoder's block (or a decoder called without an encoder)
            return attended
        cross = self.block.layer[1]
        mask = host.layer_tensors.get("encoder_attention_mask")
        return attended + cross.dropout(self._cross_attention(cross.layer_norm(x + attended), states, mask, cache))

    def _self_attention(self, normed, host, cache):
        out = self.block.layer[0].SelfAttention(normed, mask=host.mask_for(self.block),
                                                position_bias=host.layer_tensors.get("position_bias"), **cache)
        return out[0]

    def _cross_attention(self, normed, states, mask, cache):
        return self.block.layer[1].EncDecAttention(normed, key_value_states=states, mask=mask, **cache)[0]


class _UMT5AttentionHalf(_T5AttentionHalf):
    """UMT5's F: each block's self-attention makes its own relative position bias (its own table); its
    attention modules name their arguments otherwise."""

    def _self_attention(self, normed, host, cache):
        return self.block.layer[0].SelfAttention(normed, attention_mask=host.mask_for(self.block), **cache)[0]

    def _cross_attention(self, normed, states, mask, cache):
        return self.block.layer[1].EncDecAttention(normed, encoder_hidden_states=states, attention_mask=mask,
                                                   **cache)[0]


class _T5FeedForwardHalf(_LibraryHalf):
    def _modules(self, x):
        ff = self.block.layer[-1]
        return ff.dropout(ff.DenseReluDense(ff.layer_norm(self._input(x, ff.layer_norm.weight))))


class _SwitchFeedForwardHalf(_LibraryHalf):
    """G of Switch Transformers: the block's feed-forward, a dense one or (every ``sparse_step`` blocks) a
    top-1 router over experts, each token to one expert within its capacity."""

    def _modules(self, x):
        ff = self.block.layer[-1]
        return ff.dropout(ff.mlp(ff.layer_norm(self._input(x, ff.layer_norm.weight))))


class _T5Loop:
    """What T5's loop exchanges with its blocks besides the hidden states: the first block returns the
    relative position bias it made (the loop hands it to the others) and each returns the
    cross-attention's (None: each block's cross-attention makes its zeros)."""

    def _loop_inputs(self, hidden, kwargs: dict) -> dict:
        """The first block's inputs with the relative position bias its self-attention would make (the
        loop gives it none), for the queries past the cache's tokens while decoding."""
        if kwargs.get("position_bias") is not None:
            return kwargs
        attention = self.layer[0].SelfAttention
        cache = kwargs.get("cache")
        past = int(cache.get_seq_length(attention.layer_idx)) if cache is not None else 0
        tokens = hidden.shape[1]
        bias = attention.compute_bias(tokens, past + tokens, device=hidden.device, past_seen_tokens=past)
        return {**kwargs, "position_bias": bias}

    def _loop_outputs(self, out, kwargs: dict) -> tuple:
        return out, kwargs["position_bias"], None


class _LongT5Loop(_T5Loop):
    """LongT5's loop also reads a decoder block's cross-attention bias (its outputs: the hidden states,
    the self-attention's bias and weights, the cross-attention's): None, so that each block's
    cross-attention makes its zeros, as the first one does for the library."""

    def _loop_outputs(self, out, kwargs: dict) -> tuple:
        return out, kwargs["position_bias"], None, None, None


class _LongT5LocalAttentionHalf(_T5AttentionHalf):
    """F of LongT5's local-attention encoder: each token attends to the tokens within ``local_radius``,
    block by block; the first block's bias has the stack's local mask in it (the others take it as is)."""

    _attention = "LocalSelfAttention"

    def _attention_module(self):
        return getattr(self.block.layer[0], self._attention)

    def _self_attention(self, normed, host, cache):
        return self._attention_module()(normed, mask=host.mask_for(self.block),
                                        position_bias=host.layer_tensors.get("position_bias"))[0]


class _LongT5GlobalAttentionHalf(_LongT5LocalAttentionHalf):
    """F of LongT5's transient-global encoder: local attention plus each block's mean tokens (made from
    the hidden states and the padding mask in every layer); the first block's bias also holds the
    global tokens' part."""

    _attention = "TransientGlobalSelfAttention"


class _LongT5LocalLoop(_LongT5Loop):
    def _loop_inputs(self, hidden, kwargs: dict) -> dict:
        """The first block's inputs with the bias its local attention would make: the relative positions'
        over a block and its two neighbours, plus the stack's local mask (-1e10 where masked)."""
        if kwargs.get("position_bias") is not None:
            return kwargs
        attention = self.layer[0].LocalSelfAttention
        bias = attention.compute_bias(attention.block_len)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            bias = bias + torch.where(mask > 0, 0.0, -1e10).transpose(1, 2)
        return {**kwargs, "position_bias": bias}


class _LongT5GlobalLoop(_LongT5Loop):
    def _loop_inputs(self, hidden, kwargs: dict) -> dict:
        """The first block's inputs with the bias its transient-global attention would make: the local
        bias with the local mask, then the global tokens' (their relative positions and which a token may
        see), as the library's module computes them."""
        if kwargs.get("position_bias") is not None:
            return kwargs
        from transformers.models.longt5 import modeling_longt5 as library

        attention = self.layer[0].TransientGlobalSelfAttention
        block_len, mask = attention.block_len, kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(hidden.shape[:2])  # (where the library's module makes it: the CPU)
            local = None
        else:
            local = library._get_local_attention_mask(mask, block_len, hidden.device)
        _, global_segment_ids = library._make_global_fixed_block_ids(mask, attention.global_block_size)
        bias = attention.compute_bias(block_len)
        if local is not None:
            bias = bias + torch.where(local > 0, 0.0, -1e10).transpose(1, 2)
        bias = bias.type(hidden.dtype)
        side = library._split_into_blocks(attention.compute_side_bias(mask, global_segment_ids), block_len, dim=-2)
        side = side.transpose(1, 2).type(hidden.dtype).to(hidden.device)
        return {**kwargs, "position_bias": torch.cat([bias, side], dim=-1)}


def _with_loop(loop: type, mixins: tuple) -> tuple:
    """The block mixins (reversible, ordinary) with ``loop``'s exchange with the stack's loop first."""
    return tuple(type(f"_Host{loop.__name__[1:]}{m.__name__[5:]}", (loop, m), {}) for m in mixins)


_T5Block, _T5OrdinaryBlock = _host_block_mixins((_T5AttentionHalf, _T5FeedForwardHalf))
_HostT5Block, _HostT5OrdinaryBlock = _with_loop(_T5Loop, (_T5Block, _T5OrdinaryBlock))
_HostUMT5Block, _HostUMT5OrdinaryBlock = _host_block_mixins((_UMT5AttentionHalf, _T5FeedForwardHalf))
_HostSwitchBlock, _HostSwitchOrdinaryBlock = _with_loop(
    _T5Loop, _host_block_mixins((_T5AttentionHalf, _SwitchFeedForwardHalf)))


# LongT5's blocks by their stack's kind (one library class, LongT5Block: their swapped classes named apart)
_LONGT5_MIXINS = {
    "decoder": _with_loop(_LongT5Loop, (_T5Block, _T5OrdinaryBlock)),
    "local": _with_loop(_LongT5LocalLoop, _host_block_mixins((_LongT5LocalAttentionHalf, _T5FeedForwardHalf),
                                                             "RevifiedHostLocal")),
    "transient-global": _with_loop(_LongT5GlobalLoop, _host_block_mixins(
        (_LongT5GlobalAttentionHalf, _T5FeedForwardHalf), "RevifiedHostTransientGlobal")),
}


class _HostT5Stack(_HostDecoderModel):
    """T5Stack: its blocks are ``block``, relative positions (no position ids); a decoder's has a cache
    while decoding and its blocks attend to the encoder's states."""

    _layers, _rope = "block", False

    @property
    def _caches(self):
        return self.is_decoder

    @property
    def _cross_attention(self):
        return self.is_decoder


class _HostSwitchStack(_RecordsRouterLogits, _HostT5Stack):
    """SwitchTransformersStack: T5's, its routers' logits recorded as the library records them, without
    grad only."""


# stack class -> (module, its block class, whether the first block's bias is shared, the block mixins)
_STACKS = {"T5Stack": ("t5", "T5Block", True, (_HostT5Block, _HostT5OrdinaryBlock)),
           "MT5Stack": ("mt5", "MT5Block", True, (_HostT5Block, _HostT5OrdinaryBlock)),
           "Pop2PianoStack": ("pop2piano", "Pop2PianoBlock", True, (_HostT5Block, _HostT5OrdinaryBlock)),
           "UMT5Stack": ("umt5", "UMT5Block", False, (_HostUMT5Block, _HostUMT5OrdinaryBlock)),
           "LongT5Stack": ("longt5", "LongT5Block", True, None),  # (its blocks' mixins: _LONGT5_MIXINS)
           "SwitchTransformersStack": ("switch_transformers", "SwitchTransformersBlock", True,
                                       (_HostSwitchBlock, _HostSwitchOrdinaryBlock))}
_HOSTS = {"SwitchTransformersStack": _HostSwitchStack}  # (the others: _HostT5Stack)
_SELF_ATTENTION_PARTS = {"decoder": "LayerSelfAttention", "local": "LayerLocalSelfAttention",
                         "transient-global": "LayerTransientGlobalSelfAttention"}


def _convert_t5(model, conversion, found=None):
    name, blocks = type(model).__name__, model.block
    stack = next(cls.__name__ for cls in type(model).__mro__ if cls.__name__ in _STACKS)
    _, _, shared, mixins = _STACKS[stack]
    if not len(blocks):
        raise ValueError(f"revify: {name} has no blocks")
    _require_hosted_layer_loop(name)
    attention = "LayerSelfAttention"
    if mixins is None:  # LongT5: a decoder, or an encoder of local or transient-global attention
        kind = "decoder" if model.is_decoder else model.config.encoder_attention_type
        mixins, attention = _LONGT5_MIXINS[kind], _SELF_ATTENTION_PARTS[kind]
    parts = (attention, "LayerCrossAttention", "LayerFF") if model.is_decoder else (attention, "LayerFF")
    for i, block in enumerate(blocks):
        found = tuple(type(sub).__name__ for sub in block.layer)
        if len(found) != len(parts) or not all(got.endswith(part) for got, part in zip(found, parts)):
            raise NotImplementedError(f"revify: {name} block {i} has sublayers {found}, not T5's {parts}")
        own = next(module for module in block.layer[0].children() if hasattr(module, "has_relative_attention_bias"))
        if shared and own.has_relative_attention_bias != (i == 0):
            raise NotImplementedError(f"revify: {name} block {i}: only the first block's self-attention may make "
                                      f"the relative position bias the loop shares (a bias of each block's own is "
                                      f"UMT5's layout, not {stack}'s)")
        block._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False)
    _convert_hosted_layers(model, model, "block", conversion, mixins, _HOSTS.get(stack, _HostT5Stack))


FAMILY = Family("t5", ("transformers T5, mT5, UMT5, Pop2Piano, LongT5 and Switch Transformers: both stacks (T5Stack: "
                       "encoder and decoder, the decoder's cross-attention included) of T5ForConditionalGeneration, "
                       "T5Model, T5EncoderModel and the other heads; T5's relative position bias shared from the first "
                       "block, UMT5's one a block; LongT5's encoders of local or transient-global attention; Switch "
                       "Transformers' experts' feed-forward (their router logits only without grad)",),
                _convert_t5, halves="library",
                classes=tuple(("transformers", stack) for stack in _STACKS),
                pickled={name: entry for stack, (module, block, _, mixins) in _STACKS.items()
                         for pair in ((mixins,) if mixins is not None else tuple(_LONGT5_MIXINS.values()))
                         for name, entry in _pickled_host_classes(f"transformers.models.{module}.modeling_{module}",
                                                                  block, pair, stack,
                                                                  _HOSTS.get(stack, _HostT5Stack)).items()})
