"""Admitting a model by its layer conventions: its layer loop must be one the stand-ins answer, and
each layer must compute what its halves do, checked on a probe at conversion."""
from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from .core import _spec_of
from .host import _pack_host_cond


def _library_layers(model: nn.Module, owner: str, attribute: str):
    """``(base, layers)``: a Hugging Face base model (``model.<owner>``, or the model itself) and its
    layers at ``attribute`` (a non-empty ModuleList), or None."""
    base = getattr(model, owner, model)
    layers = getattr(base, attribute, None)
    if not type(base).__module__.startswith("transformers") or not isinstance(layers, nn.ModuleList) or not len(layers):
        return None
    return base, layers


def _has_layer_parts(layer: nn.Module, parts: tuple, family: str, extras: tuple = ()) -> bool:
    """Whether ``layer`` has the submodules ``parts`` (``family``'s pre-norm layer); a layer that has
    them and more (besides ``extras``) is a near miss, refused naming what else it has (Gemma 2's
    sandwich norms)."""
    names = {name for name, _ in layer.named_children()}
    if not set(parts) <= names:
        return False
    extra = sorted(names - set(parts) - set(extras))
    if extra:
        raise NotImplementedError(f"revify: {type(layer).__name__} has {', '.join(extra)} besides {family}'s pre-norm "
                                  f"layer parts ({', '.join(parts)}): not supported")
    return True


def require_layer_parts(layers, parts: set, whose: str, optional: tuple = ()):
    """NotImplementedError, naming the first layer whose submodules are not ``parts`` exactly (leaving out
    the ``optional`` ones it may have), ``whose`` the model the parts are named after."""
    for i, layer in enumerate(layers):
        found = {name for name, _ in layer.named_children()} - set(optional)
        if found != set(parts):
            raise NotImplementedError(f"revify: {type(layer).__name__} has parts {sorted(found)} (layer {i}), not "
                                      f"{whose}'s {sorted(parts)}: not supported")


def _check_block_loop(base, tuples: bool = False) -> bool:
    """The base model's loop over ``h`` must take each block's output as the next hidden states (a
    stand-in returns them), or, with ``tuples``, may read them as ``outputs[0]`` of a layer that
    returns (hidden states, attention weights) (Falcon's loop; GPT-Neo's and ImageGPT's too). Returns
    whether the loop reads ``outputs[0]`` (the stand-ins must then return a tuple:
    :func:`host._host_layer_tuple_calls`)."""
    if tuples and _loop_source_matches(base, r"outputs = block\((?:.|\n)*?hidden_states = outputs\[0\]"):
        return True
    _require_layer_loop(base, r"hidden_states = block\(",
                        "take each layer's output as the next hidden states (hidden_states = block(...))")
    return False


def _loop_source_matches(module: nn.Module, pattern: str) -> bool:
    """Whether ``module``'s forward source matches ``pattern`` (a regular expression; False where the
    source cannot be read)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return re.search(pattern, source) is not None


def _require_layer_loop(module: nn.Module, pattern: str, what: str):
    """NotImplementedError unless ``module``'s forward source matches ``pattern`` (a regular
    expression): its layer loop is one the stack's stand-ins can answer (``what`` it must do, for the
    message). A source check: the stand-ins still refuse a loop that skips or reorders layers."""
    if not _loop_source_matches(module, pattern):
        raise NotImplementedError(f"revify: {type(module).__name__}.forward does not {what}, where a reversible "
                                  f"stack stands in for its layers: not supported")


def _causal_layer_inputs(base):
    """:func:`_probe_layers`' inputs of a decoder without RoPE: the causal mask the library builds for
    its attention implementation (a 4-D mask for eager attention, None where the kernel masks itself:
    sdpa's causal flag, flash attention)."""
    from transformers.masking_utils import create_causal_mask

    def inputs(x, block):
        batch, tokens = x.shape[:2]
        positions = torch.arange(tokens, device=x.device).expand(batch, tokens)
        mask = create_causal_mask(base.config, x, None, None, positions)
        return dict(attention_mask=mask), _pack_host_cond(None, None, None, (mask, mask), True, x)

    return inputs


def _check_layer_slice(base):
    """The base model's forward must run its ``layers`` as one slice (``self.layers[: n]``) or iterate
    over them (``for layer in self.layers``, StableLM's; ``for i, layer in enumerate(self.layers)``, Qwen2-VL's):
    the stack's ``layers_view`` answers both."""
    _require_layer_loop(base, r"self\.layers\[|\bin (?:enumerate\()?self\.layers\b",
                        "run its layers as one slice (self.layers[...]) or a loop over them (for ... in self.layers)")


def _relative_error(ours, theirs) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


def _probe_layers(base: nn.Module, name: str, layers, halves: tuple, layer_inputs, layer_kind: str,
                  parallel: bool = False):
    """Each layer's own forward against ``x + F(x) + G(x + F(x))`` from its halves (``halves``: the
    attention and MLP half classes) on the layer's own modules, then each fused branch against that
    branch (a branch that differs keeps the modules), on random inputs in eval mode without grad,
    errors relative to the update (not to x, which dominates at small weights): a model admitted by
    its layer conventions must compute what its halves do (``x + F(x) + G(x)`` when ``parallel``).
    ``layer_inputs(x, block)`` gives the block's keyword inputs and the halves' conditioning. Features that
    depend on the values (clipping) may escape it. A failed probe leaves the layers as they were
    (their conversion specs removed)."""
    try:
        _probe_each_layer(base, name, layers, halves, layer_inputs, layer_kind, parallel)
    except BaseException:
        for block in layers:
            vars(block).pop("_revtriton_spec", None)
        raise


def _probe_each_layer(base, name, layers, halves, layer_inputs, layer_kind, parallel):
    weight = next(p for p in base.parameters() if p.is_floating_point())
    if weight.device.type == "meta" or "DTensor" in (type(weight).__name__, type(weight.data).__name__):
        import warnings

        warnings.warn(f"revtriton: {name}'s weights are not materialised: its layers were not probed against their "
                      f"halves", stacklevel=5)
        return
    tokens, device, dtype = 6, weight.device, weight.dtype
    x = torch.randn(2, tokens, base.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    tolerance = 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2
    training = base.training
    base.eval()
    try:
        with torch.no_grad():
            for i, block in enumerate(layers):
                kwargs, cond = layer_inputs(x, block)
                try:
                    out = type(block).forward(block, x, **kwargs)
                except Exception as error:  # it needs what its model's loop gives it beside them (shared KV)
                    raise NotImplementedError(
                        f"revify: {name} layer {i} ({type(block).__name__}) fails on a probe with the inputs of "
                        f"{layer_kind} ({type(error).__name__}: {error}): its model's loop gives it something more: "
                        f"not supported") from error
                out = out[0] if isinstance(out, tuple) else out
                spec = _spec_of(block)
                fused = spec.fused_attention, spec.fused_mlp
                spec.fused_attention = spec.fused_mlp = False  # the layer's own modules first
                attention, mlp = (half(block) for half in halves)
                try:
                    a = attention(x, cond)
                    m = mlp(x if parallel else x + a)
                except Exception as error:  # parts of the family's names that are called otherwise (OpenAI GPT's)
                    raise NotImplementedError(
                        f"revify: {name} layer {i} ({type(block).__name__}) does not compute {layer_kind}: its "
                        f"parts fail when called as that layer's ({type(error).__name__}: {error}): not "
                        f"supported") from error
                error = _relative_error(x + a + m - x, out - x)  # against the layer's update, not x + update
                if not error <= tolerance:
                    raise NotImplementedError(
                        f"revify: {name} layer {i} ({type(block).__name__}) does not compute {layer_kind} "
                        f"(relative difference {error:.1e} on a probe): not supported")
                # The fused kernels where they compute the same branch (not SmolLM3's layers without RoPE,
                # Helium's interleaved rotary, ...); else that branch keeps the layer's own modules.
                spec.fused_attention, spec.fused_mlp = fused
                if spec.fused_attention and not _relative_error(attention(x, cond), a) <= tolerance:
                    spec.fused_attention = False
                if spec.fused_mlp and not _relative_error(mlp(x if parallel else x + a), m) <= tolerance:
                    spec.fused_mlp = False
    finally:
        base.train(training)


def _rotary_layer_inputs(base):
    """:func:`_probe_layers`' inputs of a decoder with RoPE (LLaMA's layers, GPT-J's): a causal mask,
    positions 0..T-1 and the model's rotary embedding of them (when it has one; of the block's
    attention kind where the embedding takes one: Gemma 3's local and global RoPE)."""
    causal = _causal_layer_inputs(base)
    embedding = getattr(base, "rotary_emb", None)
    by_kind = embedding is not None and "layer_type" in inspect.signature(embedding.forward).parameters

    def inputs(x, block):
        kwargs, _ = causal(x, block)
        batch, tokens = x.shape[:2]
        positions = torch.arange(tokens, device=x.device).expand(batch, tokens)
        kwargs["position_ids"] = positions
        kind = {}
        if by_kind:
            kind["layer_type"] = "sliding_attention" if _spec_of(block).window is not None else "full_attention"
        rotary = embedding(x, positions, **kind) if embedding is not None else None
        if rotary is not None:
            kwargs["position_embeddings"] = rotary
        return kwargs, _pack_host_cond(None, rotary, positions, (kwargs["attention_mask"],) * 2, True, x)

    return inputs
