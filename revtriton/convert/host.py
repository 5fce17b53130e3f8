"""Stand-ins for a converted model's layers: the model's own forward (a Hugging Face base model's,
timm EVA's) runs over the reversible stack, and per-block outputs step through it block by block."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from ..engine import ReversibleStack, is_reversible_block
from ..ops.attention import head_group, head_group_parts, norm_attention_reference
from ..ops.reference import packed_segments
from ..ops.streams import couple_output
from .core import (SWAPPED_MODULE, LayerSpec, _convert_blocks, _Half, _host_block_mixins, _LibraryHalf,
                   _NoCheckpointing, _parts, _RevifiedLM, _spec_of, _swap_class)


class _BlockSteps(nn.Module):
    """A reversible stack run block by block, for per-block outputs (timm's ``forward_intermediates``,
    Hugging Face's ``output_hidden_states``): step i (``steps[i](x)``, in order, ``x`` the previous
    step's output) runs block i on both streams, kept between the steps, and returns their readout.
    It also stands in for a revified ViT's ``blocks`` while timm's ``forward_intermediates`` calls them
    one by one.

    Each block is its own reversible segment: with grad, each step keeps its output streams for the
    backward (the intermediates are outputs, so memory grows with depth as with stored activations).
    Without grad, exact streams stay int32 between the steps (the same bits as the whole stack); with
    grad they pass as float values, which round on the stream's dtype beyond 2**(24 - frac_bits)."""

    def __init__(self, stack, stop=None, state=None, cond=None):
        super().__init__()
        self.stack = stack
        self.stop = len(stack) if stop is None else stop
        self.state = {} if state is None else state  # shared with slices: the streams between steps
        self.cond = cond

    def __len__(self):
        return self.stop

    def __getitem__(self, index):
        if isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1):
            stop = min(self.stop, len(self) if index.stop is None else index.stop)
            return _BlockSteps(self.stack, stop, self.state, self.cond)
        raise NotImplementedError("revified ViT: forward_intermediates takes its blocks in order from the first")

    def __iter__(self):
        return iter([functools.partial(self._step, i) for i in range(self.stop)])

    def _blocks(self, start, stop):
        stack = self.stack
        return ReversibleStack([stack[i] for i in range(start, stop)], exact=stack.exact, frac_bits=stack.frac_bits,
                               schedule=stack.schedule, streams="duplicate", readout=stack.readout,
                               token_chunk=stack.chunk_rows)

    def _step(self, i, x):
        return self._segment(i, i + 1, x)

    def _segment(self, start, stop, x, restart=False):
        """Blocks ``start`` to ``stop - 1`` as one reversible segment on the streams the previous step left
        (``x``: its output), returning their readout (a loop that reads some layers' outputs: Qwen3-VL's
        vision tower's deepstack layers). ``restart``: where the loop may have changed the previous
        step's output (Qwen3-VL's language model adds the deepstack features to it), a changed ``x``
        starts the streams again, as the first step does."""
        stack, state = self.stack, self.state
        if start == 0 or (restart and state.get("returned") is not x):
            streams = (x, x) if stack.streams == "duplicate" else tuple(x.chunk(2, dim=-1))
            state["dtype"] = x.dtype
        elif state.get("returned") is not x:
            raise RuntimeError("revified ViT: forward_intermediates must pass each block's output to the next "
                               "unchanged (the reversible stack keeps two streams between them)")
        else:
            streams = state["streams"]
        fmt = stack.stream_format(state["dtype"])
        fixed = streams[0].dtype == torch.int32
        if is_reversible_block(stack[start]) and fmt.exact and not torch.is_grad_enabled() and not fixed:
            streams = tuple(fmt.encode(s) for s in streams)  # as a segment of the whole stack starts
        elif fixed and not is_reversible_block(stack[start]):
            streams = tuple(fmt.value(s) for s in streams)  # a stage transition takes float values
        y1, y2 = self._blocks(start, stop).forward_streams(*streams, cond=self.cond)
        state["streams"] = (y1, y2)
        if y1.dtype == torch.int32:
            y1, y2 = fmt.value(y1), fmt.value(y2)
        out = torch.cat([y1, y2], dim=-1) if stack.streams == "split" else stack.read(y1, y2)
        state["returned"] = out
        return out


_warned_grad_cache = []


def _check_hf_inputs(model_name, kwargs, cross_attention: bool = False):
    unsupported = {
        "encoder_hidden_states (cross-attention)": (not cross_attention
                                                    and kwargs.get("encoder_hidden_states") is not None),
        "head_mask": kwargs.get("head_mask") is not None,
        "output_attentions=True": bool(kwargs.get("output_attentions")),
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise NotImplementedError(f"revified {model_name} does not support {', '.join(bad)}")


def _position_ids(name, kwargs, hidden):
    """The call's ``position_ids`` as int64 [B, T] (T: this call's tokens), checked; None when absent,
    or when they are a multimodal RoPE's, a position per axis ([axes, B, T]: Qwen2-VL's, which only
    the model's rotary embedding reads; its layers keep the library's path)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return None
    batch, tokens = hidden.shape[:2]
    if position_ids.dim() == 3 and position_ids.shape[-1] == tokens and position_ids.shape[1] in (1, batch):
        return None
    if position_ids.dim() != 2 or position_ids.shape[-1] != tokens or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"revified {name}: position_ids must be [batch or 1, tokens] = [{batch}, {tokens}], "
                         f"got {tuple(position_ids.shape)}")
    return position_ids.to(device=hidden.device, dtype=torch.long).expand(batch, tokens)


def _token_layout(model_name, hidden, kwargs, rope: bool, packs: bool = True):
    """The attention halves' conditioning for padded or packed rows: ``(positions, segments)``
    (int64 [B, T] each; segments as :func:`revtriton.ops.attention.sequence_mask` reads them), or
    None when every row is one sequence at positions 0..T-1 (the fused path, no mask).

    As the Hugging Face models themselves: a 2-D ``attention_mask`` (1 = token, 0 = padding) masks
    keys; without one, ``position_ids`` that restart mark packed sequences (DataCollatorWithFlattening;
    not where ``packs`` is False: a model whose library forward lets packed rows see each other);
    ``position_ids`` default to 0..T-1 and drive RoPE when ``rope``."""
    batch, tokens = hidden.shape[:2]
    device = hidden.device
    default_positions = torch.arange(tokens, device=device).expand(batch, tokens)
    position_ids = _position_ids(model_name, kwargs, hidden)
    mask = kwargs.get("attention_mask")
    segments = None
    if mask is not None:  # [batch, tokens] (checked by _check_layer_inputs)
        if not bool(mask.bool().all()):
            segments = mask.to(device=device).bool().long()
    elif packs and position_ids is not None:
        packed = packed_segments(position_ids)
        if bool((packed[:, -1] != 1).any()):
            segments = packed
    custom_positions = rope and position_ids is not None and not torch.equal(position_ids, default_positions)
    if segments is None and not custom_positions:
        return None
    positions = default_positions if position_ids is None else position_ids
    if segments is None:
        segments = torch.ones(batch, tokens, dtype=torch.long, device=device)
    return positions, segments


def _selected_states(states, last, wanted, tie_last) -> tuple:
    """The library's hidden states: the stack's input then each block's readout, the last one the
    normed output when ``tie_last``; ``wanted`` True, or the indices to keep (others None)."""
    states = list(states)
    if tie_last:
        states[-1] = last
    if wanted is not True:  # transformers 5: an index or a list of them (negative from the end)
        keep = {i % len(states) for i in ([wanted] if isinstance(wanted, int) else wanted)}
        states = [state if i in keep else None for i, state in enumerate(states)]
    return tuple(states)


# -- Hugging Face decoders through the library's own forward (transformers 5) ------------------
#
# The base model's forward stays the library's: it embeds, builds the masks (padding, packed rows,
# sliding windows), the position ids, the rotary embeddings and the cache, and loops over its layers
# (``self.layers[: n]``, ``for layer in self.layers``, ``enumerate(self.h)``) calling each with them.
# The stack's ``layers_view`` answers that loop, while the model's forward runs, with one stand-in
# per layer: each records its layer's inputs, and the last one runs the reversible stack once with
# all of them as the halves' conditioning. No layer module is called by the loop (FSDP's per-layer
# hooks run around the stack's own phases). LLaMA and its kin, GPT-NeoX, GPT-2 and ViT run this way.


@dataclass(eq=False)
class _HostCall:
    """One call of a revified model's own forward, as its layers' stand-ins share it."""

    stack: nn.Module
    layout: tuple | None  # (positions, segments) for the fused kernels; None: one sequence per row
    fusable: bool  # the fused kernels can mask what the library's mask does (not a custom 4-D mask)
    hidden_states: bool  # output_hidden_states: the stack runs block by block
    reads: frozenset = frozenset()  # the layers whose outputs the loop reads besides the last (segments end there)
    segment_start: int = 0  # where the segment the next read layer ends starts
    first_input: torch.Tensor | None = None
    returned: torch.Tensor | None = None
    layer_kwargs: list = None  # each layer's keyword inputs, as the library's loop gave them
    states: list = None  # hidden states (hidden_states runs)
    steps: object = None
    running: bool = False  # the stack itself runs (its own iteration sees its layers, not stand-ins)
    cache_layers: dict = field(default_factory=dict)  # cache layer index -> its state before this call
    cache_depth: int | None = None  # how many layers the cache had before this call (it may add some)
    block_index: dict = field(default_factory=dict)  # id(block) -> its index in the stack

    def index_of(self, block) -> int:
        if not self.block_index:
            self.block_index = {id(b): i for i, b in enumerate(_blocks(self.stack))}
        return self.block_index[id(block)]

    def keep_cache_layer(self, cache, index: int):
        """Before a half updates cache layer ``index``: remember its state the first time, put it back
        when the half runs again in this call (the stack's overflow report re-runs halves); a layer
        the cache created in this call starts again from nothing."""
        layers = getattr(cache, "layers", None)
        if layers is None:
            return
        if self.cache_depth is None:
            self.cache_depth = len(layers)
        if index >= self.cache_depth:
            if index in self.cache_layers:  # a re-run: the cache appends the layer again
                del layers[index:]
            self.cache_layers[index] = None
            return
        state = vars(layers[index])
        if index in self.cache_layers:
            state.clear()
            state.update(self.cache_layers[index])
        else:
            self.cache_layers[index] = dict(state)

    def restore_caches(self, cache):
        """The cache as it was before this call (a failed forward keeps no step; dynamic layers rebind
        their tensors, static ones overwrite their slots in place: the shallow states suffice)."""
        for index, saved in self.cache_layers.items():
            if saved is not None:
                state = vars(cache.layers[index])
                state.clear()
                state.update(saved)
        if self.cache_depth is not None:
            del cache.layers[self.cache_depth:]


_HOST_CALL: contextvars.ContextVar = contextvars.ContextVar("revtriton_host_call", default=None)

# The conditioning's slots (a tuple of tensors: the engine keeps them for the backward). An empty
# tensor stands for None.
# Tensors some models' loops hand every layer as they are, carried by name: BLOOM's ALiBi biases (MPT's,
# as position_bias), DeBERTa-v2's relative positions and relative embeddings, Data2Vec-vision's shared
# relative position bias (a parameter's value: its gradient flows), a decoder's encoder states and their
# mask (the cross-attention's keys and values: the encoder's gradient flows).
LAYER_TENSORS = ("alibi", "position_bias", "relative_pos", "rel_embeddings", "relative_position_bias",
                 "encoder_hidden_states", "encoder_attention_mask")
# BEiT's loop hands every layer the image's resolution (and whether to interpolate position encodings),
# from which each layer makes its own relative position bias: a CPU int64 tensor (height, width,
# interpolate), read on the host with no sync.
# Vision towers that pack their images into one row (Qwen2-VL's) hand every layer the longest image's
# length (max_seqlen, an int: a window's in Qwen2.5-VL's windowed layers), which flash attention reads:
# one per attention kind, a CPU int64 tensor too.
_COND_SLOTS = ("positions", "segments", "cos", "sin", "sliding_cos", "sliding_sin", "position_ids", "full_mask",
               "sliding_mask", *LAYER_TENSORS, "max_seqlens", "resolution", "fusable")
_SHARED = _COND_SLOTS.index(LAYER_TENSORS[0])  # where the layer tensors' slots start
_SHARED_END = _SHARED + len(LAYER_TENSORS)


@dataclass(frozen=True)
class _HostCond:
    layout: tuple | None
    position_embeddings: tuple  # the rotary embedding (full attention's where the kinds have their own)
    position_ids: torch.Tensor | None
    masks: tuple  # (full attention's, sliding attention's)
    fusable: bool
    sliding_position_embeddings: tuple | None = None  # sliding attention's own (Gemma 3's local RoPE), or None
    layer_tensors: dict = field(default_factory=dict)  # LAYER_TENSORS the loop gave its layers, by name
    resolution: tuple | None = None  # (height, width, interpolate_pos_encoding) the loop gave its layers (BEiT)
    max_seqlens: tuple = (None, None)  # (full attention's, the other kind's) max_seqlen the loop gave its layers

    def mask_for(self, block) -> torch.Tensor | None:
        """The library's mask of the block's attention kind (full, or sliding window)."""
        return self.masks[_spec_of(block).window is not None]

    def max_seqlen_for(self, block) -> int | None:
        """The max_seqlen the loop gave the block's attention kind (a vision tower's packed images), or None."""
        return self.max_seqlens[_spec_of(block).window is not None]

    def rotary_for(self, block):
        """The rotary embedding of the block's attention kind: the sliding layers' own where the model
        gives them one (Gemma 3), else the one for all."""
        if self.sliding_position_embeddings is not None and _spec_of(block).window is not None:
            return self.sliding_position_embeddings
        return self.position_embeddings


def _none_if_empty(t):
    return None if t.numel() == 0 and t.dim() == 1 else t


def _pack_host_cond(layout, position_embeddings, position_ids, masks, fusable, like, sliding_rotary=None,
                    layer_tensors=None, resolution=None, max_seqlens=(None, None)) -> tuple:
    """The halves' conditioning (``_COND_SLOTS``); ``sliding_rotary``: the sliding layers' own rotary
    embedding, where it is not ``position_embeddings``; ``layer_tensors``: {name in LAYER_TENSORS: tensor};
    ``resolution``: (height, width, interpolate_pos_encoding) or None; ``max_seqlens``: an int or None
    per attention kind."""
    layer_tensors = layer_tensors or {}
    empty = like.new_empty(0)
    positions, segments = (empty, empty) if layout is None else layout

    def cos_sin(rotary):
        if rotary is None:
            return empty, empty
        return (rotary, empty) if torch.is_tensor(rotary) else rotary

    return (positions, segments, *cos_sin(position_embeddings), *cos_sin(sliding_rotary),
            empty if position_ids is None else position_ids,
            *(empty if mask is None else mask for mask in masks),
            *(empty if layer_tensors.get(name) is None else layer_tensors[name] for name in LAYER_TENSORS),
            torch.empty(0, dtype=torch.long) if max_seqlens == (None, None) else
            torch.tensor([-1 if v is None else int(v) for v in max_seqlens]),
            torch.empty(0, dtype=torch.long) if resolution is None else torch.tensor([int(v) for v in resolution]),
            torch.tensor(bool(fusable)))


def _unpack_host_cond(cond) -> _HostCond:
    if not (isinstance(cond, tuple) and len(cond) == len(_COND_SLOTS)):
        raise RuntimeError("revtriton: a revified model's attention half ran without its model's layer inputs; "
                           "call the model (its own forward builds them), not the stack or a block alone")
    positions, segments, cos, sin, sliding_cos, sliding_sin, position_ids, full_mask, sliding_mask = cond[:_SHARED]
    max_seqlens, resolution, fusable = cond[_SHARED_END:]
    layout = None if _none_if_empty(positions) is None else (positions, segments)

    def rotary(cos, sin):
        return None if _none_if_empty(cos) is None else cos if _none_if_empty(sin) is None else (cos, sin)

    return _HostCond(layout, rotary(cos, sin), _none_if_empty(position_ids),
                     (_none_if_empty(full_mask), _none_if_empty(sliding_mask)), bool(fusable),
                     rotary(sliding_cos, sliding_sin),
                     {name: t for name, t in zip(LAYER_TENSORS, cond[_SHARED:_SHARED_END])
                      if _none_if_empty(t) is not None},
                     None if resolution.numel() == 0 else tuple(resolution.tolist()),
                     (None, None) if max_seqlens.numel() == 0 else
                     tuple(None if v < 0 else v for v in max_seqlens.tolist()))


def _blocks(stack) -> list:
    """The stack's layers, never the stand-ins (iterating the stack during a host call gives those)."""
    return list(stack._modules.values())


def _host_layer_calls(stack, index, tuples: bool = False):
    """The stack's ``layers_view``: while its model's own forward runs (and not the stack itself), the
    layer loop's slice or iteration is a list of stand-ins (:class:`_LayerStand`); otherwise None
    (the layers). ``tuples``: see :func:`_host_layer_tuple_calls`."""
    call = _HOST_CALL.get()
    if call is None or call.stack is not stack or call.running:
        return None
    positions = range(len(stack))[index]
    whole = list(range(len(stack))) if not call.hidden_states else list(range(len(positions)))  # steps: a prefix
    if list(positions) != whole:
        raise NotImplementedError(f"revified model: the layer loop must run every layer in order (got layers "
                                  f"{list(positions)} of {len(stack)}): the reversible stack runs as one")
    call.layer_kwargs = [None] * len(stack)
    layers = _blocks(stack)
    return [_LayerStand(call, i, layers[i], tuples) for i in positions]


def _host_layer_tuple_calls(stack, index):
    """:func:`_host_layer_calls` for a loop that reads ``outputs[0]`` of layers that return (hidden
    states, attention weights) (Falcon's, BLOOM's): each stand-in returns ``(hidden states, None)``."""
    return _host_layer_calls(stack, index, tuples=True)


class _LayerStand:
    """Layer i in the library's loop while its model's forward runs: called, :func:`_host_layer_call`
    (as ``(hidden states, None)`` with ``tuples``: no attention weights, output_attentions is refused);
    any other attribute is the layer's own (ModernBERT's loop reads each layer's ``attention_type``)."""

    __slots__ = ("call", "index", "layer", "tuples")

    def __init__(self, call: "_HostCall", index: int, layer, tuples: bool):
        self.call, self.index, self.layer, self.tuples = call, index, layer, tuples

    def __call__(self, *args, **kwargs):
        if args:
            hidden, args = args[0], args[1:]
        elif "hidden_states" in kwargs or "hidden_state" in kwargs:  # (Mllama's and Llama 4's vision loops name it)
            hidden = kwargs.pop("hidden_states" if "hidden_states" in kwargs else "hidden_state")
        else:
            raise TypeError(f"revified model: layer {self.index} was called without its hidden states")
        out = _host_layer_call(self.call, self.index, hidden, *args, **kwargs)
        loop_outputs = getattr(self.layer, "_loop_outputs", None)
        if loop_outputs is not None:  # what else the loop reads of its layers' outputs (T5's position bias)
            return loop_outputs(out, self.call.layer_kwargs[self.index])
        return (out, None) if self.tuples else out

    def __getattr__(self, name):
        return getattr(self.layer, name)


# A converted stack's layers_view: pickled by reference, under the package's name wherever it lives.
_host_layer_calls.__module__ = _host_layer_tuple_calls.__module__ = SWAPPED_MODULE


def _host_layer_call(call: _HostCall, i: int, hidden, *args, **kwargs):
    """Layer i's stand-in in the library's loop. Without output_hidden_states, layers before the last
    return their input unchanged and the last runs the whole stack; with it, each runs its block."""
    stack = call.stack
    if args:  # GPT-2's and ViT's loops pass the mask (and cache) by position: name them as the layer does
        signature = inspect.signature(_library_forward(stack[i]))
        rest = next((name for name, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        bound = signature.bind(None, hidden, *args, **kwargs).arguments
        named = dict(list(bound.items())[2:])  # after self and the hidden states
        kwargs = {**named, **named.pop(rest, {})}
    loop_inputs = getattr(stack[i], "_loop_inputs", None)
    if loop_inputs is not None:  # inputs a layer makes for itself and the loop hands the others (T5's bias)
        kwargs = loop_inputs(hidden, kwargs)
    if i == 0:
        call.first_input = hidden
    elif hidden is not call.returned and i - 1 not in call.reads:  # (after a read layer the loop may change it)
        raise RuntimeError("revified model: each layer's output must reach the next layer unchanged (the "
                           "reversible stack keeps two streams between them)")
    call.layer_kwargs[i] = kwargs
    if call.hidden_states:
        if i == 0:
            call.steps, call.states = _BlockSteps(stack), [hidden]
        call.steps.cond = _host_cond(call, [i], hidden)
        with _running(call, kwargs):
            out = call.steps._segment(i, i + 1, hidden, restart=i - 1 in call.reads)
        call.states.append(out)
    elif i < len(stack) - 1 and i not in call.reads:
        out = hidden
    elif call.reads:  # a loop that reads some layers' outputs: the stack runs in segments ending there
        start, call.segment_start = call.segment_start, i + 1
        if start == 0:
            call.steps = _BlockSteps(stack)
        call.steps.cond = _host_cond(call, range(start, i + 1), hidden)
        with _running(call, kwargs):
            out = call.steps._segment(start, i + 1, hidden, restart=True)
    else:
        cond = _host_cond(call, range(len(stack)), hidden)
        with _running(call, kwargs):
            out = stack(call.first_input, cond=cond)
    call.returned = out
    return out


def _library_forward(block):
    """The forward of the library's layer class a swapped block came from (the first class of its
    MRO not made by revtriton.convert that defines one)."""
    return next(klass.forward for klass in type(block).__mro__
                if klass.__module__.split(".")[:2] != SWAPPED_MODULE.split(".") and "forward" in vars(klass))


def _host_cond(call: _HostCall, layers, like) -> tuple:
    """The conditioning of ``layers`` (indices) from their recorded inputs: one set of position ids for
    all, one mask and one rotary embedding per attention kind (full / sliding window: Gemma 3 gives
    each kind its own RoPE; other models one for all)."""
    stack, first = call.stack, call.layer_kwargs[layers[0]]
    masks, rotaries, max_seqlens = [None, None], [None, None], [None, None]
    seen = [False, False]
    for i in layers:
        kwargs = call.layer_kwargs[i]
        if kwargs.get("is_causal") and not _spec_of(stack[i]).library_causal:  # (CLIP's text halves pass it on)
            raise NotImplementedError("revified model: is_causal=True layer calls are not supported")
        for key in ("position_ids", *LAYER_TENSORS):
            if kwargs.get(key) is not first.get(key) and key not in _spec_of(stack[i]).loop_remade:
                raise NotImplementedError(f"revified model: layers got different {key}")
        if _resolution(kwargs) != _resolution(first):
            raise NotImplementedError("revified model: layers got different resolutions")
        block = stack[i]
        kind = int(_spec_of(block).window is not None)
        mask = kwargs.get("attention_mask", kwargs.get("attn_mask"))  # timm's name
        rotary = kwargs.get("position_embeddings", kwargs.get("rope"))  # (cos, sin); timm EVA: one tensor
        if seen[kind] and mask is not masks[kind]:
            raise NotImplementedError("revified model: layers of one attention kind got different masks")
        if seen[kind] and rotary is not rotaries[kind]:
            raise NotImplementedError("revified model: layers of one attention kind got different rotary embeddings "
                                      "(per-layer rotary embeddings are not supported)")
        max_seqlen = kwargs.get("max_seqlen")
        if seen[kind] and max_seqlen != max_seqlens[kind]:
            raise NotImplementedError("revified model: layers of one attention kind got different max_seqlen")
        masks[kind], rotaries[kind], max_seqlens[kind], seen[kind] = mask, rotary, max_seqlen, True
    full, sliding = rotaries if seen[0] else (rotaries[1], None)
    return _pack_host_cond(call.layout, full, first.get("position_ids"), masks, call.fusable, like,
                           sliding_rotary=None if sliding is full else sliding,
                           layer_tensors={name: first.get(name) for name in LAYER_TENSORS},
                           resolution=_resolution(first), max_seqlens=tuple(max_seqlens))


def _resolution(kwargs) -> tuple | None:
    """(height, width, interpolate_pos_encoding) of a layer call that names the image's resolution (BEiT's)."""
    resolution = kwargs.get("resolution")
    if resolution is None:
        return None
    return (*(int(v) for v in resolution), int(bool(kwargs.get("interpolate_pos_encoding"))))


_CACHE_KEYS = ("cache", "past_key_values", "layer_past")  # transformers 5's name, its old one, GPT-NeoX's


def _layer_cache(kwargs):
    return next((kwargs[key] for key in _CACHE_KEYS if kwargs.get(key) is not None), None)


@contextlib.contextmanager
def _running(call: _HostCall, kwargs):
    """The stack runs (its own iteration sees its layers). If it fails while decoding (an exact
    stream's overflow report), the cache goes back to what it held before the call, so that it never
    keeps a failed step."""
    call.running = True
    try:
        yield
    except BaseException:
        cache = _layer_cache(kwargs)
        if cache is not None:
            call.restore_caches(cache)
        raise
    finally:
        call.running = False


class _HostAttention:
    """Mixin of the attention half of a layer run through its library's own forward: the fused
    kernels (with the token layout) where they compute what the library does, else the layer's own
    attention module with the library's mask, rotary embedding and, while decoding, its cache.
    Families name the layer's parts (``_attention_module``, ``_attention_norm``, ``_branch_dropout`` or
    ``_branch_output``) or say how to call them (``_library_call``)."""

    def _attention_module(self) -> nn.Module:
        raise NotImplementedError

    def _attention_norm(self) -> nn.Module:  # the norm before the attention module
        raise NotImplementedError

    def _branch_dropout(self) -> nn.Module:  # a dropout on the branch's output outside the attention module
        return nn.Identity()

    def _branch_output(self) -> nn.Module:
        """What the layer applies to its attention module's output before the residual add: the
        branch's dropout; a norm after the branch (sandwich layers)."""
        return self._branch_dropout()

    def _library_call(self, x, host: "_HostCond", extra: dict) -> torch.Tensor:
        """The layer's own norm and attention module (its hidden states, mask, position ids, the rotary
        embedding when the loop gave one, while decoding its cache), then the branch's output module."""
        norm = self._attention_norm()
        x = self._input(x, getattr(norm, "weight", None))
        rotary = host.rotary_for(self.block)
        rotary = {} if rotary is None else {"position_embeddings": rotary}
        out = self._attention_module()(hidden_states=norm(x), attention_mask=host.mask_for(self.block),
                                       position_ids=self._position_ids(host), **rotary, **extra)
        return self._branch_output()(_first(out))

    def _needs_model_rope(self) -> bool:  # RoPE only the model's rotary embedding computes
        return bool(self._spec().library_rope)

    def _library_attention(self, x, host: "_HostCond"):
        if x.numel() == 0:  # an empty batch: the library's attention cannot reshape it, the reference can
            return self._modules(x)
        return self._library_call(x, host, decoding_inputs(self.block, self._attention_module()))

    @staticmethod
    def _position_ids(host: "_HostCond"):
        """The position ids the library's attention sees: the layer's, else the packed / padded rows'
        (flash attention finds packed sequences from them when there is no mask; GPTBigCode's loop
        passes none to its layers)."""
        if host.position_ids is not None or host.layout is None:
            return host.position_ids
        return host.layout[0]

    def _fuses(self, x, host: "_HostCond") -> bool:
        return host.fusable and not _decoding() and not self._use_modules(x)

    # Families whose layers' inputs (the conditioning) all have a row a sample or one for all:
    # ReversibleStack(token_chunk=) may run their attention a few samples at a time (engine.rows).
    _splits_samples = False

    @property
    def samples_independent(self) -> bool:
        """Samples see only themselves, except while the model decodes: the library's attention then
        appends the whole batch's keys and values to its cache."""
        return self._splits_samples and not _decoding()

    def cond_samples(self, cond, start, stop, samples):
        """The conditioning of samples ``start:stop`` (engine.rows): each of the model's layer inputs
        cut to them where it has a row a sample, kept where it has one for all or is empty; None (the
        half then runs whole) where the loop gives its layers tensors of other layouts (ALiBi's,
        relative positions) or an input has another leading dim."""
        if any(_none_if_empty(t) is not None for t in cond[_SHARED:_SHARED_END]):
            return None
        shared = []
        for t in cond[:_SHARED]:
            if t.dim() == 0 or _none_if_empty(t) is None or t.shape[0] == 1:
                shared.append(t)
            elif t.shape[0] == samples:
                shared.append(t[start:stop])
            else:
                return None
        return (*shared, *cond[_SHARED:])

    def _standalone(self, cond) -> bool:
        """Called outside the model's forward (no conditioning): one sequence per row at positions
        0..T-1, as the family's own half computes it; not what only the library's modules compute
        (RoPE only the model's rotary embedding computes, other score scalings or softcapping)."""
        if cond is not None:
            return False
        if self._needs_model_rope() or not self._spec().fused_attention:
            raise RuntimeError("revtriton: this attention half computes what only its layer's own attention module "
                               "does (its model's RoPE, score scaling or softcapping): call the model, not the half "
                               "or the stack alone")
        return True

    def _fused_with(self, res, x, sign, frac_bits, host: "_HostCond"):
        layout = {} if host.layout is None else {"layout": host.layout}  # ViT's halves take none
        return self._fused(res, x, sign, frac_bits, **layout)

    def head_parts(self, wanted: int, like, cond=None) -> int:
        """The head groups the stack may compute this half in (engine.rows, ops.attention.head_group): where
        the fused path computes it (``like``: its input's shape); none on the library's modules."""
        host = None if cond is None else _unpack_host_cond(cond)
        if host is None or not self._splits_samples or not self._fuses(like, host):
            return 1
        options = self.operands(like, host.layout)[1]
        return head_group_parts(options.get("kv_heads") or options["heads"], wanted, like.shape[-2], like.shape[-1])

    def part_output(self, part: int, parts: int, x, cond=None):
        """``H_part(x)``: head group ``part`` of ``parts`` of what the fused path computes, on the reference
        path (engine.rows; the fused kernels take whole heads)."""
        host = _unpack_host_cond(cond)
        if not self._fuses(x, host):
            raise RuntimeError(f"revtriton: {type(self).__name__} computes head groups on its fused path only")
        weights, options = self.operands(x, host.layout)
        weights, options = head_group(weights, options, part, parts)
        return norm_attention_reference(self._input(x, weights[0]), *weights, **options)

    def couple(self, res, x, sign, frac_bits=None, cond=None):
        if self._standalone(cond):
            return super().couple(res, x, sign, frac_bits)
        host = _unpack_host_cond(cond)
        if self._fuses(x, host):
            return self._fused_with(res, x, sign, frac_bits, host)
        return couple_output(res, self._library_attention(x, host), sign, frac_bits)

    def __call__(self, x, cond=None):
        if self._standalone(cond):
            return super().__call__(x)
        host = _unpack_host_cond(cond)
        if self._fuses(x, host):
            return self._fused_with(torch.zeros_like(x), x, +1, None, host)[0]
        return self._library_attention(x, host)


class _ProjectedAttentionHalf(_HostAttention, _Half):
    """The attention half of an encoder layer whose norm (``_norm_name``) and attention module
    (``_attention_name``, with q / k / v / out_proj linears) the fused attention computes where the
    layer's spec says so, else through the module with the library's mask (CLIP's, Whisper's).
    Alone (no conditioning), it runs as its model runs it without a mask."""

    takes_cond = True
    _splits_samples = True  # ReversibleStack token_chunk: a few samples at a time (engine.rows)
    _norm_name = _attention_name = ""

    def _attention_module(self):
        return _parts(self.block)[self._attention_name]

    def _attention_norm(self):
        return _parts(self.block)[self._norm_name]

    def _projections(self):
        a = _parts(self._attention_module())
        return a["q_proj"], a["k_proj"], a["v_proj"], a["out_proj"]

    def _beyond_fused(self, x):
        return not self._spec().fused_attention

    def _standalone(self, cond) -> bool:
        return cond is None


def _decoding() -> bool:
    """Whether the model's forward decodes now (no grad, a cache among its layers' inputs)."""
    call = _HOST_CALL.get()
    return (not torch.is_grad_enabled() and call is not None and call.layer_kwargs is not None
            and any(kwargs is not None and _layer_cache(kwargs) is not None for kwargs in call.layer_kwargs))


def decoding_inputs(block, attention) -> dict:
    """While the model decodes (no grad, a cache among the layer's inputs): the layer's own inputs
    but those the conditioning carries (the mask, position ids, rotary embedding, ALiBi), so that the
    library's attention module ``attention`` appends to its cache (its cache layer, ``layer_idx``,
    kept to be put back if the half runs again in this call); else nothing."""
    call = _HOST_CALL.get()
    if torch.is_grad_enabled() or call is None or call.layer_kwargs is None:
        return {}
    live = call.layer_kwargs[call.index_of(block)] or {}
    cache = _layer_cache(live)
    if cache is None:
        return {}
    # (GPT-Neo's attention names its cache layer layer_id)
    index = attention.layer_idx if hasattr(attention, "layer_idx") else attention.layer_id
    call.keep_cache_layer(cache, index)
    return {key: value for key, value in live.items()
            if key not in ("attention_mask", "position_embeddings", "position_ids", *LAYER_TENSORS)}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class _HostDecoderModel(_NoCheckpointing):
    """A base model (LlamaModel, GPTNeoXModel, GPT2Model, ViTModel, ...) whose own forward runs over
    a reversible stack (see the section's comment). With grad no cache is kept (the reversible
    backward has no use for one); hidden states, when asked for, are the stack's input and each
    block's readout."""

    _class_prefix = "RevifiedHost"
    # save_pretrained writes the model's class name into the config's architectures, which
    # revtriton.from_pretrained reads back: a base model converted alone (GPT2Model, WhisperEncoder) keeps
    # the library's name (pickle finds the swapped class by its qualified name, RevifiedHost...)
    _keeps_class_name = True
    _layers = "layers"  # the attribute (path) of its layer list (the stack), or candidates (a tuple)
    _rope = True  # position ids drive RoPE (else they enter with position embeddings before the loop)
    _tokens_input = True  # input_ids / inputs_embeds and padding masks (not an image encoder)
    _caches = True  # a KV cache while decoding (a decoder)
    _tie_last = True  # the last hidden state is the normed output (ViT: the last layer's)
    _packs_rows = True  # restarting position_ids without a mask are packed rows (as transformers 5's masks)
    _cross_attention = False  # its layers' halves attend to encoder_hidden_states (else a call with them refuses)

    def _by_keyword(self, name: str, args: tuple, kwargs: dict) -> tuple:
        """``(args[:1], kwargs)`` with the positional arguments past the first named as the library's forward
        names them (LayoutLM's heads pass ``bbox`` second)."""
        parameters = list(inspect.signature(super().forward).parameters.values())
        named = [p for p in parameters[1:len(args)] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(named) != len(args) - 1 or any(p.name in kwargs for p in named):
            raise TypeError(f"revified {name}: pass arguments other than input_ids by keyword")
        return args[:1], {**kwargs, **{p.name: value for p, value in zip(named, args[1:])}}

    def forward(self, *args, **kwargs):
        name = type(self).__name__
        if len(args) > 1:
            args, kwargs = self._by_keyword(name, args, kwargs)
        _check_hf_inputs(name, kwargs, self._cross_attention)
        cache_key = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(cache_key)
        if cache is not None and not callable(getattr(cache, "get_seq_length", None)):
            raise TypeError(f"revified {name}: the cache must be a transformers Cache (DynamicCache), got "
                            f"{type(cache).__name__} (legacy tuple caches are not supported)")
        tokens = None
        if self._tokens_input:
            tokens = args[0] if args else kwargs.get("input_ids")
            if tokens is not None and tokens.dim() > 2:
                tokens = tokens.view(-1, tokens.shape[-1])  # GPT-2 takes [..., tokens] ids
            tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if tokens is not None:
            _check_layer_inputs(name, tokens, kwargs, cache)
        filled = cache is not None and bool(cache.get_seq_length())
        if torch.is_grad_enabled() and self._caches:
            if filled:
                raise NotImplementedError(f"revified {name} keeps no KV cache with grad enabled: decode under "
                                          f"torch.no_grad() / torch.inference_mode()")
            # (not in training: a seq2seq model hands its decoder config.use_cache, labels or not)
            if kwargs.get("use_cache") is True and not self.training and not _warned_grad_cache:
                _warned_grad_cache.append(True)
                import warnings

                warnings.warn(f"revtriton: revified {name} returns no KV cache with grad enabled (decode under "
                              f"torch.no_grad() to get one): feed the whole sequence at every step", stacklevel=2)
            kwargs.pop(cache_key, None)
            kwargs["use_cache"] = False
        position_ids = kwargs.get("position_ids")
        if (not filled and kwargs.get("attention_mask") is None and position_ids is not None and position_ids.dim() == 2
                and bool((packed_segments(position_ids)[:, -1] != 1).any())):
            # Packed rows (DataCollatorWithFlattening): the library separates them only without a cache.
            kwargs.pop(cache_key, None)
            kwargs["use_cache"], cache = False, None
        wanted = kwargs.pop("output_hidden_states", None)
        if wanted is None:
            wanted = getattr(self.config, "output_hidden_states", False)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        use_cache = kwargs.get("use_cache")
        use_cache = getattr(self.config, "use_cache", False) if use_cache is None else use_cache
        decoding = (self._caches and not torch.is_grad_enabled()
                    and (cache is not None or bool(use_cache)))  # the library's path
        mask = kwargs.get("attention_mask")
        # A custom 4-D mask, masks by attention kind (a dict: Gemma 3's vision-language model builds its
        # layers' masks itself) or any mask of an image encoder go to the library's modules.
        fusable = not decoding and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2
                                                     and self._tokens_input))
        layout = (_token_layout(name, tokens, kwargs, rope=self._rope, packs=self._packs_rows)
                  if tokens is not None and fusable else None)
        call = _HostCall(self._layer_stack(), layout, fusable, bool(wanted), frozenset(self._read_layers(kwargs)))
        token = _HOST_CALL.set(call)
        try:
            out = super().forward(*args, **self._output_options(), **kwargs)
        finally:
            _HOST_CALL.reset(token)
        if wanted:
            tie_last = getattr(self.config, "tie_last_hidden_states", None)
            out["hidden_states"] = _selected_states(call.states, out.last_hidden_state, wanted,
                                                    self._tie_last if tie_last is None else tie_last)
        return out if return_dict else out.to_tuple()

    def _read_layers(self, kwargs) -> tuple:
        """The layers whose outputs the library's loop reads besides the last one's, for this call's
        inputs ``kwargs``: a language model given deepstack features (Qwen3-VL's: ``deepstack_visual_embeds``)
        adds feature k to layer k's output; none for most models."""
        embeds = kwargs.get("deepstack_visual_embeds")
        return range(len(embeds)) if embeds is not None else ()

    def _output_options(self) -> dict:
        """No hidden states from the library's forward (the stack's are given instead), a dict out; none
        for a loop that takes neither (InternVL's vision encoder: the hidden states alone)."""
        return dict(output_hidden_states=False, return_dict=True) if _takes_output_options(type(self)) else {}

    def _layer_stack(self) -> ReversibleStack:
        paths = self._layers if isinstance(self._layers, tuple) else (self._layers,)
        for path in paths:
            try:
                stack = self.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(stack, ReversibleStack):
                return stack
        raise RuntimeError(f"revified {type(self).__name__} has no reversible stack at {' or '.join(paths)}")


@functools.lru_cache(maxsize=None)
def _takes_output_options(cls: type) -> bool:
    """Whether the library forward a host model's forward calls (the next one after _HostDecoderModel's in
    ``cls``'s MRO) takes output_hidden_states and return_dict (by name, or any keyword)."""
    mro = cls.__mro__
    forward = next(k.forward for k in mro[mro.index(_HostDecoderModel) + 1:] if "forward" in vars(k))
    parameters = inspect.signature(forward).parameters
    return any(p.kind is p.VAR_KEYWORD for p in parameters.values()) or "return_dict" in parameters


class _RecordsRouterLogits:
    """Mixin of a host model whose routers' logits the library records by hooks (Switch Transformers',
    NLLB-MoE's): the hooks fire in the stack's forward, which runs its halves without grad, so they are
    given only without grad (with it, the router losses made of them would get no gradient)."""

    _recorded_outputs = ("router_logits",)  # (core._record_outputs_as: the swapped class records them)

    def forward(self, *args, **kwargs):
        if kwargs.get("output_router_logits") and torch.is_grad_enabled():
            raise NotImplementedError(f"revified {type(self).__name__}: output_router_logits=True with grad enabled "
                                      f"is not supported: the router losses would get no gradient (the reversible "
                                      f"stack's forward records the router logits without grad); train without "
                                      f"them, or ask for them under torch.no_grad()")
        return super().forward(*args, **kwargs)


def _check_layer_inputs(name, tokens, kwargs, cache):
    """position_ids [batch or 1, tokens] and a 2-D attention_mask [batch, past + tokens] (a 4-D mask,
    or a dict of them by attention kind, goes to the library's attention as it is)."""
    _position_ids(name, kwargs, tokens)
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        _check_varlen(name, kwargs)
    mask = kwargs.get("attention_mask")
    if mask is None or isinstance(mask, dict) or mask.dim() == 4:  # (a dict: the layers' masks by attention kind)
        return
    batch, count = tokens.shape[:2]
    past = cache.get_seq_length() if cache is not None else 0
    if mask.dim() != 2 or tuple(mask.shape) != (batch, past + count):
        raise NotImplementedError(f"revified {name}: attention_mask must be a 2-D padding mask [batch, past + tokens] "
                                  f"= [{batch}, {past + count}] (1 = token, 0 = padding) or the library's 4-D mask, "
                                  f"got shape {tuple(mask.shape)}")


def _check_varlen(name, kwargs):
    """Flash-attention's varlen inputs (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``):
    the sequences they mark must be those the ``position_ids`` restart at, which is what the masks
    and the fused kernels separate; without position_ids they are refused (the library's own SDPA
    and eager attention would join the sequences)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise NotImplementedError(f"revified {name}: cu_seq_lens_q / cu_seq_lens_k without position_ids are not "
                                  f"supported: pass the position_ids that restart at each sequence (as "
                                  f"DataCollatorWithFlattening does by default)")
    segments = packed_segments(position_ids.reshape(1, -1))[0]
    starts = torch.nonzero(segments.diff()).flatten() + 1
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), segments.numel())])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        given = kwargs.get(key)
        if given is not None and not torch.equal(given.to(device=bounds.device, dtype=bounds.dtype), bounds):
            raise ValueError(f"revified {name}: {key}={given.tolist()} does not mark the sequences the position_ids "
                             f"restart at ({bounds.tolist()})")


def _require_hosted_layer_loop(name: str):
    """transformers 5: its models call their layers as :class:`_HostDecoderModel` needs (keyword
    inputs incl. position_embeddings, one tensor out)."""
    version = importlib.import_module("transformers").__version__
    if int(version.split(".")[0]) < 5:
        raise NotImplementedError(f"revify: {name} needs transformers >= 5 (its decoders' own forward calls each "
                                  f"layer with keyword inputs, where revtriton stands in for them); found {version}")


class _LibraryAttentionHalf(_HostAttention, _LibraryHalf):
    """An attention half that always runs its layer's own modules (``self_attn`` unless the family
    names another) with the model's mask, rotary embedding and cache. Alone (no model inputs), it
    refuses: those are the model's (the layer's spec says fused_attention=False)."""

    takes_cond = True

    def _attention_module(self):
        return self.block.self_attn

    def _modules(self, x):  # an empty batch only
        return torch.zeros_like(x)


class _HostTowerModel(_HostDecoderModel):
    """A vision or audio tower's loop: patch (or frame) embeddings in, no token ids, no cache; its last
    hidden state is its last layer's."""

    _rope, _tokens_input, _caches, _tie_last = False, False, False, False


def _blocks_renaming_a_loop_input(halves: tuple, source: str, target: str, prefix: str) -> tuple:
    """:func:`_host_block_mixins` of ``halves`` for a loop that hands each layer ``source`` where the
    conditioning carries ``target`` (Qwen's vision loops: ``cu_seqlens`` as the attention mask; Llama 4's:
    ``freqs_ci`` as the rotary embedding): the (reversible, ordinary) block mixins, named ``prefix`` and theirs."""
    def _loop_inputs(self, hidden, kwargs: dict) -> dict:
        kwargs = dict(kwargs)
        kwargs[target] = kwargs.pop(source)
        return kwargs

    return tuple(type(f"{prefix}{m.__name__[5:]}", (m,), {"_loop_inputs": _loop_inputs})
                 for m in _host_block_mixins(halves))


def _convert_library_tower(model, loop, layers: str, parts: set, conversion, mixins: tuple, model_mixin: type,
                           specs=None, layer_tuples: bool = False, optional_parts: tuple = ()):
    """A tower whose halves run its layers' own modules: ``loop`` (``model`` or one of its modules)
    runs the layer list ``layers``, each layer's submodules exactly ``parts`` (and any of ``optional_parts``);
    ``specs``: each layer's LayerSpec where it is not the library path's alone (an attention kind);
    ``layer_tuples``: a loop that reads ``outputs[0]`` (:func:`_convert_hosted_layers`)."""
    from .probe import require_layer_parts  # (probe imports this module)

    name, layer_list = type(model).__name__, getattr(loop, layers)
    if not len(layer_list):
        raise ValueError(f"revify: {name} has no layers")
    _require_hosted_layer_loop(name)
    require_layer_parts(layer_list, parts, name, optional_parts)
    for i, layer in enumerate(layer_list):
        layer._revtriton_spec = LayerSpec(fused_attention=False, fused_mlp=False) if specs is None else specs[i]
    _convert_hosted_layers(model, loop, layers, conversion, mixins, model_mixin, layer_tuples)


def _convert_hosted_layers(model, base, layers: str, conversion, mixins: tuple, model_mixin: type,
                           layer_tuples: bool = False):
    """The end of a Hugging Face family's conversion: the layer list at path ``layers`` of ``base``
    becomes the stack (:func:`_convert_blocks`, blocks of ``mixins``), which answers the base model's
    layer loop (``layers_view``; ``layer_tuples``: a loop that reads ``outputs[0]``); the base model's
    forward sets up each call (``model_mixin``), and the head class around it (an LM: generate keeps
    the library's cache; a classifier) warns on gradient-checkpointing requests (:class:`_RevifiedLM`)."""
    owner, _, attribute = layers.rpartition(".")
    _convert_blocks(base.get_submodule(owner), attribute, base.config.hidden_size, conversion, mixins)
    base.get_submodule(layers).layers_view = _host_layer_tuple_calls if layer_tuples else _host_layer_calls
    _swap_class(base, model_mixin)
    if model is not base:
        _swap_class(model, _RevifiedLM)
