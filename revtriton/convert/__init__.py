"""``revify(model)``: turn the transformer blocks of an existing timm or Hugging Face model into
one reversible stack, in place, reusing each block's weights.

Supported: timm ``VisionTransformer`` (standard ``Block``) and ``Eva``, Hugging Face ``GPT2LMHeadModel`` /
``GPT2Model``, ``GPTNeoX...``, ViT, and ``LlamaForCausalLM`` / ``LlamaModel`` with the decoders that
share LLaMA's layer conventions (Mistral, Qwen2, Qwen3, Gemma, Phi-3: ``...ForCausalLM`` / ``...Model``; any
decoder whose layers have LLaMA's parts and compute its pre-norm layer, checked
on a probe at conversion: Granite, OLMo, SmolLM3, Helium, Starcoder2, ...). Also found by their layer
conventions and probed the same way: decoders with GPT-2's layers (GPTBigCode), with parallel
layers of one norm (GPT-J, CodeGen, Phi, Cohere), and pre-norm encoders with BERT's layer parts
(RoBERTa-PreLayerNorm, XLM-RoBERTa-XL).

How it works:

* Each block keeps its class's weights and submodules; its class is swapped for a subclass
  that adds ``coupling_halves()`` (F = norm1 + attention, G = norm2 + MLP). The halves are
  light objects that read the block's parameters at call time, not registered submodules, so
  ``state_dict`` keys, PEFT target names and FSDP wrap policies are unchanged.
* The block list (timm ``blocks``, GPT-2 ``h``, LLaMA ``layers``) is replaced by a
  :class:`~revtriton.engine.ReversibleStack` whose children are the same blocks, registered
  ``"0"``, ``"1"``, ... as before.
* Hugging Face models (LLaMA and its kin, GPT-2, GPT-NeoX, ViT; transformers 5) keep their base
  model's own forward: the library builds masks, position ids, rotary embeddings and the cache, and
  its layer loop meets stand-ins that run the stack once with every layer's inputs as the halves'
  conditioning (see ``_HostDecoderModel``). The heads and their losses (``labels=...``) are the
  library's own.

By default the function changes: a block becomes ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)`` on two
streams (both start as the block input; the output is their mean) instead of
``x + F(x) + G(x + F(x))``, and pretrained weights are only a starting point. ``preserve=`` keeps
the trained function instead (MEFT, Liao, Tan and Monz, NeurIPS 2023): scaled couplings with the
pretrained layer as one half and a zero-initialised adapter as the other, where the layer's input
reaches it unchanged up to a term of ``2**-scale_bits`` (see :data:`PRESERVE_MODES`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import operator
import re
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from ..engine import Coupling, ReversibleStack, block_phase, is_reversible_block
from ..halves.adapter import Adapter
from ..halves.base import half_output
from ..halves.randomness import half_generator
from ..lm_loss import prepare_causal_lm
from ..ops.attention import multi_head_attention_reference, norm_attention_couple
from ..ops.mlp import norm_mlp_couple, swiglu_mlp_couple
from ..ops.reference import packed_segments, rope_inv_freq
from ..ops.streams import MAX_SCALE_SHIFT, couple_output, from_fixed, to_fixed

SUPPORTED = ("timm VisionTransformer", "timm Eva (EVA-02, pre-norm EvaBlock)",
             "transformers GPT2LMHeadModel", "transformers GPT2Model",
             "transformers GPTNeoXForCausalLM / GPTNeoXModel",
             "transformers LlamaForCausalLM / LlamaModel and the Mistral, Qwen2, Qwen3, Gemma and Phi3 equivalents",
             "other decoders whose layers have LLaMA's parts (self_attn, mlp, input_layernorm, "
             "post_attention_layernorm) and compute its pre-norm layer (Granite, OLMo, SmolLM3, ...)",
             "transformers ViTForImageClassification / ViTModel",
             "decoders with GPT-2's layers (ln_1, attn, ln_2, mlp: GPTBigCode) or parallel ones of one norm (ln_1, "
             "attn, mlp: GPT-J, CodeGen; input_layernorm, self_attn, mlp: Phi, Cohere)",
             "pre-norm encoders with BERT's layer parts (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL: any head)")


def revify(model: nn.Module, *, exact: bool = True, frac_bits: int = 16, anchor_every: int | None = None,
           schedule: str = "sequential", preserve: str | None = None, scale_bits: int = 6,
           adapter_size: int = 64, ordinary_top: int = 0, fused_loss: bool = True) -> nn.Module:
    """Convert ``model``'s transformer blocks into a reversible stack, in place; returns ``model``.

    ``exact``, ``frac_bits``, ``anchor_every`` and ``schedule`` are
    :class:`~revtriton.engine.ReversibleStack` options; ``anchor_every=None`` (the default) is 0,
    except for a preserving conversion on float streams: anchors every ``max(1, 8 // bits)`` blocks,
    ``bits`` being the scale bits a block's inverse amplifies rounding by.

    Args:
        preserve: None (the two-stream coupling of the block's halves: the function changes) or a
            function-preserving conversion, ``"meft1"``, ``"meft2"`` or ``"meft3"`` (see
            :data:`PRESERVE_MODES`): right after conversion the model computes what it did, up to
            the ``2**-scale_bits`` term, and zero-initialised adapters (``adapter_size`` hidden
            units, submodules ``revtriton_adapters`` of each block) are the new trainable part.
        scale_bits: the coupling scale is ``2**-scale_bits``. Larger keeps the function closer;
            exact streams keep ``scale_bits`` bits per element of each scaled stream per block
            for the inverse, float streams amplify their inverse's rounding by ``2**scale_bits``
            per block (anchors bound it: see ``anchor_every``).
        ordinary_top: the top K blocks stay ordinary (stored-activation) blocks, run after the
            reversible ones on the stream that carries the function.
        fused_loss: a causal LM trained with ``labels`` computes its loss through the chunked
            linear + cross-entropy, without logits (``output.logits`` is None then; see
            :mod:`revtriton.lm_loss`). False keeps the library's loss.

    Train everything, or only the adapters with :func:`train_adapters_only` (PEFT-style). LoRA
    (PEFT) on the pretrained projections works in either order: ``revify(get_peft_model(model,
    config))`` converts the PEFT model's base model in place and returns the PEFT model.
    Raises TypeError for an unsupported architecture and NotImplementedError for a supported
    one using a feature the reversible blocks do not reproduce (the message names it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"revify takes an nn.Module, got {type(model).__name__}")
    if preserve is not None and preserve not in PRESERVE_MODES:
        raise ValueError(f"preserve must be None or one of {tuple(PRESERVE_MODES)}, got {preserve!r}")
    for name, value, low in (("scale_bits", scale_bits, 1), ("adapter_size", adapter_size, 1),
                             ("ordinary_top", ordinary_top, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if scale_bits > MAX_SCALE_SHIFT:
        raise ValueError(f"scale_bits must be <= {MAX_SCALE_SHIFT}, got {scale_bits}")
    options = dict(exact=exact, frac_bits=frac_bits, anchor_every=anchor_every, schedule=schedule)
    conversion = _Conversion(options, preserve, scale_bits, adapter_size, ordinary_top)
    target = _peft_base_model(model)  # a PEFT model: its base model is converted, LoRA layers kept
    if type(target).__name__ == "FeatureGetterNet" and type(target).__module__.startswith("timm"):
        target = target.model  # timm features_only: the wrapped model (its forward_intermediates) is converted
    if not isinstance(fused_loss, bool):
        raise TypeError(f"fused_loss must be a bool, got {fused_loss!r}")
    recorded = dict(options, preserve=preserve, scale_bits=scale_bits, adapter_size=adapter_size,
                    ordinary_top=ordinary_top, fused_loss=fused_loss)
    for family, (module_prefix, class_name, convert) in _FAMILIES.items():
        if any(cls.__name__ == class_name and cls.__module__.startswith(module_prefix) for cls in type(target).__mro__):
            convert(target, conversion)
            _finish_conversion(target, recorded)
            return model
    if _llama_convention_base(target) is not None:  # another decoder with LLaMA's layers (Granite, OLMo, ...)
        _convert_llama(target, conversion, probe=True)
        _finish_conversion(target, recorded)
        return model
    if _parallel_convention(target) is not None:  # parallel layers (GPT-J, CodeGen, Phi, Cohere)
        _convert_parallel(target, conversion)
        _finish_conversion(target, recorded)
        return model
    if _gpt2_convention_base(target) is not None:  # another decoder with GPT-2's layers (GPTBigCode)
        _convert_gpt2(target, conversion, probe=True)
        _finish_conversion(target, recorded)
        return model
    if _prenorm_encoder_base(target) is not None:  # BERT's layer parts, pre-norm (RoBERTa-PreLayerNorm, ...)
        _convert_prenorm_encoder(target, conversion)
        _finish_conversion(target, recorded)
        return model
    cls = type(target)
    post_norm = _post_norm_layer(target)
    if post_norm is not None:
        raise NotImplementedError(
            f"revify: {cls.__name__} has post-norm layers ({post_norm}: LayerNorm after the residual add, as BERT "
            f"and RoBERTa): a reversible coupling adds each half's output to a stream, which a norm applied after "
            f"the add does not fit; pre-norm models are supported: {', '.join(SUPPORTED)}")
    raise TypeError(f"revify does not support {cls.__module__}.{cls.__qualname__}; supported: {', '.join(SUPPORTED)}")


def _finish_conversion(model: nn.Module, recorded: dict):
    """Record the options (saved with save_pretrained: revtriton.from_pretrained converts the loaded
    model again) and give a causal LM the fused loss."""
    config = getattr(model, "config", None)
    if config is not None and type(config).__module__.startswith("transformers"):
        config.revtriton = recorded
    prepare_causal_lm(model, recorded["fused_loss"])


def _post_norm_layer(model: nn.Module) -> str | None:
    """The class name of a BERT-style post-norm sublayer output (``LayerNorm(dropout(dense(h)) + input)``)
    inside ``model``, or None."""
    for module in model.modules():
        if type(module).__name__.endswith("Output") and isinstance(getattr(module, "LayerNorm", None), nn.LayerNorm):
            return type(module).__name__
    return None


def from_pretrained(path, model_class=None, **kwargs) -> nn.Module:
    """Load a revified Hugging Face model saved with ``save_pretrained`` (or Trainer's ``save_model``).

    The library's ``from_pretrained`` alone gives the plain model back and drops the weights a
    preserving conversion added (its adapters). This loads the plain model (``model_class``, by
    default the class named in the saved config's ``architectures``), converts it with the options
    recorded in its config (``config.revtriton``), then loads the whole checkpoint into it, adapters
    included. ``kwargs`` go to the library's ``from_pretrained`` (``torch_dtype``, ...).
    """
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    options = getattr(config, "revtriton", None)
    if not isinstance(options, dict):
        raise ValueError(f"{path} was not saved from a revified model (its config has no 'revtriton' entry): "
                         f"load it with the library and call revify")
    if model_class is None:
        architectures = getattr(config, "architectures", None) or []
        if not architectures or not hasattr(transformers, architectures[0]):
            raise ValueError(f"cannot tell the model class of {path} from its config (architectures="
                             f"{architectures!r}): pass model_class=")
        model_class = getattr(transformers, architectures[0])
    # The plain class does not know the adapters' weights: they are loaded below, so its warning is
    # noise. A filter, not a raised level: at WARNING or above, the library also checks a tensor-
    # parallel plan that a single-device model has none of and warns about every layer.
    logger = transformers.utils.logging.get_logger("transformers.modeling_utils")
    logger.addFilter(_only_errors)
    try:
        model = model_class.from_pretrained(path, **kwargs)
    finally:
        logger.removeFilter(_only_errors)
    revify(model, **options)
    state = _checkpoint_state(path)
    missing = set(model.state_dict()) - set(state) - _tied_keys(model)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {sorted(missing)[:5]} (of {len(missing)})")
    model.load_state_dict(state, strict=False)
    return model


def _only_errors(record) -> bool:
    """A logging filter: keep errors, drop warnings and below."""
    return record.levelno >= 40  # logging.ERROR


def _tied_keys(model) -> set:
    """State-dict keys of weights tied to another (GPT-2's lm_head): save_pretrained omits them."""
    names = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    return {name for group in names.values() for name in group[1:]}


def _checkpoint_state(path) -> dict:
    """Every tensor of a save_pretrained directory (safetensors, sharded or not; else pytorch_model.bin)."""
    import json
    from pathlib import Path

    directory = Path(path)
    index = directory / "model.safetensors.index.json"
    if index.exists() or (directory / "model.safetensors").exists():
        from safetensors.torch import load_file

        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
            "model.safetensors"]
        return {k: v for name in files for k, v in load_file(str(directory / name)).items()}
    binary = directory / "pytorch_model.bin"
    if binary.exists():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")


def _peft_base_model(model: nn.Module) -> nn.Module:
    """The model revify converts: a PEFT ``PeftModel``'s base model (the library's model with the LoRA
    layers injected into its projections, which the halves then call), else the model itself."""
    if type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


# --------------------------------------------------------------------------------------------
# Class swaps (picklable: the swapped classes are found by name in this module)


class _RevifiedBlock:
    """Mixin of a block inside a revified model: offers coupling halves, refuses per-block calls.

    Keeps the library's class name (pickled as ``Revified<name>``): wrap policies find layers by it
    (accelerate's FSDP2 ``transformer_based_wrap`` reads the model's ``_no_split_modules`` names and
    silently shards nothing per layer when no module has that name)."""

    _half_classes: tuple = ()
    _keeps_class_name = True

    def coupling_halves(self):
        attention, mlp = (cls(self) for cls in self._half_classes)
        mode = getattr(self, "_revtriton_preserve", None)
        if mode is None:
            return attention, mlp
        adapters = self.revtriton_adapters
        parallel = _parallel_residual(self)
        if mode == "meft1":
            return _WholeLayer(attention, mlp, adapters["f"], parallel), adapters["g"]
        if mode == "meft2":
            return adapters["f"], _WholeLayer(attention, mlp, parallel=parallel)
        return _SublayerWithAdapter(attention, adapters["f"]), _SublayerWithAdapter(mlp, adapters["g"])

    def reversible_phase(self, work, *tensors):
        """One use of the halves by the stack as one hookable call (FSDP2), as ReversibleBlock."""
        return block_phase(self, work, *tensors)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} is a block of a ReversibleStack made by revtriton.revify and runs only inside "
            f"the stack; per-block calls (attention masks, is_causal, gradient checkpointing) are not supported"
        )


class _OrdinaryBlock:
    """Mixin of one of the top blocks that ``ordinary_top`` leaves ordinary: the pretrained layer,
    ``x + A(x)`` then ``+ M(...)``, a stage transition of the stack (stored activations)."""

    _half_classes: tuple = ()
    _class_prefix = "RevifiedOrdinary"
    _keeps_class_name = True  # as _RevifiedBlock: found by the library's layer name

    def forward(self, x, cond=None):  # cond: a Hugging Face model's layer inputs (see _pack_host_cond)
        attention, mlp = (cls(self) for cls in self._half_classes)
        return _WholeLayer(attention, mlp, parallel=_parallel_residual(self))(x, cond)


def _host_block_mixins(halves: tuple, prefix: str = "RevifiedHost") -> tuple:
    """A family's reversible and ordinary block mixins (the swapped classes pickle by their names,
    ``<prefix><layer class>`` and ``<prefix>Ordinary<layer class>``)."""
    reversible = type("_HostBlock", (_RevifiedBlock,), dict(_half_classes=halves, _class_prefix=prefix))
    ordinary = type("_HostOrdinaryBlock", (_OrdinaryBlock,), dict(_half_classes=halves,
                                                                   _class_prefix=f"{prefix}Ordinary"))
    return reversible, ordinary


def _parallel_residual(block) -> bool:
    """A parallel residual, ``x + A(x) + M(x)``: GPT-NeoX's (an attribute of its layers), GPT-J's."""
    return bool(getattr(block, "use_parallel_residual", False) or _spec_of(block).get("parallel"))


# -- function-preserving conversion (MEFT) ------------------------------------------------------


@dataclass(frozen=True)
class PreserveMode:
    """A function-preserving conversion: which halves, which streams are scaled, swap, readout."""

    halves: str  # "layer, adapter" (F, G)
    scaled: tuple  # (scale1 scaled, scale2 scaled)
    swap: bool
    readout: str  # the stream that carries the pretrained function
    adapters: tuple  # adapter slots: "f" (F's), "g" (G's)


#: With ``L(x) = x + A(x) + M(x + A(x))`` the pretrained layer, ``A`` / ``M`` its attention and MLP
#: branches, ``Ad`` a zero-initialised adapter and ``s = 2**-scale_bits``; both streams start as h0.
#:
#: * ``"meft1"``: ``y1 = s*x1 + L(x2) + Ad_F(x2)``, ``y2 = x2 + Ad_G(y1)``, outputs swapped. Layer
#:   i's input is ``h_i`` plus ``s`` times the one before; the output is the second stream. Scales
#:   one stream. (Ad_G alone would reach the function only through the next ``s*x1``: Ad_F, beside
#:   the layer, is what adapter-only fine-tuning trains; the top block's Ad_G feeds the unread stream.)
#: * ``"meft2"``: ``y1 = x1 + Ad(x2)``, ``y2 = s*x2 + L(y1)``, outputs swapped; reads the first stream.
#: * ``"meft3"``: ``y1 = s*x1 + x2 + A(x2) + Ad_A(x2)``, ``y2 = s*x2 + y1 + M(y1) + Ad_M(y1)``
#:   (attention and MLP sublayers as the halves, an adapter beside each); reads the second stream.
#:   Scales both streams (twice the kept bits of meft1 / meft2 in exact mode).
PRESERVE_MODES = {
    "meft1": PreserveMode("layer+adapter, adapter", (True, False), True, "second", ("f", "g")),
    "meft2": PreserveMode("adapter, layer", (False, True), True, "first", ("f",)),
    "meft3": PreserveMode("attention+adapter, mlp+adapter", (True, True), False, "second", ("f", "g")),
}


@dataclass(frozen=True)
class _Conversion:
    options: dict
    preserve: str | None
    scale_bits: int
    adapter_size: int
    ordinary_top: int

    def coupling(self) -> Coupling | None:
        if self.preserve is None:
            return None
        mode, scale = PRESERVE_MODES[self.preserve], 2.0**-self.scale_bits
        return Coupling(scale if mode.scaled[0] else 1.0, scale if mode.scaled[1] else 1.0, mode.swap)

    def stack_options(self) -> dict:
        readout = "mean" if self.preserve is None else PRESERVE_MODES[self.preserve].readout
        options = dict(self.options, readout=readout)
        if options["anchor_every"] is None:
            options["anchor_every"] = self.default_anchor_every()
        return options

    def default_anchor_every(self) -> int:
        """Float streams' inverse amplifies rounding by 1 / scale per scaled stream and block: anchors
        at least every FLOAT_ANCHOR_BITS of amplification (none for exact or unscaled streams)."""
        if self.preserve is None or self.options["exact"]:
            return 0
        bits_per_block = self.scale_bits * sum(PRESERVE_MODES[self.preserve].scaled)
        return max(1, FLOAT_ANCHOR_BITS // bits_per_block)


# Float streams of a preserving conversion keep anchors so that the inverse amplifies rounding by at
# most 2**8 between them (about 1e-5 relative in float32 gradients; perf/reconstruction.py).
FLOAT_ANCHOR_BITS = 8


class _WholeLayer:
    """The pretrained layer as one half, ``L(x) = mid + M(mid)`` with ``mid = x + A(x)`` (``parallel``:
    ``L(x) = x + A(x) + M(x)``, GPT-NeoX's parallel residual), plus an adapter beside it when given
    (torch epilogue)."""

    def __init__(self, attention, mlp, adapter=None, parallel=False):
        self.attention, self.mlp, self.adapter, self.parallel = attention, mlp, adapter, parallel

    @property
    def takes_cond(self) -> bool:  # the attention half takes the model's layer inputs
        return self.attention.takes_cond

    def parameters(self):
        return self.attention.parameters()

    def __call__(self, x, cond=None):
        if self.parallel:
            out = x + half_output(self.attention, x, cond) + self.mlp(x)
        else:
            mid = x + half_output(self.attention, x, cond)
            out = mid + self.mlp(mid)
        return out if self.adapter is None else out + self.adapter(x)

    def couple(self, res, x, sign, frac_bits=None, scale=None, cond=None):
        return couple_output(res, self(x, cond), sign, frac_bits, scale)


class _SublayerWithAdapter(_WholeLayer):
    """A sublayer with its skip and an adapter beside it as one half: ``x + A(x) + Ad(x)``."""

    def __init__(self, branch, adapter):
        self.branch, self.adapter = branch, adapter

    @property
    def takes_cond(self) -> bool:
        return self.branch.takes_cond

    def parameters(self):
        return self.branch.parameters()

    def __call__(self, x, cond=None):
        return x + half_output(self.branch, x, cond) + self.adapter(x)


def _add_adapters(block: nn.Module, dim: int, conversion: _Conversion):
    """Register the preserve mode's zero-initialised adapters on a block, on its device and dtype."""
    reference = next(p for p in block.parameters() if p.is_floating_point())
    slots = PRESERVE_MODES[conversion.preserve].adapters
    block.revtriton_adapters = nn.ModuleDict(
        {slot: Adapter(dim, conversion.adapter_size).to(device=reference.device, dtype=reference.dtype)
         for slot in slots})


def _convert_blocks(owner: nn.Module, attribute: str, dim: int, conversion: _Conversion, mixins, base):
    """Swap each block's class (reversible, or ordinary for the top ``ordinary_top``), add the preserve
    mode's adapters and couplings, and replace the block list by a ReversibleStack."""
    blocks = getattr(owner, attribute)
    if isinstance(blocks, ReversibleStack):
        raise ValueError(f"{type(owner).__name__}.{attribute} is already a ReversibleStack (revify was applied)")
    if conversion.ordinary_top >= len(blocks):
        raise ValueError(f"ordinary_top={conversion.ordinary_top} leaves no reversible block of {len(blocks)}")
    reversible, ordinary = mixins
    first_ordinary = len(blocks) - conversion.ordinary_top
    coupling = conversion.coupling()
    for i, block in enumerate(blocks):
        if i >= first_ordinary:
            _swap_class(block, ordinary, *base)
            continue
        _swap_class(block, reversible, *base)
        if coupling is not None:
            block._revtriton_preserve = conversion.preserve
            block.coupling = coupling
            _add_adapters(block, dim, conversion)
    setattr(owner, attribute, ReversibleStack(list(blocks), **conversion.stack_options()))


def train_adapters_only(model: nn.Module) -> nn.Module:
    """Freeze everything but the adapters a preserving ``revify`` added (PEFT-style fine-tuning)."""
    names = [name for name, _ in model.named_parameters() if ".revtriton_adapters." in f".{name}"]
    if not names:
        raise ValueError("the model has no revtriton adapters: convert it with revify(model, preserve=...) first")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".revtriton_adapters." in f".{name}")
    return model


_BLOCK_BASES = {}  # swapped class name -> (module, class name, mixin), for unpickling in a fresh process
_swapped = {}


def _swapped_class(name: str, mixin: type, cls: type) -> type:
    """The class ``mixin + cls``, found by pickle as ``revtriton.convert.<name>`` (its ``__qualname__``).

    A mixin with ``_keeps_class_name`` keeps ``cls.__name__`` (Hugging Face writes a model's class
    name into the saved config's ``architectures``).
    """
    new_cls = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name})
    if getattr(mixin, "_keeps_class_name", False):
        new_cls.__name__ = cls.__name__
    return new_cls


def _swap_class(module: nn.Module, mixin: type, base_module: str, base_name: str):
    cls = type(module)
    if issubclass(cls, mixin):
        return
    name = f"{getattr(mixin, '_class_prefix', 'Revified')}{cls.__name__}"
    if (cls, mixin) not in _swapped:
        new_cls = _swapped_class(name, mixin, cls)
        _swapped[(cls, mixin)] = new_cls
        if cls.__name__ == base_name and cls.__module__ == base_module:
            globals()[name] = new_cls
    module.__class__ = _swapped[(cls, mixin)]


def __getattr__(name):  # module attribute hook: rebuild a swapped class on unpickling
    if name in _BLOCK_BASES:
        base_module, base_name, mixin = _BLOCK_BASES[name]
        cls = getattr(importlib.import_module(base_module), base_name)
        key = (cls, mixin)
        if key not in _swapped:
            _swapped[key] = _swapped_class(name, mixin, cls)
        globals()[name] = _swapped[key]
        return _swapped[key]
    found = _convention_class(name)
    if found is not None:
        _BLOCK_BASES[name] = found
        return __getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _convention_class(name: str):
    """``_BLOCK_BASES``' entry of a swapped class of a model admitted by its layer conventions, or None:
    a decoder with LLaMA's layers (``RevifiedHost[Ordinary]<Family>DecoderLayer``,
    ``RevifiedHost<Family>Model``), one with GPT-2's (``RevifiedHostGPT2Style[Ordinary]<Family>Block``,
    ``RevifiedHostGPT2Style<Family>Model``) or parallel ones (``RevifiedHostParallel...``: GPT-J,
    Phi), or a pre-norm BERT-style encoder (``RevifiedHostEncoder[Ordinary]<Family>Layer``,
    ``RevifiedHostEncoder<Family>Model``), its class found in the module of transformers'
    ``<Family>Model``; or the head class around any of them (``Revified<Head class>``: an LM, a
    classifier), which transformers exports by its name."""
    match = re.fullmatch(r"Revified(HostEncoder|HostGPT2Style|HostParallel|Host)?(Ordinary)?"
                         r"((\w+?)(DecoderLayer|Layer|Block|Model|For[A-Z]\w*))", name)
    if match is None:
        return None
    host, ordinary, class_name, family, kind = match.groups()
    if host is None:  # a head class (an LM, a classifier): transformers exports each by its name
        holder, mixin = class_name, None if ordinary else _RevifiedLM
    else:
        holder, mixin = f"{family}Model", _CONVENTION_MIXINS.get((host, ordinary, kind))
    if mixin is None:
        return None
    try:
        transformers = importlib.import_module("transformers")
        module = importlib.import_module(getattr(transformers, holder).__module__)
    except (ImportError, AttributeError):
        return None
    return (module.__name__, class_name, mixin) if hasattr(module, class_name) else None




# --------------------------------------------------------------------------------------------
# Halves over an existing block's weights


def _drop_path_scale(x: torch.Tensor, p: float, training: bool):
    """Per-row factor of stochastic depth: 0 or 1/keep per sample (drawn from the half's generator
    inside a stack: halves.randomness, no routing needed; the global one outside)."""
    if not training or p == 0.0:
        return None
    keep = 1.0 - p
    mask = torch.empty((x.shape[0],) + (1,) * (x.dim() - 2), device=x.device, dtype=torch.float32)
    return (mask.bernoulli_(keep, generator=half_generator(x.device)) / keep).expand(x.shape[:-1])


def _scale_rows(h, row_scale):
    return h if row_scale is None else h * row_scale.unsqueeze(-1).to(h.dtype)


def _layer_scaled(weight, bias, layer_scale: nn.Module):
    """Fold a timm LayerScale (or Identity) into the output projection."""
    gamma = getattr(layer_scale, "gamma", None)
    if gamma is None:
        return weight, bias
    gamma = gamma.to(weight.dtype)
    return weight * gamma[:, None], (None if bias is None else bias * gamma)


class _Half:
    """A coupling half over a block's own weights (not an nn.Module: the block keeps them).

    Two paths with the same math: ``_fused`` hands the raw weights to the ops layer (fused
    Triton kernels on CUDA, the pure-torch reference elsewhere); ``_modules`` calls the block's
    own submodules. The module path runs when dropout is active in training or when a
    projection is not a plain layer (a PEFT/LoRA wrapper, a quantized linear), so adapters
    are never bypassed. Halves that take the model's layer inputs as conditioning (a Hugging
    Face model's attention, EVA's) override ``couple`` / ``__call__``; here ``cond`` is None.
    """

    takes_cond = False  # the attention halves of Hugging Face models and EVA: True (see _pack_host_cond)

    def __init__(self, block: nn.Module):
        self.block = block

    def parameters(self):  # the block's (what the engine reads a stream's value dtype from)
        return self.block.parameters()

    def _projections(self):  # the modules whose raw weights the fused path reads
        return ()

    def _dropouts(self):  # the dropout probabilities the fused path cannot apply
        return ()

    def _use_modules(self, x) -> bool:
        if self.block.training and any(p > 0 for p in self._dropouts()):
            return True
        return self._beyond_fused(x) or not all(_is_plain_projection(m) for m in self._projections())

    def _beyond_fused(self, x) -> bool:  # a feature of the block the fused kernels do not have
        return False

    def _fused(self, res, x, sign, frac_bits):
        raise NotImplementedError

    def _modules(self, x):  # H(x) through the block's submodules
        raise NotImplementedError

    def _input(self, x, weight):
        # Compute in the block's dtype when the stack's input has another (fp32 inputs to a bf16 block);
        # weight None: a norm without one (OLMo's), the projections then cast as they do.
        return x if weight is None or x.dtype == weight.dtype else x.to(weight.dtype)

    def couple(self, res, x, sign, frac_bits=None, cond=None):
        if self._use_modules(x):
            return couple_output(res, self._modules(x), sign, frac_bits)
        return self._fused(res, x, sign, frac_bits)

    def __call__(self, x, cond=None):
        """H(x) with plain autograd (used by stored-activation twins)."""
        if self._use_modules(x):
            return self._modules(x)
        return self._fused(torch.zeros_like(x), x, +1, None)[0]


def _is_plain_projection(module) -> bool:
    """A projection the fused kernels compute: nn.Linear, or transformers' Conv1D (GPT-2's; its class
    is found where it lives, so an unpickled model in a fresh process, which converted nothing, runs
    the fused halves as the one that converted it did)."""
    if type(module) is nn.Linear:
        return True
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")  # imported wherever a Conv1D exists
    return pytorch_utils is not None and type(module) is getattr(pytorch_utils, "Conv1D", None)


def _layout_options(layout) -> dict:
    """norm_attention_couple's options of a token layout ``(positions, segments)`` (none without one)."""
    return {} if layout is None else dict(positions=layout[0], segments=layout[1])


def _p(dropout) -> float:  # an nn.Dropout, a probability (GPTBigCode's attention keeps a float), or None
    if isinstance(dropout, (int, float)):
        return float(dropout)
    return float(getattr(dropout, "p", 0.0) or 0.0)


# -- timm VisionTransformer ------------------------------------------------------------------


def _timm_fused_attention(block) -> bool:
    """Whether a timm Block's attention branch is what the fused half computes: LayerNorm, the
    standard Attention without qk-norm, scale-norm or gate, full width. Else the library path runs the
    block's own modules (qk-norm and the rest included)."""
    from timm.models.vision_transformer import Attention

    a = block.attn
    return (type(a) is Attention and isinstance(block.norm1, nn.LayerNorm) and block.norm1.weight is not None
            and all(isinstance(getattr(a, name, None), nn.Identity) for name in ("q_norm", "k_norm", "norm"))
            and getattr(a, "gate", None) is None
            and a.head_dim * a.num_heads == a.qkv.in_features == a.proj.out_features)


def _timm_fused_mlp(block) -> bool:
    from timm.layers import Mlp

    m = block.mlp
    return (type(m) is Mlp and isinstance(block.norm2, nn.LayerNorm) and block.norm2.weight is not None
            and isinstance(m.norm, nn.Identity) and _timm_activation(m.act) is not None)


class _TimmAttentionHalf(_Half):
    def _projections(self):
        return self.block.attn.qkv, self.block.attn.proj

    def _dropouts(self):
        return _p(self.block.attn.attn_drop), _p(self.block.attn.proj_drop)

    def _beyond_fused(self, x):
        return not getattr(self.block, "_revtriton_fused", (True, True))[0]

    def _row(self, x):
        return _drop_path_scale(x, float(getattr(self.block.drop_path1, "drop_prob", 0.0)), self.block.training)

    def _fused(self, res, x, sign, frac_bits):
        b, a = self.block, self.block.attn
        x = self._input(x, a.qkv.weight)
        w_proj, b_proj = _layer_scaled(a.proj.weight, a.proj.bias, b.ls1)
        return norm_attention_couple(res, x, sign, frac_bits, b.norm1.weight, b.norm1.bias, a.qkv.weight, a.qkv.bias,
                                     w_proj, b_proj, heads=a.num_heads, causal=False, norm="layer", eps=b.norm1.eps,
                                     row_scale=self._row(x))

    def _modules(self, x):
        b = self.block
        x = self._input(x, b.norm1.weight)
        row = self._row(x)
        return _scale_rows(b.ls1(b.attn(b.norm1(x))), row)


_GELU_KINDS = {"none": "gelu", "tanh": "gelu_tanh"}


def _timm_activation(act: nn.Module) -> str | None:
    if isinstance(act, nn.GELU):
        return _GELU_KINDS.get(act.approximate)
    if isinstance(act, nn.ReLU):
        return "relu"
    return None


class _TimmMlpHalf(_Half):
    def _projections(self):
        return tuple(m for m in (getattr(self.block.mlp, "fc1", None), getattr(self.block.mlp, "fc2", None)) if m)

    def _dropouts(self):
        return tuple(_p(getattr(self.block.mlp, name, None)) for name in ("drop1", "drop2"))

    def _beyond_fused(self, x):
        return not getattr(self.block, "_revtriton_fused", (True, True))[1]

    def _row(self, x):
        return _drop_path_scale(x, float(getattr(self.block.drop_path2, "drop_prob", 0.0)), self.block.training)

    def _fused(self, res, x, sign, frac_bits):
        b, m = self.block, self.block.mlp
        x = self._input(x, m.fc1.weight)
        w2, b2 = _layer_scaled(m.fc2.weight, m.fc2.bias, b.ls2)
        return norm_mlp_couple(res, x, sign, frac_bits, b.norm2.weight, b.norm2.bias, m.fc1.weight, m.fc1.bias, w2,
                               b2, norm="layer", activation=_timm_activation(m.act), eps=b.norm2.eps,
                               row_scale=self._row(x))

    def _modules(self, x):
        b = self.block
        x = self._input(x, b.norm2.weight)
        row = self._row(x)
        return _scale_rows(b.ls2(b.mlp(b.norm2(x))), row)


class _TimmBlock(_RevifiedBlock):
    _half_classes = (_TimmAttentionHalf, _TimmMlpHalf)


class _TimmOrdinaryBlock(_OrdinaryBlock):
    _half_classes = _TimmBlock._half_classes


def _check_timm_block(i, block):
    """timm's vision_transformer.Block (x + drop_path(ls(attn(norm1(x)))), then the MLP alike): its
    parts run fused where they are the standard ones, else through its own modules."""
    from timm.models.vision_transformer import Block

    where = f"timm block {i} ({type(block).__name__})"
    if type(block) is not Block:
        raise NotImplementedError(f"{where}: revify supports timm's standard vision_transformer.Block only "
                                  f"(parallel, residual-post-norm and other block variants differ in their residuals)")
    block._revtriton_fused = (_timm_fused_attention(block), _timm_fused_mlp(block))


class _TimmRevifiedModel:
    """A revified timm ViT: set_grad_checkpointing(True) warns (checkpoint_seq would call the
    reversible blocks one by one); forward_intermediates (and features_only models) steps through the
    stack block by block (:class:`_BlockSteps`)."""

    _keeps_class_name = True

    def forward_intermediates(self, *args, **kwargs):
        stack = self._modules["blocks"]
        self._modules["blocks"] = _BlockSteps(stack)
        try:
            return super().forward_intermediates(*args, **kwargs)
        finally:
            self._modules["blocks"] = stack

    def set_grad_checkpointing(self, enable: bool = True):
        if enable:
            import warnings

            warnings.warn(CHECKPOINTING_MESSAGE, stacklevel=2)
        self.grad_checkpointing = False


def _convert_timm_vit(model, conversion):
    for i, block in enumerate(model.blocks):
        _check_timm_block(i, block)
    model.grad_checkpointing = False  # checkpoint_seq would call blocks one by one
    _swap_class(model, _TimmRevifiedModel, "timm.models.vision_transformer", "VisionTransformer")
    _convert_blocks(model, "blocks", model.embed_dim, conversion, (_TimmBlock, _TimmOrdinaryBlock),
                    ("timm.models.vision_transformer", "Block"))


# -- timm EVA (EVA-02: rotary position embeddings, SwiGLU) --------------------------------------------


class _EvaHalf(_Half):
    """A half of a timm EvaBlock, always through its own modules: EVA's rotary leaves the prefix
    tokens unrotated and its attention may gate or norm its output, which the fused kernels do not.
    Layer scale (gamma) and stochastic depth as the block applies them."""

    def _use_modules(self, x) -> bool:
        return True

    def _scaled(self, h, gamma, drop_path, x):
        if gamma is not None:
            h = gamma * h
        return _scale_rows(h, _drop_path_scale(x, float(getattr(drop_path, "drop_prob", 0.0)), self.block.training))


class _EvaAttentionHalf(_EvaHalf):
    takes_cond = True  # the model's rotary embedding and attention mask (the stand-ins' conditioning)

    def _modules(self, x, cond=None):
        if cond is None:
            raise RuntimeError("revtriton: an EVA attention half takes its model's rotary embedding: call the model, "
                               "not the half")
        host = _unpack_host_cond(cond)
        b = self.block
        x = self._input(x, getattr(b.norm1, "weight", None))
        h = b.attn(b.norm1(x), rope=host.position_embeddings, attn_mask=host.mask_for(b))
        return self._scaled(h, b.gamma_1, b.drop_path1, x)

    def couple(self, res, x, sign, frac_bits=None, cond=None):
        return couple_output(res, self._modules(x, cond), sign, frac_bits)

    def __call__(self, x, cond=None):
        return self._modules(x, cond)


class _EvaMlpHalf(_EvaHalf):
    def _modules(self, x):
        b = self.block
        x = self._input(x, getattr(b.norm2, "weight", None))
        return self._scaled(b.mlp(b.norm2(x)), b.gamma_2, b.drop_path2, x)


_EvaBlock, _EvaOrdinaryBlock = _host_block_mixins((_EvaAttentionHalf, _EvaMlpHalf))


class _EvaRevifiedModel:
    """A revified timm EVA: forward_features and forward_intermediates are timm's own, their block
    loops meet the stack's stand-ins (whole stack; block by block for the intermediates)."""

    _keeps_class_name = True

    def _hosted(self, method, hidden_states, *args, **kwargs):
        token = _HOST_CALL.set(_HostCall(self.blocks, None, False, hidden_states))
        try:
            return method(*args, **kwargs)
        finally:
            _HOST_CALL.reset(token)

    def forward_features(self, *args, **kwargs):
        return self._hosted(super().forward_features, False, *args, **kwargs)

    def forward_intermediates(self, *args, **kwargs):
        return self._hosted(super().forward_intermediates, True, *args, **kwargs)

    set_grad_checkpointing = _TimmRevifiedModel.set_grad_checkpointing


def _convert_eva(model, conversion):
    from timm.models.eva import EvaBlock

    for i, block in enumerate(model.blocks):
        if type(block) is not EvaBlock:
            raise NotImplementedError(f"timm block {i} ({type(block).__name__}): revify supports EVA's pre-norm "
                                      f"EvaBlock only (a post-norm block norms after the residual add)")
    if getattr(model, "rope_mixed", False):
        raise NotImplementedError("revify: timm EVA with mixed (per-layer) rotary embeddings is not supported")
    model.grad_checkpointing = False
    _convert_blocks(model, "blocks", model.embed_dim, conversion, (_EvaBlock, _EvaOrdinaryBlock),
                    ("timm.models.eva", "EvaBlock"))
    model.blocks.layers_view = _host_layer_calls
    _swap_class(model, _EvaRevifiedModel, "timm.models.eva", "Eva")


# -- Hugging Face ViT (pre-norm encoder) -------------------------------------------------------------

# Hugging Face activation names -> the fused MLP's (GPT-2's activation_function, ViT's hidden_act).
_HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


class _HFViTAttentionHalf(_Half):
    def _projections(self):
        a = self.block.attention
        return a.q_proj, a.k_proj, a.v_proj, a.o_proj

    def _dropouts(self):
        return float(self.block.attention.attention_dropout or 0.0), _p(self.block.dropout)

    def _fused(self, res, x, sign, frac_bits):
        b, a = self.block, self.block.attention
        norm = b.layernorm_before
        x = self._input(x, norm.weight)
        w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        b_qkv = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        return norm_attention_couple(res, x, sign, frac_bits, norm.weight, norm.bias, w_qkv, b_qkv, a.o_proj.weight,
                                     a.o_proj.bias, heads=a.num_attention_heads, causal=False, norm="layer",
                                     eps=norm.eps)

    def _modules(self, x):
        b = self.block
        return b.dropout(b.attention(b.layernorm_before(self._input(x, b.layernorm_before.weight)))[0])


class _HFViTMlpHalf(_Half):
    def _projections(self):
        return self.block.mlp.fc1, self.block.mlp.fc2

    def _dropouts(self):
        return (_p(self.block.dropout),)

    def _beyond_fused(self, x):
        return _HF_ACTIVATIONS.get(self.block.mlp.config.hidden_act) is None

    def _fused(self, res, x, sign, frac_bits):
        b, m = self.block, self.block.mlp
        norm = b.layernorm_after
        x = self._input(x, norm.weight)
        return norm_mlp_couple(res, x, sign, frac_bits, norm.weight, norm.bias, m.fc1.weight, m.fc1.bias, m.fc2.weight,
                               m.fc2.bias, norm="layer", activation=_HF_ACTIVATIONS[m.config.hidden_act],
                               eps=norm.eps)

    def _modules(self, x):
        b = self.block
        return b.dropout(b.mlp(b.layernorm_after(self._input(x, b.layernorm_after.weight))))


def _convert_hf_vit(model, conversion):
    base = model.vit if hasattr(model, "vit") else model
    layers = getattr(base, "layers", None)
    if layers is None or not len(layers) or not hasattr(layers[0], "layernorm_before"):
        raise NotImplementedError(f"revify: this transformers version's {type(model).__name__} has no pre-norm "
                                  f"`layers` of ViTLayer (transformers 5 layout) to convert")
    attention = layers[0].attention
    if attention.head_dim * attention.num_attention_heads != base.config.hidden_size:
        raise NotImplementedError("revify: HF ViT with head_dim * heads != hidden_size is not supported")
    layer_class = type(layers[0])
    _convert_blocks(base, "layers", base.config.hidden_size, conversion, (_HostViTBlock, _HostViTOrdinaryBlock),
                    (layer_class.__module__, layer_class.__name__))
    _host_the_layer_loop(model, base, "layers", _HostViTModel)


# -- Hugging Face GPT-2 ----------------------------------------------------------------------



class _GPT2AttentionHalf(_Half):
    takes_cond = True

    def _projections(self):
        return self.block.attn.c_attn, self.block.attn.c_proj

    def _beyond_fused(self, x):  # scores not scaled by head_dim ** -0.5 (converted with the library's forward)
        return not _spec_of(self.block).get("fused_attention", True)

    def _dropouts(self):
        return _p(self.block.attn.attn_dropout), _p(self.block.attn.resid_dropout)

    def _fused(self, res, x, sign, frac_bits, layout=None):
        b, a = self.block, self.block.attn
        x = self._input(x, b.ln_1.weight)
        segments = None if layout is None else layout[1]  # positions entered with the position embeddings
        # Conv1D keeps weights as [in, out]: transpose to nn.Linear's [out, in].
        return norm_attention_couple(res, x, sign, frac_bits, b.ln_1.weight, b.ln_1.bias, a.c_attn.weight.t(),
                                     a.c_attn.bias, a.c_proj.weight.t(), a.c_proj.bias, heads=a.num_heads,
                                     causal=True, norm="layer", eps=b.ln_1.eps, segments=segments)

    def _modules(self, x):  # one sequence per row (a half called alone; an empty batch)
        b, a = self.block, self.block.attn
        x = self._input(x, b.ln_1.weight)
        q, k, v = a.c_attn(b.ln_1(x)).split(x.shape[-1], dim=-1)
        o = multi_head_attention_reference(q, k, v, heads=a.num_heads, kv_heads=a.num_heads, causal=True,
                                           rope_theta=None, dropout=_p(a.attn_dropout) if b.training else 0.0)
        return a.resid_dropout(a.c_proj(o))


def _out_in(projection) -> torch.Tensor:
    """A projection's weight as nn.Linear keeps it, [out, in] (transformers' Conv1D keeps [in, out])."""
    return projection.weight if isinstance(projection, nn.Linear) else projection.weight.t()


class _GPT2MlpHalf(_Half):
    def _projections(self):
        return self.block.mlp.c_fc, self.block.mlp.c_proj

    def _beyond_fused(self, x):  # an activation the fused kernels do not have, other projections
        return not self.block._revtriton_spec["fused_mlp"]

    def _dropouts(self):
        return (_p(self.block.mlp.dropout),)

    def _fused(self, res, x, sign, frac_bits):
        b, m = self.block, self.block.mlp
        x = self._input(x, b.ln_2.weight)
        return norm_mlp_couple(res, x, sign, frac_bits, b.ln_2.weight, b.ln_2.bias, _out_in(m.c_fc), m.c_fc.bias,
                               _out_in(m.c_proj), m.c_proj.bias, norm="layer",
                               activation=b._revtriton_spec["activation"],
                               eps=b.ln_2.eps)

    def _modules(self, x):
        b = self.block
        return b.mlp(b.ln_2(self._input(x, b.ln_2.weight)))


def _convert_gpt2(model, conversion, probe=False):
    """GPT-2 and the decoders that share its layer conventions (``h`` of blocks with ln_1, attn, ln_2,
    mlp: GPTBigCode). The fused kernels run GPT-2's own projections (transformers' Conv1D, q/k/v
    side by side) with head_dim ** -0.5 scores and a GELU / ReLU MLP; anything else runs the layer's
    own modules. ``probe``: a decoder admitted by its conventions (:func:`_gpt2_convention_base`),
    each layer checked against its own forward (:func:`_probe_layers`)."""
    from transformers.pytorch_utils import Conv1D

    base = model.transformer if hasattr(model, "transformer") else model
    config, name = base.config, type(model).__name__
    _require_hosted_layer_loop(name)
    if getattr(config, "add_cross_attention", False):
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
        block._revtriton_spec = dict(fused_attention=plain_scaling and gpt2_attention, gpt2_layout=gpt2_attention,
                                          fused_mlp=gpt2_mlp and activation is not None, activation=activation)
    if probe:
        _probe_layers(base, name, base.h, (_HostGPT2AttentionHalf, _GPT2MlpHalf), _causal_layer_inputs(base),
                      "GPT-2's pre-norm layer x + attn(ln_1(x)), then + mlp(ln_2(h))")
    mixins, model_mixin = (_HostGPT2StyleBlock, _HostGPT2StyleOrdinaryBlock), _HostGPT2StyleModel
    if not probe:
        mixins, model_mixin = (_HostGPT2Block, _HostGPT2OrdinaryBlock), _HostGPT2Model
    layer_class = type(base.h[0])
    _convert_blocks(base, "h", hidden, conversion, mixins, (layer_class.__module__, layer_class.__name__))
    _host_the_layer_loop(model, base, "h", model_mixin)


_GPT2_LAYER_PARTS = ("ln_1", "attn", "ln_2", "mlp")


def _gpt2_convention_base(model: nn.Module):
    """The base model of a Hugging Face decoder whose layers look like GPT-2's (``h`` of blocks with
    exactly ln_1, attn, ln_2 and mlp), whatever its class, or None. Raises NotImplementedError naming
    what differs for one that nearly does (other parts; a layer loop that does not take each layer's
    output as the next hidden states, GPT-Neo's ``outputs[0]``)."""
    base = getattr(model, "transformer", model)
    layers = getattr(base, "h", None)
    if not type(base).__module__.startswith("transformers") or not isinstance(layers, nn.ModuleList) or not len(layers):
        return None
    layer = layers[0]
    parts = {name for name, _ in layer.named_children()}
    if not set(_GPT2_LAYER_PARTS) <= parts:
        return None
    extra = sorted(parts - set(_GPT2_LAYER_PARTS))
    if extra:
        raise NotImplementedError(f"revify: {type(layer).__name__} has {', '.join(extra)} besides GPT-2's pre-norm "
                                  f"layer parts ({', '.join(_GPT2_LAYER_PARTS)}): not supported")
    _check_block_loop(base)
    return base


def _check_block_loop(base):
    """The base model's loop over ``h`` must take each block's output as the next hidden states (a
    stand-in returns them; GPT-Neo's and ImageGPT's loops read ``outputs[0]``)."""
    _require_layer_loop(base, r"hidden_states = block\(",
                        "take each layer's output as the next hidden states (hidden_states = block(...))")


def _require_layer_loop(module: nn.Module, pattern: str, what: str):
    """NotImplementedError unless ``module``'s forward source matches ``pattern`` (a regular
    expression): its layer loop is one the stack's stand-ins can answer (``what`` it must do, for the
    message). A source check: the stand-ins still refuse a loop that skips or reorders layers."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        source = ""
    if re.search(pattern, source) is None:
        raise NotImplementedError(f"revify: {type(module).__name__}.forward does not {what}, where a reversible "
                                  f"stack stands in for its layers: not supported")


def _causal_layer_inputs(base):
    """:func:`_probe_layers`' inputs of a decoder without RoPE: the causal mask the library builds for
    its attention implementation (a 4-D mask for eager attention, None where the kernel masks itself:
    sdpa's causal flag, flash attention)."""
    from transformers.masking_utils import create_causal_mask

    def inputs(x):
        batch, tokens = x.shape[:2]
        positions = torch.arange(tokens, device=x.device).expand(batch, tokens)
        mask = create_causal_mask(base.config, x, None, None, positions)
        return dict(attention_mask=mask), _pack_host_cond(None, None, None, (mask, mask), True, x)

    return inputs


# -- Hugging Face LLaMA ----------------------------------------------------------------------


def _norm_eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


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


def _layer_spec(block) -> dict:
    """The block's conversion spec (``_convert_llama``); ``fused_norm`` left undecided at conversion
    (weights on the meta device) is probed now."""
    spec = block._revtriton_spec
    if spec["fused_norm"] is None:
        spec["fused_norm"] = _layer_norms_are_plain(block)
    return spec


def _layer_norms_are_plain(block):
    """True / False, or None while the norms' weights cannot be probed (meta device, sharded)."""
    verdicts = [_is_plain_rms_norm(norm) for norm in (block.input_layernorm, block.post_attention_layernorm)]
    return None if None in verdicts else all(verdicts)


def _residual_dropout(block, name):
    """A dropout on a branch's output before the residual add (Phi-3's, Phi's, an encoder's output
    dropout), or Identity where the block has none."""
    return getattr(block, name, None) or nn.Identity()


class _LlamaAttentionHalf(_Half):
    takes_cond = True

    def _projections(self):
        a = self.block.self_attn
        if hasattr(a, "qkv_proj"):  # Phi-3: one q/k/v projection, rows [q, k, v]
            return a.qkv_proj, a.o_proj
        return a.q_proj, a.k_proj, a.v_proj, a.o_proj

    def _dropouts(self):
        return (float(getattr(self.block.self_attn, "attention_dropout", 0.0) or 0.0),
                _p(_residual_dropout(self.block, "resid_attn_dropout")))

    def _beyond_fused(self, x):
        spec = _layer_spec(self.block)
        window = spec["window"]
        return (spec["qk_norm"] or not spec["fused_heads"] or not spec["fused_norm"] or spec["rope_module"] is not None
                or not spec["fused_attention"] or (window is not None and x.shape[-2] > window))

    def _qkv_weights(self):
        a = self.block.self_attn
        if hasattr(a, "qkv_proj"):
            return a.qkv_proj.weight, a.qkv_proj.bias
        w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        b_qkv = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        return w_qkv, b_qkv

    def _qkv(self, n):
        a, spec = self.block.self_attn, _layer_spec(self.block)
        if hasattr(a, "qkv_proj"):
            q_width, kv_width = spec["heads"] * spec["head_dim"], spec["kv_heads"] * spec["head_dim"]
            return a.qkv_proj(n).split([q_width, kv_width, kv_width], dim=-1)
        return a.q_proj(n), a.k_proj(n), a.v_proj(n)

    def _rope(self) -> dict:
        """The reference's RoPE options: theta, or the model's own scaled frequencies (read at call time:
        the buffer follows the model's device)."""
        spec = _layer_spec(self.block)
        rotary = spec["rope_module"]
        if rotary is None:
            return dict(rope_theta=spec["rope_theta"])
        return dict(rope_theta=spec["rope_theta"], rope_inv_freq=rotary.inv_freq,
                    rope_scale=float(rotary.attention_scaling))

    def _fused(self, res, x, sign, frac_bits, layout=None):
        b, a, spec = self.block, self.block.self_attn, _layer_spec(self.block)
        norm = b.input_layernorm
        x = self._input(x, norm.weight)
        w_qkv, b_qkv = self._qkv_weights()
        return norm_attention_couple(res, x, sign, frac_bits, norm.weight, None, w_qkv, b_qkv, a.o_proj.weight,
                                     a.o_proj.bias, heads=spec["heads"], kv_heads=spec["kv_heads"], causal=True,
                                     rope_theta=spec["rope_theta"], norm="rms", eps=_norm_eps(norm),
                                     **_layout_options(layout))

    def _modules(self, x):  # one sequence per row at positions 0..T-1 (a half called alone; an empty batch)
        b, a, spec = self.block, self.block.self_attn, _layer_spec(self.block)
        x = self._input(x, getattr(b.input_layernorm, "weight", None))
        n = b.input_layernorm(x)
        qk_norm = (a.q_norm, a.k_norm) if spec["qk_norm"] else None
        q, k, v = self._qkv(n)
        out = _residual_dropout(b, "resid_attn_dropout")
        o = multi_head_attention_reference(q, k, v, heads=spec["heads"],
                                           kv_heads=spec["kv_heads"], causal=True,
                                           dropout=self._dropouts()[0] if b.training else 0.0,
                                           window=spec["window"], qk_norm=qk_norm, **self._rope())
        return out(a.o_proj(o))


class _LlamaMlpHalf(_Half):
    def _projections(self):
        m = self.block.mlp
        if hasattr(m, "gate_up_proj"):  # Phi-3: one gate/up projection, rows [gate, up]
            return m.gate_up_proj, m.down_proj
        return m.gate_proj, m.up_proj, m.down_proj

    def _dropouts(self):
        return (_p(_residual_dropout(self.block, "resid_mlp_dropout")),)

    def _beyond_fused(self, x):  # Gemma: GeGLU, and RMSNorm scaling by 1 + weight
        spec = _layer_spec(self.block)
        return not (spec["fused_mlp"] and spec["fused_norm"])

    def _fused(self, res, x, sign, frac_bits):
        b, m = self.block, self.block.mlp
        norm = b.post_attention_layernorm
        x = self._input(x, norm.weight)
        if hasattr(m, "gate_up_proj"):
            w_gate, w_up = m.gate_up_proj.weight.chunk(2, dim=0)
        else:
            w_gate, w_up = m.gate_proj.weight, m.up_proj.weight
        return swiglu_mlp_couple(res, x, sign, frac_bits, norm.weight, w_gate, w_up, m.down_proj.weight,
                                 eps=_norm_eps(norm))

    def _modules(self, x):
        b = self.block
        h = b.mlp(b.post_attention_layernorm(self._input(x, getattr(b.post_attention_layernorm, "weight", None))))
        return _residual_dropout(b, "resid_mlp_dropout")(h)


# RoPE variants whose frequencies are fixed when the model is built (the rotary embedding's inv_freq
# and attention_scaling say it all); "dynamic" and "longrope" change them with the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_spec(config, name, base, head_dim) -> dict:
    """``rope_theta`` and ``rope_module``: None for default RoPE (the fused kernels compute it from
    theta), else the model's rotary embedding, whose scaled frequencies the library path reads;
    ``library_rope``: RoPE only the model's own rotary embedding and attention compute (dynamic /
    longrope scaling, partial rotary), on the library path."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    rotary = getattr(base, "rotary_emb", None)
    if rotary is not None and (rope_type not in STATIC_ROPE_TYPES or getattr(
            rotary, "inv_freq", None) is None or rotary.inv_freq.numel() * 2 != head_dim):
        return dict(rope_theta=float(params.get("rope_theta", getattr(config, "rope_theta", 0.0)) or 0.0),
                    rope_module=rotary, library_rope=True)
    if rope_type not in STATIC_ROPE_TYPES:
        raise NotImplementedError(f"revify: {name} RoPE type {rope_type!r} is not supported (supported: "
                                  f"{', '.join(STATIC_ROPE_TYPES)}; its frequencies change with the sequence length)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise NotImplementedError(f"revify: cannot find rope_theta in the {name} config")
    theta = float(theta)
    if rotary is None or getattr(rotary, "inv_freq", None) is None:
        if rope_type != "default":
            raise NotImplementedError(f"revify: {name} has RoPE type {rope_type!r} but no rotary_emb.inv_freq to read")
        return dict(rope_theta=theta, rope_module=None)
    inv_freq = rotary.inv_freq
    default = rope_inv_freq(head_dim, theta)
    if inv_freq.shape != default.shape:
        raise NotImplementedError(f"revify: {name}'s rotary embedding covers {2 * inv_freq.numel()} of {head_dim} "
                                  f"head dims (partial rotary is not supported)")
    is_default = rope_type == "default" and float(getattr(rotary, "attention_scaling", 1.0)) == 1.0 and (
        inv_freq.device.type == "meta" or torch.allclose(inv_freq.float().cpu(), default, rtol=1e-2))  # bf16 rounds
    return dict(rope_theta=theta, rope_module=None if is_default else rotary)


def _sliding_windows(config, depth) -> list:
    """Each layer's sliding window (None: full attention), as the library's masks apply them:
    ``layer_types`` when the config has them (Qwen2 / Qwen3), else ``sliding_window`` for every layer
    (Mistral; LLaMA has none)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * depth
    kinds = set(layer_types) - {"full_attention", "sliding_attention"}
    if kinds:
        raise NotImplementedError(f"revify: attention layer types {sorted(kinds)} are not supported")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _convert_llama(model, conversion, probe=False):
    """LLaMA and the decoders that share its layer conventions (pre-norm RMSNorm, q/k/v/o projections
    with RoPE and GQA, gated MLP): Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (qk-norm), Gemma
    (RMSNorm by 1 + weight, GeGLU), Phi-3 (fused qkv and gate/up projections, residual dropout).
    What the fused kernels lack (qk-norm, another norm or activation, scaled RoPE, a window shorter
    than the rows, head_dim * heads != width) runs on the library path (``_Half._beyond_fused``).
    ``probe``: a decoder admitted by its layer conventions, not its class (:func:`_llama_convention_base`):
    each layer must compute what its halves do on a probe (:func:`_probe_layers`), else nothing changes
    and NotImplementedError says so."""
    base = model.model if hasattr(model, "model") else model
    config, name = base.config, type(model).__name__
    if not len(base.layers):
        raise ValueError(f"revify: {name} has no decoder layers")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = base.layers[0].self_attn if len(base.layers) else None
    # What the fused kernels lack, on the layers' own modules (the library path).
    plain_attention = (getattr(config, "attn_logit_softcapping", None) is None
                       and abs(float(getattr(attention, "scaling", head_dim**-0.5)) - head_dim**-0.5) <= 1e-12)
    _require_hosted_layer_loop(name)
    qk_norm = attention is not None and hasattr(attention, "q_norm")
    layer = base.layers[0]
    mlp = layer.mlp
    gated = hasattr(mlp, "gate_up_proj") or all(hasattr(mlp, part) for part in ("gate_proj", "up_proj", "down_proj"))
    projections = hasattr(attention, "o_proj") and (
        hasattr(attention, "qkv_proj") or all(hasattr(attention, part) for part in ("q_proj", "k_proj", "v_proj")))
    spec = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, qk_norm=qk_norm,
                fused_heads=head_dim * heads == config.hidden_size,
                fused_norm=_layer_norms_are_plain(layer),
                fused_attention=projections and plain_attention,
                fused_mlp=getattr(config, "hidden_act", None) == "silu" and gated and not getattr(config, "mlp_bias", False),
                **_rope_spec(config, name, base, head_dim))
    for block, window in zip(base.layers, _sliding_windows(config, len(base.layers))):
        block._revtriton_spec = dict(spec, window=window)
    if probe:
        _probe_layers(base, name, base.layers, (_HostLlamaAttentionHalf, _LlamaMlpHalf), _rotary_layer_inputs(base),
                      "LLaMA's pre-norm layer x + attention(norm(x)), then + mlp(norm(h))")
    layer_class = type(base.layers[0])
    _convert_blocks(base, "layers", config.hidden_size, conversion, (_HostLlamaBlock, _HostLlamaOrdinaryBlock),
                    (layer_class.__module__, layer_class.__name__))
    _host_the_layer_loop(model, base, "layers", _HostDecoderModel)


_LLAMA_LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_LLAMA_LAYER_EXTRAS = ("resid_attn_dropout", "resid_mlp_dropout")  # Phi-3's dropouts on the branches


def _llama_convention_base(model: nn.Module):
    """The base model of a Hugging Face decoder whose layers look like LLaMA's (``layers`` of layers
    with exactly self_attn, mlp, input_layernorm and post_attention_layernorm; a rotary embedding),
    whatever its class, or None when it does not look like one. Raises NotImplementedError naming
    what differs for one that nearly does (other parts in its layers: Gemma 2's sandwich norms; a
    forward that does not run its layers as one slice)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if (not type(base).__module__.startswith("transformers") or not isinstance(layers, nn.ModuleList) or not len(layers)
            or getattr(base, "rotary_emb", None) is None):
        return None
    layer = layers[0]
    parts = {name for name, _ in layer.named_children()}
    if not set(_LLAMA_LAYER_PARTS) <= parts:
        return None
    extra = sorted(parts - set(_LLAMA_LAYER_PARTS) - set(_LLAMA_LAYER_EXTRAS))
    if extra:
        raise NotImplementedError(f"revify: {type(layer).__name__} has {', '.join(extra)} besides LLaMA's pre-norm "
                                  f"layer parts ({', '.join(_LLAMA_LAYER_PARTS)}): not supported")
    _check_layer_slice(base)
    return base


def _check_layer_slice(base):
    """The base model's forward must run its ``layers`` as one slice (``self.layers[: n]``)."""
    _require_layer_loop(base, r"self\.layers\[", "run its layers as one slice (self.layers[...])")


def _relative_error(ours, theirs) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


def _probe_layers(base: nn.Module, name: str, layers, halves: tuple, layer_inputs, layer_kind: str,
                  parallel: bool = False):
    """Each layer's own forward against ``x + F(x) + G(x + F(x))`` from its halves (``halves``: the
    attention and MLP half classes) on the layer's own modules, then each fused branch against that
    branch (a branch that differs keeps the modules), on random inputs in eval mode without grad,
    errors relative to the update (not to x, which dominates at small weights): a model admitted by
    its layer conventions must compute what its halves do (``x + F(x) + G(x)`` when ``parallel``).
    ``layer_inputs(x)`` gives the layer's keyword inputs and the halves' conditioning. Features that
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
            kwargs, cond = layer_inputs(x)
            for i, block in enumerate(layers):
                out = type(block).forward(block, x, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                spec = block._revtriton_spec
                fused = dict(fused_attention=spec["fused_attention"], fused_mlp=spec["fused_mlp"])
                spec.update(fused_attention=False, fused_mlp=False)  # the layer's own modules first
                attention, mlp = (half(block) for half in halves)
                a = attention(x, cond)
                m = mlp(x if parallel else x + a)
                error = _relative_error(x + a + m - x, out - x)  # against the layer's update, not x + update
                if not error <= tolerance:
                    raise NotImplementedError(
                        f"revify: {name} layer {i} ({type(block).__name__}) does not compute {layer_kind} "
                        f"(relative difference {error:.1e} on a probe): not supported")
                # The fused kernels where they compute the same branch (not SmolLM3's layers without RoPE,
                # Helium's interleaved rotary, ...); else that branch keeps the layer's own modules.
                spec.update(fused)
                if spec["fused_attention"] and not _relative_error(attention(x, cond), a) <= tolerance:
                    spec["fused_attention"] = False
                if spec["fused_mlp"] and not _relative_error(mlp(x if parallel else x + a), m) <= tolerance:
                    spec["fused_mlp"] = False
    finally:
        base.train(training)


def _rotary_layer_inputs(base):
    """:func:`_probe_layers`' inputs of a decoder with RoPE (LLaMA's layers, GPT-J's): a causal mask,
    positions 0..T-1 and the model's rotary embedding of them (when it has one)."""
    causal = _causal_layer_inputs(base)

    def inputs(x):
        kwargs, _ = causal(x)
        batch, tokens = x.shape[:2]
        positions = torch.arange(tokens, device=x.device).expand(batch, tokens)
        kwargs["position_ids"] = positions
        rotary = base.rotary_emb(x, positions) if getattr(base, "rotary_emb", None) is not None else None
        if rotary is not None:
            kwargs["position_embeddings"] = rotary
        return kwargs, _pack_host_cond(None, rotary, positions, (kwargs["attention_mask"],) * 2, True, x)

    return inputs


# -- Hugging Face GPT-NeoX -------------------------------------------------------------------


class _NeoXAttentionHalf(_Half):
    """GPT-NeoX attention: LayerNorm, one q/k/v projection with rows interleaved per head
    ([head][q, k, v][head_dim]), rotary on the first ``rotary_ndims`` of each head, biases."""

    takes_cond = True

    def _projections(self):
        return self.block.attention.query_key_value, self.block.attention.dense

    def _dropouts(self):
        return (float(getattr(self.block.attention, "attention_dropout", 0.0) or 0.0),
                _p(self.block.post_attention_dropout))

    def _beyond_fused(self, x):  # partial rotary or scaled RoPE: the kernels rotate whole heads by theta
        spec = self.block._revtriton_spec
        return spec["rope_dims"] != spec["head_dim"] or spec["rope_module"] is not None

    def _grouped_rows(self, t):
        """The interleaved q/k/v rows (or bias) regrouped as [q; k; v] (what the fused kernels read)."""
        heads = self.block._revtriton_spec["heads"]
        return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def _fused(self, res, x, sign, frac_bits, layout=None):
        b, a, spec = self.block, self.block.attention, self.block._revtriton_spec
        norm, qkv = b.input_layernorm, a.query_key_value
        x = self._input(x, norm.weight)
        b_qkv = None if qkv.bias is None else self._grouped_rows(qkv.bias)
        return norm_attention_couple(res, x, sign, frac_bits, norm.weight, norm.bias, self._grouped_rows(qkv.weight),
                                     b_qkv, a.dense.weight, a.dense.bias, heads=spec["heads"], causal=True,
                                     rope_theta=spec["rope_theta"], norm="layer", eps=norm.eps,
                                     **_layout_options(layout))

    def _modules(self, x):  # one sequence per row at positions 0..T-1 (a half called alone; an empty batch)
        b, a, spec = self.block, self.block.attention, self.block._revtriton_spec
        x = self._input(x, b.input_layernorm.weight)
        batch, tokens, _ = x.shape
        qkv = a.query_key_value(b.input_layernorm(x)).view(batch, tokens, spec["heads"], 3 * spec["head_dim"])
        q, k, v = (t.reshape(batch, tokens, -1) for t in qkv.chunk(3, dim=-1))
        rotary = spec["rope_module"]
        rope = dict(rope_theta=spec["rope_theta"], rope_dims=spec["rope_dims"])
        if rotary is not None:
            rope.update(rope_inv_freq=rotary.inv_freq, rope_scale=float(rotary.attention_scaling))
        o = multi_head_attention_reference(q, k, v, heads=spec["heads"], kv_heads=spec["heads"], causal=True,
                                           dropout=self._dropouts()[0] if b.training else 0.0, **rope)
        return b.post_attention_dropout(a.dense(o))


class _NeoXMlpHalf(_Half):
    def _projections(self):
        return self.block.mlp.dense_h_to_4h, self.block.mlp.dense_4h_to_h

    def _dropouts(self):
        return (_p(self.block.post_mlp_dropout),)

    def _beyond_fused(self, x):
        return _spec_of(self.block)["activation"] is None

    def _fused(self, res, x, sign, frac_bits):
        b, m = self.block, self.block.mlp
        norm = b.post_attention_layernorm
        x = self._input(x, norm.weight)
        return norm_mlp_couple(res, x, sign, frac_bits, norm.weight, norm.bias, m.dense_h_to_4h.weight,
                               m.dense_h_to_4h.bias, m.dense_4h_to_h.weight, m.dense_4h_to_h.bias, norm="layer",
                               activation=_spec_of(b)["activation"], eps=norm.eps)

    def _modules(self, x):
        b = self.block
        return b.post_mlp_dropout(b.mlp(b.post_attention_layernorm(self._input(x, b.post_attention_layernorm.weight))))


def _convert_neox(model, conversion):
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
    if parallel and conversion.preserve == "meft3":
        raise NotImplementedError(f"revify: {name} with use_parallel_residual=True cannot be converted with "
                                  f"preserve='meft3' (its sublayers run in parallel, not one after the other); "
                                  f"use 'meft1' or 'meft2'")
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    attention = base.layers[0].attention
    if abs(float(getattr(attention, "scaling", head_dim**-0.5)) - head_dim**-0.5) > 1e-12:
        raise NotImplementedError(f"revify: {name} with attention scaling {attention.scaling} != head_dim ** -0.5 "
                                  f"is not supported")
    _require_hosted_layer_loop(name)
    rope_dims = int(attention.rotary_ndims)
    activation = _HF_ACTIVATIONS.get(config.hidden_act)  # None: the MLP runs its own activation (module path)
    spec = dict(heads=heads, head_dim=head_dim, rope_dims=rope_dims, activation=activation,
                **_rope_spec(config, name, base, rope_dims))
    for block in base.layers:
        block._revtriton_spec = dict(spec)
    layer_class = type(base.layers[0])
    _convert_blocks(base, "layers", config.hidden_size, conversion, (_HostNeoXBlock, _HostNeoXOrdinaryBlock),
                    (layer_class.__module__, layer_class.__name__))
    _host_the_layer_loop(model, base, "layers", _HostDecoderModel)


# -- Hugging Face decoders with parallel layers (one norm, attention and MLP side by side) ---------
#
# ``x + attn(norm(x)) + mlp(norm(x))`` (GPT-NeoX's parallel residual with one norm shared by both
# branches), RoPE from the model's rotary embedding: GPT-J and CodeGen (``h`` of blocks with exactly
# ln_1, attn, mlp), Phi and Cohere (``layers`` of layers with exactly input_layernorm, self_attn, mlp;
# Phi's resid_dropout on each branch). Both branches run the layer's own modules (interleaved or
# partial rotary, one norm for both); the attention half is ``_HostParallelAttentionHalf`` (with the
# other halves that take the model's inputs).


def _parallel_norm(block) -> nn.Module:
    return getattr(block, block._revtriton_spec["norm"])


class _ParallelMlpHalf(_Half):
    def _beyond_fused(self, x):
        return True

    def _modules(self, x):
        b, norm = self.block, _parallel_norm(self.block)
        return _residual_dropout(b, "resid_dropout")(b.mlp(norm(self._input(x, getattr(norm, "weight", None)))))


# Where the layers are, and their parts (norm, attention, mlp), besides a branch dropout.
_PARALLEL_CONVENTIONS = (("transformer", "h", ("ln_1", "attn", "mlp")),  # GPT-J, CodeGen
                         ("model", "layers", ("input_layernorm", "self_attn", "mlp")))  # Phi, Cohere


def _parallel_convention(model: nn.Module):
    """``(base model, layers attribute, (norm, attention) part names)`` of a Hugging Face decoder whose
    layers have exactly one norm, an attention and an MLP (see the section's comment), whatever its
    class, or None."""
    for owner, attribute, parts in _PARALLEL_CONVENTIONS:
        base = getattr(model, owner, model)
        layers = getattr(base, attribute, None)
        if (not type(base).__module__.startswith("transformers") or not isinstance(layers, nn.ModuleList)
                or not len(layers)):
            continue
        if {name for name, _ in layers[0].named_children()} - {"resid_dropout"} != set(parts):
            continue
        if attribute == "h":
            _check_block_loop(base)
        else:
            _check_layer_slice(base)
        return base, attribute, parts[:2]
    return None


def _convert_parallel(model, conversion):
    """A decoder with parallel layers (:func:`_parallel_convention`): each layer probed against its own
    forward; a plain conversion couples attention (F) and MLP (G), a preserving one keeps the layer
    whole (meft1 / meft2); meft3 splits a layer into sublayers, which a parallel residual does not
    compose."""
    base, attribute, (norm, attention) = _parallel_convention(model)
    config, name = base.config, type(model).__name__
    _require_hosted_layer_loop(name)
    if conversion.preserve == "meft3":
        raise NotImplementedError(f"revify: {name}'s layers add attention and MLP in parallel: preserve='meft3' "
                                  f"(one sublayer after the other) does not compose them; use 'meft1' or 'meft2'")
    layers = getattr(base, attribute)
    for block in layers:
        block._revtriton_spec = dict(parallel=True, fused_attention=False, fused_mlp=False, norm=norm,
                                          attention=attention)
    _probe_layers(base, name, layers, (_HostParallelAttentionHalf, _ParallelMlpHalf), _rotary_layer_inputs(base),
                  f"a parallel layer x + {attention}({norm}(x)) + mlp({norm}(x))", parallel=True)
    layer_class = type(layers[0])
    _convert_blocks(base, attribute, config.hidden_size, conversion, (_HostParallelBlock, _HostParallelOrdinaryBlock),
                    (layer_class.__module__, layer_class.__name__))
    _host_the_layer_loop(model, base, attribute, _HostParallelModel)


# -- Hugging Face pre-norm encoders (BERT's layer parts, a LayerNorm before each branch) -----------
#
# RoBERTa-PreLayerNorm and XLM-RoBERTa-XL keep BERT's layer parts (``attention.self`` with query /
# key / value, ``attention.output.dense``, ``intermediate.dense`` + activation, ``output.dense``, each
# output adding the residual) and put a LayerNorm before each branch instead of after the residual
# add: ``attention.LayerNorm`` (or ``attention.self_attn_layer_norm``) before attention,
# ``intermediate.LayerNorm`` (or the layer's ``LayerNorm``) before the MLP. Admitted by those parts,
# whatever the class, and checked on a probe against each layer's own forward. Positions are
# absolute (added with the embeddings); masks are bidirectional.


def _attention_norm(layer):
    """The LayerNorm before a BERT-style layer's attention branch, or None (BERT itself: post-norm)."""
    attention = layer.attention
    for name in ("LayerNorm", "self_attn_layer_norm"):
        norm = getattr(attention, name, None)
        if isinstance(norm, nn.LayerNorm):
            return norm
    return None


def _mlp_norm(layer) -> tuple:
    """(the LayerNorm before a BERT-style layer's MLP branch or None, whether ``intermediate`` applies it)."""
    inner = getattr(layer.intermediate, "LayerNorm", None)
    if isinstance(inner, nn.LayerNorm):
        return inner, True
    outer = getattr(layer, "LayerNorm", None)
    return (outer, False) if isinstance(outer, nn.LayerNorm) else (None, False)


class _EncoderAttentionHalf(_Half):
    takes_cond = True

    def _projections(self):
        a = self.block.attention
        return a.self.query, a.self.key, a.self.value, a.output.dense

    def _dropouts(self):
        a = self.block.attention
        return _p(getattr(a.self, "dropout", None)), _p(getattr(a.output, "dropout", None))

    def _beyond_fused(self, x):
        return not self.block._revtriton_spec["fused_attention"]

    def _fused(self, res, x, sign, frac_bits, layout=None):
        a, norm = self.block.attention, _attention_norm(self.block)
        s = a.self
        x = self._input(x, norm.weight)
        w_qkv = torch.cat([s.query.weight, s.key.weight, s.value.weight])
        b_qkv = None if s.query.bias is None else torch.cat([s.query.bias, s.key.bias, s.value.bias])
        segments = None if layout is None else layout[1]  # absolute positions entered with the embeddings
        return norm_attention_couple(res, x, sign, frac_bits, norm.weight, norm.bias, w_qkv, b_qkv,
                                     a.output.dense.weight, a.output.dense.bias, heads=s.num_attention_heads,
                                     causal=False, norm="layer", eps=norm.eps, segments=segments)

    def _branch(self, x, mask=None, extra=None):
        """The layer's own modules: dropout(dense(self-attention(norm(x), mask))), without the residual."""
        a, norm = self.block.attention, _attention_norm(self.block)
        x = self._input(x, norm.weight)
        h = _first(a.self(norm(x), attention_mask=mask, **(extra or {})))
        return _residual_dropout(a.output, "dropout")(a.output.dense(h))

    def _modules(self, x):  # a half called alone: every row one sequence, no mask
        return self._branch(x)


class _EncoderMlpHalf(_Half):
    def _projections(self):
        return self.block.intermediate.dense, self.block.output.dense

    def _dropouts(self):
        return (_p(getattr(self.block.output, "dropout", None)),)

    def _beyond_fused(self, x):
        return not self.block._revtriton_spec["fused_mlp"]

    def _fused(self, res, x, sign, frac_bits):
        b, (norm, _) = self.block, _mlp_norm(self.block)
        x = self._input(x, norm.weight)
        return norm_mlp_couple(res, x, sign, frac_bits, norm.weight, norm.bias, b.intermediate.dense.weight,
                               b.intermediate.dense.bias, b.output.dense.weight, b.output.dense.bias, norm="layer",
                               activation=b._revtriton_spec["activation"], eps=norm.eps)

    def _modules(self, x):
        b, (norm, inside) = self.block, _mlp_norm(self.block)
        x = self._input(x, norm.weight)
        h = b.intermediate(x if inside else norm(x))  # RoBERTa-PreLayerNorm's intermediate norms itself
        return _residual_dropout(b.output, "dropout")(b.output.dense(h))


def _prenorm_encoder_base(model: nn.Module):
    """The base model of a Hugging Face encoder whose layers have BERT's parts with a LayerNorm before
    each branch (``encoder.layer``; see the section's comment), whatever its class, or None."""
    base = getattr(model, "base_model", model)
    if not type(base).__module__.startswith("transformers"):
        return None
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return None
    layer = layers[0]
    attention = getattr(layer, "attention", None)
    parts = (getattr(attention, "self", None), getattr(attention, "output", None),
             getattr(layer, "intermediate", None), getattr(layer, "output", None))
    if any(part is None for part in parts) or _attention_norm(layer) is None or _mlp_norm(layer)[0] is None:
        return None
    return base


def _convert_prenorm_encoder(model, conversion):
    """A pre-norm BERT-style encoder (:func:`_prenorm_encoder_base`): each layer is probed against its
    own forward (NotImplementedError, model unchanged, where it differs); the fused kernels run the
    branches they compute (LayerNorm, q/k/v with head_dim ** -0.5 scores, a GELU / ReLU MLP), the
    layer's own modules the rest."""
    base = _prenorm_encoder_base(model)
    config, name = base.config, type(model).__name__
    _require_hosted_layer_loop(name)
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise NotImplementedError(f"revify: {name} as a decoder (is_decoder=True: causal self-attention with a KV "
                                  f"cache, or cross-attention) is not supported; the encoder is")
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise NotImplementedError(f"revify: {name} with position_embedding_type={position_type!r} is not supported "
                                  f"(absolute positions, added with the embeddings, are; ESM's rotary or BERT's "
                                  f"relative keys are computed inside attention)")
    encoder = base.encoder
    _require_layer_loop(encoder, r"\bin (enumerate\()?self\.layer\b", "loop over self.layer")
    layers = encoder.layer
    s = layers[0].attention.self
    heads, head_dim = s.num_attention_heads, s.attention_head_size
    biases = [p.bias is not None for p in (s.query, s.key, s.value)]
    activation = _HF_ACTIVATIONS.get(getattr(config, "hidden_act", None))
    spec = dict(activation=activation, fused_mlp=activation is not None,
                fused_attention=(heads * head_dim == config.hidden_size and len(set(biases)) == 1
                                 and abs(float(getattr(s, "scaling", head_dim**-0.5)) - head_dim**-0.5) <= 1e-12))
    for block in layers:
        block._revtriton_spec = dict(spec)
    no_mask = (lambda x: ({}, _pack_host_cond(None, None, None, (None, None), True, x)))
    _probe_layers(base, name, layers, (_HostEncoderAttentionHalf, _EncoderMlpHalf), no_mask,
                  "a pre-norm encoder layer x + attention(norm(x)), then + mlp(norm(h))")
    layer_class = type(layers[0])
    _convert_blocks(encoder, "layer", config.hidden_size, conversion, (_HostEncoderBlock, _HostEncoderOrdinaryBlock),
                    (layer_class.__module__, layer_class.__name__))
    _host_the_layer_loop(model, base, "encoder.layer", _HostEncoderModel)


# -- block by block ------------------------------------------------------------------------------


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

    def _one(self, i):
        stack = self.stack
        return ReversibleStack([stack[i]], exact=stack.exact, frac_bits=stack.frac_bits, schedule=stack.schedule,
                               streams="duplicate", readout=stack.readout)

    def _step(self, i, x):
        stack, state = self.stack, self.state
        if i == 0:
            streams = (x, x) if stack.streams == "duplicate" else tuple(x.chunk(2, dim=-1))
            state["dtype"] = x.dtype
        elif state.get("returned") is not x:
            raise RuntimeError("revified ViT: forward_intermediates must pass each block's output to the next "
                               "unchanged (the reversible stack keeps two streams between them)")
        else:
            streams = state["streams"]
        k, dtype = stack.frac_bits, state["dtype"]
        fixed = streams[0].dtype == torch.int32
        if is_reversible_block(stack[i]) and stack.exact and not torch.is_grad_enabled() and not fixed:
            streams = tuple(to_fixed(s, k) for s in streams)  # as a segment of the whole stack starts
        elif fixed and not is_reversible_block(stack[i]):
            streams = tuple(from_fixed(s, k, dtype) for s in streams)  # a stage transition takes float values
        y1, y2 = self._one(i).forward_streams(*streams, cond=self.cond)
        state["streams"] = (y1, y2)
        if y1.dtype == torch.int32:
            y1, y2 = from_fixed(y1, k, dtype), from_fixed(y2, k, dtype)
        out = torch.cat([y1, y2], dim=-1) if stack.streams == "split" else stack.read(y1, y2)
        state["returned"] = out
        return out




_warned_grad_cache = []


CHECKPOINTING_MESSAGE = (
    "revtriton: reversible blocks keep no activations for backward (activation memory does not grow with depth): "
    "gradient checkpointing is not needed and is not applied")


class _NoCheckpointing:
    """Hugging Face's gradient_checkpointing_enable() (TrainingArguments(gradient_checkpointing=True))
    on a revified model: a warning instead of a flag that would have the library call the layers one
    by one (the stack stands in for them)."""

    def gradient_checkpointing_enable(self, *args, **kwargs):
        import warnings

        warnings.warn(CHECKPOINTING_MESSAGE, stacklevel=2)

    activation_checkpointing_enable = gradient_checkpointing_enable  # its transformers 5 name


class _RevifiedLM(_NoCheckpointing):
    """The top class of a revified Hugging Face model (an LM: generate() as the library's, with its KV
    cache; a classifier)."""

    _keeps_class_name = True  # save_pretrained's config.architectures stays the library's class name


def _check_hf_inputs(model_name, kwargs):
    unsupported = {
        "encoder_hidden_states (cross-attention)": kwargs.get("encoder_hidden_states") is not None,
        "head_mask": kwargs.get("head_mask") is not None,
        "output_attentions=True": bool(kwargs.get("output_attentions")),
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise NotImplementedError(f"revified {model_name} does not support {', '.join(bad)}")


def _position_ids(name, kwargs, hidden):
    """The call's ``position_ids`` as int64 [B, T] (T: this call's tokens), checked; None when absent."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return None
    batch, tokens = hidden.shape[:2]
    if position_ids.dim() != 2 or position_ids.shape[-1] != tokens or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"revified {name}: position_ids must be [batch or 1, tokens] = [{batch}, {tokens}], "
                         f"got {tuple(position_ids.shape)}")
    return position_ids.to(device=hidden.device, dtype=torch.long).expand(batch, tokens)


def _token_layout(model_name, hidden, kwargs, rope: bool):
    """The attention halves' conditioning for padded or packed rows: ``(positions, segments)``
    (int64 [B, T] each; segments as :func:`revtriton.ops.attention.sequence_mask` reads them), or
    None when every row is one sequence at positions 0..T-1 (the fused path, no mask).

    As the Hugging Face models themselves: a 2-D ``attention_mask`` (1 = token, 0 = padding) masks
    keys; without one, ``position_ids`` that restart mark packed sequences (DataCollatorWithFlattening);
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
    elif position_ids is not None:
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
_COND_SLOTS = ("positions", "segments", "cos", "sin", "position_ids", "full_mask", "sliding_mask", "fusable")


@dataclass(frozen=True)
class _HostCond:
    layout: tuple | None
    position_embeddings: tuple
    position_ids: torch.Tensor | None
    masks: tuple  # (full attention's, sliding attention's)
    fusable: bool

    def mask_for(self, block) -> torch.Tensor | None:
        """The library's mask of the block's attention kind (full, or sliding window)."""
        return self.masks[_spec_of(block).get("window") is not None]


def _spec_of(block) -> dict:
    """A converted layer's spec (``_revtriton_spec``: what its halves compute fused, its attention kind,
    its parts' names), set at conversion; empty for families that keep none."""
    return getattr(block, "_revtriton_spec", None) or {}


def _none_if_empty(t):
    return None if t.numel() == 0 and t.dim() == 1 else t


def _pack_host_cond(layout, position_embeddings, position_ids, masks, fusable, like) -> tuple:
    empty = like.new_empty(0)
    positions, segments = (empty, empty) if layout is None else layout
    if position_embeddings is None:
        cos, sin = empty, empty
    else:
        cos, sin = (position_embeddings, empty) if torch.is_tensor(position_embeddings) else position_embeddings
    return (positions, segments, cos, sin, empty if position_ids is None else position_ids,
            *(empty if mask is None else mask for mask in masks), torch.tensor(bool(fusable)))


def _unpack_host_cond(cond) -> _HostCond:
    if not (isinstance(cond, tuple) and len(cond) == len(_COND_SLOTS)):
        raise RuntimeError("revtriton: a revified model's attention half ran without its model's layer inputs; "
                           "call the model (its own forward builds them), not the stack or a block alone")
    positions, segments, cos, sin, position_ids, full_mask, sliding_mask, fusable = cond
    layout = None if _none_if_empty(positions) is None else (positions, segments)
    rotary = None if _none_if_empty(cos) is None else cos if _none_if_empty(sin) is None else (cos, sin)
    return _HostCond(layout, rotary, _none_if_empty(position_ids),
                     (_none_if_empty(full_mask), _none_if_empty(sliding_mask)), bool(fusable))


def _blocks(stack) -> list:
    """The stack's layers, never the stand-ins (iterating the stack during a host call gives those)."""
    return list(stack._modules.values())


def _host_layer_calls(stack, index):
    """The stack's ``layers_view``: while its model's own forward runs (and not the stack itself), the
    layer loop's slice or iteration is a list of stand-ins (:func:`_host_layer_call`); otherwise None
    (the layers)."""
    call = _HOST_CALL.get()
    if call is None or call.stack is not stack or call.running:
        return None
    positions = range(len(stack))[index]
    whole = list(range(len(stack))) if not call.hidden_states else list(range(len(positions)))  # steps: a prefix
    if list(positions) != whole:
        raise NotImplementedError(f"revified model: the layer loop must run every layer in order (got layers "
                                  f"{list(positions)} of {len(stack)}): the reversible stack runs as one")
    call.layer_kwargs = [None] * len(stack)
    return [functools.partial(_host_layer_call, call, i) for i in positions]


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
    if i == 0:
        call.first_input = hidden
    elif hidden is not call.returned:
        raise RuntimeError("revified model: each layer's output must reach the next layer unchanged (the "
                           "reversible stack keeps two streams between them)")
    call.layer_kwargs[i] = kwargs
    if call.hidden_states:
        if i == 0:
            call.steps, call.states = _BlockSteps(stack), [hidden]
        call.steps.cond = _host_cond(call, [i], hidden)
        with _running(call, kwargs):
            out = call.steps._step(i, hidden)
        call.states.append(out)
    elif i < len(stack) - 1:
        out = hidden
    else:
        cond = _host_cond(call, range(len(stack)), hidden)
        with _running(call, kwargs):
            out = stack(call.first_input, cond=cond)
    call.returned = out
    return out


def _library_forward(block):
    """The forward of the library's layer class a swapped block came from."""
    return next(klass.forward for klass in type(block).__mro__
                if klass.__module__ != __name__ and "forward" in vars(klass))


def _host_cond(call: _HostCall, layers, like) -> tuple:
    """The conditioning of ``layers`` (indices) from their recorded inputs: one rotary embedding and
    one set of position ids for all, one mask per attention kind (full / sliding window)."""
    stack, first = call.stack, call.layer_kwargs[layers[0]]
    masks = [None, None]
    seen = [False, False]
    for i in layers:
        kwargs = call.layer_kwargs[i]
        if kwargs.get("is_causal"):
            raise NotImplementedError("revified model: is_causal=True layer calls are not supported")
        for key in ("position_embeddings", "rope", "position_ids"):
            if kwargs.get(key) is not first.get(key):
                raise NotImplementedError(f"revified model: layers got different {key} (per-layer rotary "
                                          f"embeddings are not supported)")
        block = stack[i]
        kind = int(_spec_of(block).get("window") is not None)
        mask = kwargs.get("attention_mask", kwargs.get("attn_mask"))  # timm's name
        if seen[kind] and mask is not masks[kind]:
            raise NotImplementedError("revified model: layers of one attention kind got different masks")
        masks[kind], seen[kind] = mask, True
    rotary = first.get("position_embeddings", first.get("rope"))  # (cos, sin); timm EVA: one tensor
    return _pack_host_cond(call.layout, rotary, first.get("position_ids"), masks, call.fusable, like)


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
    Families say how to call their module (``_library_call``)."""

    def _attention_module(self) -> nn.Module:
        raise NotImplementedError

    def _library_call(self, x, host: "_HostCond", extra: dict) -> torch.Tensor:
        raise NotImplementedError

    def _needs_model_rope(self) -> bool:  # RoPE only the model's rotary embedding computes
        return bool(_spec_of(self.block).get("library_rope"))

    def _library_attention(self, x, host: "_HostCond"):
        if x.numel() == 0:  # an empty batch: the library's attention cannot reshape it, the reference can
            return self._modules(x)
        extra = {}
        call = _HOST_CALL.get()
        if not torch.is_grad_enabled() and call is not None and call.layer_kwargs is not None:
            live = call.layer_kwargs[call.index_of(self.block)] or {}
            cache = _layer_cache(live)
            if cache is not None:  # decoding: the library's attention appends to its cache
                extra = {key: value for key, value in live.items()
                         if key not in ("attention_mask", "position_embeddings", "position_ids")}
                call.keep_cache_layer(cache, self._attention_module().layer_idx)
        return self._library_call(x, host, extra)

    @staticmethod
    def _position_ids(host: "_HostCond"):
        """The position ids the library's attention sees: the layer's, else the packed / padded rows'
        (flash attention finds packed sequences from them when there is no mask; GPTBigCode's loop
        passes none to its layers)."""
        if host.position_ids is not None or host.layout is None:
            return host.position_ids
        return host.layout[0]

    def _fuses(self, x, host: "_HostCond") -> bool:
        call = _HOST_CALL.get()
        decoding = (not torch.is_grad_enabled() and call is not None and call.layer_kwargs is not None
                    and any(kwargs is not None and _layer_cache(kwargs) is not None for kwargs in call.layer_kwargs))
        return host.fusable and not decoding and not self._use_modules(x)

    def _standalone(self, cond) -> bool:
        """Called outside the model's forward (no conditioning): one sequence per row at positions
        0..T-1, as the family's own half computes it; not what only the library's modules compute
        (RoPE only the model's rotary embedding computes, other score scalings or softcapping)."""
        if cond is not None:
            return False
        if self._needs_model_rope() or not _spec_of(self.block).get("fused_attention", True):
            raise RuntimeError("revtriton: this attention half computes what only its layer's own attention module "
                               "does (its model's RoPE, score scaling or softcapping): call the model, not the half "
                               "or the stack alone")
        return True

    def _fused_with(self, res, x, sign, frac_bits, host: "_HostCond"):
        layout = {} if host.layout is None else {"layout": host.layout}  # ViT's halves take none
        return self._fused(res, x, sign, frac_bits, **layout)

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


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class _HostLlamaAttentionHalf(_HostAttention, _LlamaAttentionHalf):
    def _attention_module(self):
        return self.block.self_attn

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, getattr(b.input_layernorm, "weight", None))
        out = b.self_attn(hidden_states=b.input_layernorm(x), attention_mask=host.mask_for(b),
                          position_ids=self._position_ids(host), position_embeddings=host.position_embeddings, **extra)
        return _residual_dropout(b, "resid_attn_dropout")(_first(out))


class _HostNeoXAttentionHalf(_HostAttention, _NeoXAttentionHalf):
    def _attention_module(self):
        return self.block.attention

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.input_layernorm.weight)
        out = b.attention(b.input_layernorm(x), attention_mask=host.mask_for(b),
                          position_ids=self._position_ids(host), position_embeddings=host.position_embeddings, **extra)
        return b.post_attention_dropout(_first(out))


class _HostGPT2AttentionHalf(_HostAttention, _GPT2AttentionHalf):
    def _attention_module(self):
        return self.block.attn

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.ln_1.weight)
        return _first(b.attn(b.ln_1(x), attention_mask=host.mask_for(b), position_ids=self._position_ids(host),
                             **extra))

    def _modules(self, x):  # an empty batch of a GPT-2-style model (GPTBigCode's q/k/v are not GPT-2's)
        if not self.block._revtriton_spec["gpt2_layout"]:
            return torch.zeros_like(x)
        return super()._modules(x)


class _HostEncoderAttentionHalf(_HostAttention, _EncoderAttentionHalf):
    def _attention_module(self):
        return self.block.attention.self

    def _standalone(self, cond) -> bool:  # alone, the layer's own modules compute it (no mask, no RoPE)
        return cond is None

    def _library_call(self, x, host, extra):
        return self._branch(x, host.mask_for(self.block), dict(extra, position_ids=self._position_ids(host)))


class _HostViTAttentionHalf(_HostAttention, _HFViTAttentionHalf):
    takes_cond = True  # the library's mask (an attention_mask given to ViTModel), no token layout

    def _attention_module(self):
        return self.block.attention

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.layernorm_before.weight)
        return b.dropout(_first(b.attention(b.layernorm_before(x), host.mask_for(b), **extra)))


class _HostParallelAttentionHalf(_HostAttention, _Half):
    takes_cond = True

    def _beyond_fused(self, x):
        return True

    def _attention_module(self):
        return getattr(self.block, self.block._revtriton_spec["attention"])

    def _library_call(self, x, host, extra):
        b = self.block
        norm = _parallel_norm(b)
        x = self._input(x, getattr(norm, "weight", None))
        rotary = {} if host.position_embeddings is None else {"position_embeddings": host.position_embeddings}
        out = self._attention_module()(hidden_states=norm(x), attention_mask=host.mask_for(b),
                                       position_ids=self._position_ids(host), **rotary, **extra)
        return _residual_dropout(b, "resid_dropout")(_first(out))

    def _modules(self, x):  # an empty batch only (alone, the half refuses: its RoPE is the model's)
        return torch.zeros_like(x)


_HostLlamaBlock, _HostLlamaOrdinaryBlock = _host_block_mixins((_HostLlamaAttentionHalf, _LlamaMlpHalf))
_HostNeoXBlock, _HostNeoXOrdinaryBlock = _host_block_mixins((_HostNeoXAttentionHalf, _NeoXMlpHalf))
_HostGPT2Block, _HostGPT2OrdinaryBlock = _host_block_mixins((_HostGPT2AttentionHalf, _GPT2MlpHalf))
_HostParallelBlock, _HostParallelOrdinaryBlock = _host_block_mixins((_HostParallelAttentionHalf, _ParallelMlpHalf),
                                                                    "RevifiedHostParallel")
# Decoders admitted by GPT-2's layer conventions (GPTBigCode): their own names, found again on unpickling.
_HostGPT2StyleBlock, _HostGPT2StyleOrdinaryBlock = _host_block_mixins((_HostGPT2AttentionHalf, _GPT2MlpHalf),
                                                                      "RevifiedHostGPT2Style")
_HostViTBlock, _HostViTOrdinaryBlock = _host_block_mixins((_HostViTAttentionHalf, _HFViTMlpHalf))
_HostEncoderBlock, _HostEncoderOrdinaryBlock = _host_block_mixins((_HostEncoderAttentionHalf, _EncoderMlpHalf),
                                                                  "RevifiedHostEncoder")


class _HostDecoderModel(_NoCheckpointing):
    """A base model (LlamaModel, GPTNeoXModel, GPT2Model, ViTModel, ...) whose own forward runs over
    a reversible stack (see the section's comment). With grad no cache is kept (the reversible
    backward has no use for one); hidden states, when asked for, are the stack's input and each
    block's readout."""

    _class_prefix = "RevifiedHost"
    _layers = "layers"  # the attribute (path) of its layer list (the stack), or candidates (a tuple)
    _rope = True  # position ids drive RoPE (else they enter with position embeddings before the loop)
    _tokens_input = True  # input_ids / inputs_embeds and padding masks (not an image encoder)
    _caches = True  # a KV cache while decoding (a decoder)
    _tie_last = True  # the last hidden state is the normed output (ViT: the last layer's)

    def forward(self, *args, **kwargs):
        name = type(self).__name__
        if len(args) > 1:
            raise TypeError(f"revified {name}: pass arguments other than input_ids by keyword")
        _check_hf_inputs(name, kwargs)
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
            if kwargs.get("use_cache") is True and not _warned_grad_cache:
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
        # A custom 4-D mask (or any mask of an image encoder) goes to the library's modules.
        fusable = not decoding and (mask is None or (mask.dim() == 2 and self._tokens_input))
        layout = _token_layout(name, tokens, kwargs, rope=self._rope) if tokens is not None and fusable else None
        call = _HostCall(self._layer_stack(), layout, fusable, bool(wanted))
        token = _HOST_CALL.set(call)
        try:
            out = super().forward(*args, output_hidden_states=False, return_dict=True, **kwargs)
        finally:
            _HOST_CALL.reset(token)
        if wanted:
            tie_last = getattr(self.config, "tie_last_hidden_states", None)
            out["hidden_states"] = _selected_states(call.states, out.last_hidden_state, wanted,
                                                    self._tie_last if tie_last is None else tie_last)
        return out if return_dict else out.to_tuple()

    def _layer_stack(self) -> ReversibleStack:
        paths = self._layers if isinstance(self._layers, tuple) else (self._layers,)
        stacks = [operator.attrgetter(path)(self) for path in paths if _has_path(self, path)]
        return next(stack for stack in stacks if isinstance(stack, ReversibleStack))


def _has_path(module, path: str) -> bool:
    try:
        operator.attrgetter(path)(module)
    except AttributeError:
        return False
    return True


class _HostGPT2Model(_HostDecoderModel):
    """GPT2Model: its layers are ``h``, position embeddings are added before the loop."""

    _layers, _rope = "h", False


class _HostGPT2StyleModel(_HostGPT2Model):
    """A decoder admitted by GPT-2's layer conventions (GPTBigCodeModel)."""

    _class_prefix = "RevifiedHostGPT2Style"


class _HostParallelModel(_HostDecoderModel):
    """A decoder with parallel layers (GPTJModel, CodeGenModel: layers ``h``; PhiModel, CohereModel:
    ``layers``), RoPE from position ids."""

    _class_prefix = "RevifiedHostParallel"
    _layers = ("h", "layers")


class _HostViTModel(_HostDecoderModel):
    """ViTModel: patches in, no cache; its last hidden state is the last layer's (before layernorm)."""

    _rope, _tokens_input, _caches, _tie_last = False, False, False, False


class _HostEncoderModel(_HostDecoderModel):
    """A pre-norm BERT-style encoder (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL): its layers are
    ``encoder.layer``, absolute positions enter with the embeddings, no KV cache."""

    _class_prefix = "RevifiedHostEncoder"
    _layers, _rope, _caches = "encoder.layer", False, False


def _check_layer_inputs(name, tokens, kwargs, cache):
    """position_ids [batch or 1, tokens] and a 2-D attention_mask [batch, past + tokens] (a 4-D mask
    goes to the library's attention as it is)."""
    _position_ids(name, kwargs, tokens)
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        _check_varlen(name, kwargs)
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() == 4:
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


def _host_the_layer_loop(model, base, layers: str, model_mixin: type):
    """The converted stack (at path ``layers`` of ``base``) answers the base model's layer loop
    (``layers_view``), the base model's forward sets up each call (``model_mixin``), and the head
    class around it (an LM: generate keeps the library's cache; a classifier) warns on
    gradient-checkpointing requests (:class:`_RevifiedLM`)."""
    operator.attrgetter(layers)(base).layers_view = _host_layer_calls
    _swap_class(base, model_mixin, type(base).__module__, type(base).__name__)
    if model is not base:
        _swap_class(model, _RevifiedLM, type(model).__module__, type(model).__name__)


_FAMILIES = {
    "timm_vit": ("timm", "VisionTransformer", _convert_timm_vit),
    "timm_eva": ("timm", "Eva", _convert_eva),
    "hf_vit_classifier": ("transformers", "ViTForImageClassification", _convert_hf_vit),
    "hf_vit": ("transformers", "ViTModel", _convert_hf_vit),
    "gpt2_lm": ("transformers", "GPT2LMHeadModel", _convert_gpt2),
    "gpt2": ("transformers", "GPT2Model", _convert_gpt2),
    "gpt_neox_lm": ("transformers", "GPTNeoXForCausalLM", _convert_neox),
    "gpt_neox": ("transformers", "GPTNeoXModel", _convert_neox),
}
# LLaMA and the decoders with its layer conventions: transformers module -> class prefix.
_LLAMA_LIKE = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
               "phi3": "Phi3"}
for _module, _prefix in _LLAMA_LIKE.items():
    _FAMILIES[f"{_module}_lm"] = ("transformers", f"{_prefix}ForCausalLM", _convert_llama)
    _FAMILIES[_module] = ("transformers", f"{_prefix}Model", _convert_llama)

_BLOCK_BASES.update({
    "RevifiedBlock": ("timm.models.vision_transformer", "Block", _TimmBlock),
    "RevifiedHostEvaBlock": ("timm.models.eva", "EvaBlock", _EvaBlock),
    "RevifiedHostOrdinaryEvaBlock": ("timm.models.eva", "EvaBlock", _EvaOrdinaryBlock),
    "RevifiedEva": ("timm.models.eva", "Eva", _EvaRevifiedModel),
    "RevifiedVisionTransformer": ("timm.models.vision_transformer", "VisionTransformer", _TimmRevifiedModel),
    "RevifiedOrdinaryBlock": ("timm.models.vision_transformer", "Block", _TimmOrdinaryBlock),
    "RevifiedHostViTLayer": ("transformers.models.vit.modeling_vit", "ViTLayer", _HostViTBlock),
    "RevifiedHostOrdinaryViTLayer": ("transformers.models.vit.modeling_vit", "ViTLayer", _HostViTOrdinaryBlock),
    "RevifiedHostViTModel": ("transformers.models.vit.modeling_vit", "ViTModel", _HostViTModel),
})
_BLOCK_BASES.update({
    "RevifiedHostGPT2Block": ("transformers.models.gpt2.modeling_gpt2", "GPT2Block", _HostGPT2Block),
    "RevifiedHostOrdinaryGPT2Block": ("transformers.models.gpt2.modeling_gpt2", "GPT2Block", _HostGPT2OrdinaryBlock),
    "RevifiedHostGPT2Model": ("transformers.models.gpt2.modeling_gpt2", "GPT2Model", _HostGPT2Model),
})
_NEOX_PATH = "transformers.models.gpt_neox.modeling_gpt_neox"
_BLOCK_BASES.update({
    "RevifiedHostGPTNeoXLayer": (_NEOX_PATH, "GPTNeoXLayer", _HostNeoXBlock),
    "RevifiedHostOrdinaryGPTNeoXLayer": (_NEOX_PATH, "GPTNeoXLayer", _HostNeoXOrdinaryBlock),
    "RevifiedHostGPTNeoXModel": (_NEOX_PATH, "GPTNeoXModel", _HostDecoderModel),
})
for _module, _prefix in _LLAMA_LIKE.items():
    _path = f"transformers.models.{_module}.modeling_{_module}"
    _BLOCK_BASES.update({
        f"RevifiedHost{_prefix}DecoderLayer": (_path, f"{_prefix}DecoderLayer", _HostLlamaBlock),
        f"RevifiedHostOrdinary{_prefix}DecoderLayer": (_path, f"{_prefix}DecoderLayer", _HostLlamaOrdinaryBlock),
        f"RevifiedHost{_prefix}Model": (_path, f"{_prefix}Model", _HostDecoderModel),
    })

# (prefix, "Ordinary" or None, layer / model kind) of a swapped class -> its mixin (see _convention_class)
_CONVENTION_MIXINS = {
    ("Host", None, "DecoderLayer"): _HostLlamaBlock,
    ("Host", "Ordinary", "DecoderLayer"): _HostLlamaOrdinaryBlock,
    ("Host", None, "Model"): _HostDecoderModel,
    ("HostEncoder", None, "Layer"): _HostEncoderBlock,
    ("HostEncoder", "Ordinary", "Layer"): _HostEncoderOrdinaryBlock,
    ("HostEncoder", None, "Model"): _HostEncoderModel,
    ("HostGPT2Style", None, "Block"): _HostGPT2StyleBlock,
    ("HostGPT2Style", "Ordinary", "Block"): _HostGPT2StyleOrdinaryBlock,
    ("HostGPT2Style", None, "Model"): _HostGPT2StyleModel,
    ("HostParallel", None, "Block"): _HostParallelBlock,  # GPT-J's blocks
    ("HostParallel", "Ordinary", "Block"): _HostParallelOrdinaryBlock,
    ("HostParallel", None, "DecoderLayer"): _HostParallelBlock,  # Phi's and Cohere's layers
    ("HostParallel", "Ordinary", "DecoderLayer"): _HostParallelOrdinaryBlock,
    ("HostParallel", None, "Model"): _HostParallelModel,
}
