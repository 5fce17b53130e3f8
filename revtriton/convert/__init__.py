"""``revify(model)``: turn the transformer blocks of an existing timm or Hugging Face model into
one reversible stack, in place, reusing each block's weights.

Supported: the families of :data:`FAMILIES` (:data:`SUPPORTED`, README's table: :func:`family_table`).
By class: timm ``VisionTransformer`` (standard ``Block``) and ``Eva``; Hugging Face ``GPT2LMHeadModel`` /
``GPT2Model``, ``GPTNeoX...``, ViT, DINOv2, OPT, BLOOM, ModernBERT, and ``LlamaForCausalLM`` /
``LlamaModel`` with the decoders that share LLaMA's layer conventions (Mistral, Qwen2, Qwen3, Gemma,
Phi-3). By their layer conventions, each layer probed at conversion against its own forward: any
decoder whose layers have LLaMA's parts and compute its pre-norm layer (Granite, OLMo, SmolLM3,
Helium, Starcoder2, ...), sandwich-norm decoders (Gemma 2, Gemma 3, OLMo 2), decoders with GPT-2's
layers (GPTBigCode, GPT-Neo, ImageGPT), with parallel layers (GPT-J, CodeGen, Phi, Cohere, StableLM, Falcon), and
pre-norm encoders with BERT's layer parts (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL); post-norm
encoders (BERT, RoBERTa, ELECTRA) under ``preserve="meft1"`` / ``"meft2"``.

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

import importlib
import re
from pathlib import Path

import torch
from torch import nn

from ..lm_loss import prepare_causal_lm
from ..ops.arguments import checked_int
from ..ops.streams import MAX_SCALE_SHIFT
from . import (aimv2, bart, beit, blip, bloom, clip, dinov2, distilbert, encoder, gpt2, hf_vit, internvl, lfm2,
               llama, llama4_vision, mllama, modernbert, moonshine, mpnet, mpt, neox, nllb_moe, nomic, opt, parallel,
               pixtral, postnorm, qwen_audio, qwen_vision, sam, sandwich, t5, t5gemma, timm_eva, timm_vit, whisper)
from .core import CHECKPOINTING_MESSAGE, FAMILY_HALVES, LayerSpec, _named, _RevifiedLM, _swapped, _swapped_class
from .host import _host_layer_calls, _host_layer_tuple_calls  # noqa: F401 (a stack's layers_view pickles by name)
from .preserve import ADAPTER_MODULES, PRESERVE_MODES, _Conversion, train_adapters_only

__all__ = ["ADAPTER_MODULES", "CHECKPOINTING_MESSAGE", "LayerSpec", "PRESERVE_MODES", "SUPPORTED", "from_pretrained",
           "revify", "train_adapters_only"]

# The families. revify takes a model by its class (in any family) first, then by the layer conventions
# of the families that detect them, in this order (LLaMA's layers before parallel ones, GPT-2's, then
# pre-norm encoders'). Adding a family: a module with its FAMILY (see core.Family), listed here.
# Detectors run in this order: sandwich before llama (whose detector names Gemma 2's extra norms).
FAMILIES = (timm_vit.FAMILY, timm_eva.FAMILY, hf_vit.FAMILY, dinov2.FAMILY, beit.FAMILY, clip.FAMILY,
            qwen_vision.FAMILY, pixtral.FAMILY, internvl.FAMILY, blip.FAMILY, mllama.FAMILY, llama4_vision.FAMILY,
            sam.FAMILY, aimv2.FAMILY, whisper.FAMILY, moonshine.FAMILY, qwen_audio.FAMILY, neox.FAMILY,
            sandwich.FAMILY, llama.FAMILY, parallel.FAMILY, gpt2.FAMILY, opt.FAMILY, bart.FAMILY, t5.FAMILY,
            t5gemma.FAMILY, nllb_moe.FAMILY, bloom.FAMILY, mpt.FAMILY, lfm2.FAMILY, modernbert.FAMILY,
            distilbert.FAMILY, mpnet.FAMILY, nomic.FAMILY, encoder.FAMILY, postnorm.FAMILY)

SUPPORTED = tuple(line for family in FAMILIES for line in family.supported)


def family_table() -> str:
    """README's table of the families revify converts, made from the registry (in detection order)."""
    rows = ["| family | converts | halves |", "|---|---|---|"]
    rows += [f"| `{family.name}` | {'; '.join(family.supported)} | {FAMILY_HALVES[family.halves]} |"
             for family in FAMILIES]
    return "\n".join(rows)


def revify(model: nn.Module, *, exact: bool = True, frac_bits: int = 16, anchor_every: int | None = None,
           schedule: str = "sequential", preserve: str | None = None, scale_bits: int = 6,
           adapter_size: int = 64, ordinary_top: int = 0, fused_loss: bool = True,
           token_chunk: int | None = None) -> nn.Module:
    """Convert ``model``'s transformer blocks into a reversible stack, in place; returns ``model``.

    ``exact``, ``frac_bits``, ``anchor_every``, ``schedule`` and ``token_chunk`` are
    :class:`~revtriton.engine.ReversibleStack` options (``token_chunk``: the LLaMA-style, GPT-2,
    GPT-NeoX, HF ViT and pre-norm encoder families' MLP halves by chunks of that many token rows, their
    attention by whole samples);
    ``anchor_every=None`` (the default) is 0, except for a preserving conversion on float streams:
    anchors every ``max(1, 8 // bits)`` blocks, ``bits`` being the scale bits a block's inverse
    amplifies rounding by.

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
    config))`` converts the PEFT model's base model in place and returns the PEFT model; with
    ``preserve``, the adapters join the PEFT config's ``modules_to_save`` (PEFT trains and saves
    them). ``get_peft_model`` after a preserving ``revify`` needs them named there
    (``modules_to_save=[*ADAPTER_MODULES]``), else a training forward raises.
    Raises TypeError for an unsupported architecture and NotImplementedError for a supported
    one using a feature the reversible blocks do not reproduce (the message names it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"revify takes an nn.Module, got {type(model).__name__}")
    if preserve is not None and preserve not in PRESERVE_MODES:
        raise ValueError(f"preserve must be None or one of {tuple(PRESERVE_MODES)}, got {preserve!r}")
    for name, value, low in (("scale_bits", scale_bits, 1), ("adapter_size", adapter_size, 1),
                             ("ordinary_top", ordinary_top, 0)):
        checked_int(name, value, low)
    if scale_bits > MAX_SCALE_SHIFT:
        raise ValueError(f"scale_bits must be <= {MAX_SCALE_SHIFT}, got {scale_bits}")
    options = dict(exact=exact, frac_bits=frac_bits, anchor_every=anchor_every, schedule=schedule,
                   token_chunk=token_chunk)
    conversion = _Conversion(options, preserve, scale_bits, adapter_size, ordinary_top)
    target = _peft_base_model(model)  # a PEFT model: its base model is converted, LoRA layers kept
    peft_model = target is not model
    if type(target).__name__ == "FeatureGetterNet" and type(target).__module__.startswith("timm"):
        target = target.model  # timm features_only: the wrapped model (its forward_intermediates) is converted
    if not isinstance(fused_loss, bool):
        raise TypeError(f"fused_loss must be a bool, got {fused_loss!r}")
    recorded = dict(options, preserve=preserve, scale_bits=scale_bits, adapter_size=adapter_size,
                    ordinary_top=ordinary_top, fused_loss=fused_loss)
    if preserve is not None and peft_model:
        _check_peft_saves_modules(model)
    _refuse_per_layer_config(target)
    family, found = _family_of(target)
    components = [] if family is not None else _components(target)
    if family is not None or components:
        if family is not None:
            family.convert(target, conversion, found)
        else:
            for component in _convert_components(target, components, conversion):
                prepare_causal_lm(component, fused_loss)  # a causal LM inside another model: its fused loss too
        _finish_conversion(target, recorded)
        if preserve is not None and peft_model:
            _peft_trains_adapters(model, target)
        return model
    cls = type(target)
    post_norm = _post_norm_layer(target)
    if post_norm is not None:
        raise NotImplementedError(
            f"revify: {cls.__name__} has post-norm layers ({post_norm}: LayerNorm after the residual add, as BERT "
            f"and RoBERTa): a reversible coupling adds each half's output to a stream, which a norm applied after "
            f"the add does not fit; pre-norm models are supported: {', '.join(SUPPORTED)}")
    raise TypeError(f"revify does not support {cls.__module__}.{cls.__qualname__}: {_unmatched_layers(target)}; "
                    f"supported: {', '.join(SUPPORTED)}")


def _repeated_layers(model: nn.Module) -> tuple | None:
    """``(path, layers)``: the longest list of more than one layer of one class in ``model``, or None."""
    best = None
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
            classes = {type(layer) for layer in module}
            if len(classes) == 1 and (best is None or len(module) > len(best[1])):
                best = (path, module)
    return best


def _unmatched_layers(model: nn.Module, supported: str = "the supported list ends this message") -> str:
    """Why no family took ``model``, for revify's error: its layer list (the longest list of one
    layer class), with the parts no family's conventions match, or that it has none; and what to do
    (``supported``: where the families are listed)."""
    best = _repeated_layers(model)
    if best is None:
        return "it has no list of repeated layers (a transformer's layer stack) to make reversible"
    path, layers = best
    parts = ", ".join(name for name, _ in layers[0].named_children()) or "none"
    return (f"its layers ({path or 'the model'}: {len(layers)} x {type(layers[0]).__name__}, with parts {parts}) are "
            f"not those of a family revify converts ({supported}: each family's model classes or layer "
            f"parts); "
            f"a layer made of two residual branches x + F(x), then h + G(h), converts by hand as "
            f"revtriton.ReversibleBlock(F, G) in a ReversibleStack")


def _family_by_class(model: nn.Module):
    """The first family one of whose classes ``model``'s class is or derives from, or None."""
    mro = type(model).__mro__
    return next((family for family in FAMILIES if any(cls.__name__ == name and cls.__module__.startswith(prefix)
                                                       for prefix, name in family.classes for cls in mro)), None)


def _components(model: nn.Module) -> list:
    """``[(sub-model, family, found)]``: the sub-models of a model no family takes whole that families
    take, the outermost ones, in module order: a vision-language model's vision tower and language
    model (LLaVA's CLIP and LLaMA, PaliGemma's SigLIP and Gemma by their class; Gemma 3's text model
    by its layers' conventions: a library model, ``found`` what the family detected). A library model
    that nearly has a family's conventions comes with family None and the detector's refusal as found."""
    found = []

    def walk(module):
        for child in module.children():
            library_model = type(child).__module__.startswith("transformers.") and hasattr(child, "config")
            try:
                family, detected = _family_of(child) if library_model else (_family_by_class(child), None)
            except NotImplementedError as near_miss:  # a family's detector names what differs: refused
                family, detected = None, near_miss
            if family is not None or detected is not None:
                found.append((child, family, detected))
            else:
                walk(child)

    walk(model)
    return found


def _convert_components(model: nn.Module, components: list, conversion) -> list:
    """Convert each part (:func:`_components`); a part its family refuses (NotImplementedError: a
    feature its halves do not reproduce) stays as it is, with a warning naming it and why, so long as
    another part converts (else the refusal is raised: nothing converted). Returns the converted."""
    paths = {id(module): name for name, module in model.named_modules()}
    refused, converted = [], []
    for component, family, found in components:
        try:
            if family is None:  # a near miss of a family's conventions (_components)
                raise found
            _refuse_per_layer_config(component)
            family.convert(component, conversion, found)
            converted.append(component)
        except NotImplementedError as error:
            refused.append((paths[id(component)], error))
    if len(refused) == len(components):
        raise refused[0][1]
    import warnings

    for path, error in refused:
        warnings.warn(f"revtriton: revify left {type(model).__name__}.{path} as it is ({error}); its other parts are "
                      f"reversible stacks", stacklevel=3)
    for path, part in _parts_no_family_takes(model, paths, components):
        why = _unmatched_layers(part, "revtriton.convert.SUPPORTED")
        warnings.warn(f"revtriton: revify left {type(model).__name__}.{path} as it is (no family converts "
                      f"{type(part).__name__}: {why}); its other parts are reversible stacks", stacklevel=3)
    return converted


def _parts_no_family_takes(model: nn.Module, paths: dict, components: list) -> list:
    """``[(path, sub-model)]``: the outermost library sub-models of ``model`` (a vision-language model's
    language model, ...) with a list of repeated layers that hold no part :func:`_components` found: no
    family took them, and none refused them by name (LFM2-VL's hybrid language model beside its SigLIP)."""
    found = [paths[id(component)] for component, _, _ in components]
    left = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(f"{seen}.") for seen, _ in left):
            continue
        library_model = type(module).__module__.startswith("transformers.") and any(
            cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)
        if (library_model and not any(f"{p}.".startswith(f"{path}.") or path.startswith(f"{p}.") for p in found)
                and _repeated_layers(module) is not None):
            left.append((path, module))
    return left


def _refuse_per_layer_config(model: nn.Module):
    """NotImplementedError for a model configured layer by layer (transformers' heterogeneous configs,
    ``config.is_heterogeneous``: NeoMME, Gemma 4): the families read one config for every layer, and
    such a config raises on a global read of a per-layer setting (a window, a head count)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_heterogeneous", False) is True:
        raise NotImplementedError(f"revify: {type(model).__name__} configures its layers one by one (a per-layer "
                                  f"config): the conversion reads one layer's settings for all of them")


def _family_of(model: nn.Module) -> tuple:
    """``(family, found)``: the first family one of whose classes ``model``'s class is or derives from
    (found None), else the first that detects it by its layer conventions (found: what it detected);
    ``(None, None)`` when none does. A detector raises NotImplementedError for a near miss."""
    family = _family_by_class(model)
    if family is not None:
        return family, None
    for family in FAMILIES:
        found = None if family.detect is None else family.detect(model)
        if found is not None:
            return family, found
    return None, None


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


def _library_class(name: str, config):
    """The transformers class ``name``: exported by the library, or else in the modeling module beside its
    config's (the vision encoders of GOT-OCR 2 and SAM, which the library does not export); None if neither."""
    import transformers

    if hasattr(transformers, name):
        return getattr(transformers, name)
    module = type(config).__module__
    if not module.startswith("transformers.models.") or ".configuration_" not in module:
        return None
    try:
        return getattr(importlib.import_module(module.replace(".configuration_", ".modeling_")), name, None)
    except ImportError:
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

    if (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"{path} holds a PEFT adapter (adapter_config.json), not a model: load its base model converted as it "
            f"was trained (revtriton.from_pretrained(saved revified model), or revify(<Model>.from_pretrained(base), "
            f"preserve=...) with the training's options), then peft.PeftModel.from_pretrained(model, {str(path)!r})")
    config = transformers.AutoConfig.from_pretrained(path)
    options = getattr(config, "revtriton", None)
    if not isinstance(options, dict):
        raise ValueError(f"{path} was not saved from a revified model (its config has no 'revtriton' entry): "
                         f"load it with the library and call revify")
    if model_class is None:
        architectures = getattr(config, "architectures", None) or []
        model_class = _library_class(architectures[0], config) if architectures else None
        if model_class is None:
            raise ValueError(f"cannot tell the model class of {path} from its config (architectures="
                             f"{architectures!r}): pass model_class=")
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
    state = _under_model_names(model, _checkpoint_state(path))
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


def _under_model_names(model, state: dict) -> dict:
    """The checkpoint's tensors under the model's state-dict names. Transformers 5 saves some models
    under other names than their modules' (LLaVA's ``model.language_model.*`` as the older
    ``language_model.model.*``): the library's own renaming on save, run on a marker per name, says
    which saved name is which (renamed tensors only; older transformers rename none)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    names = list(model.state_dict())
    saved = revert_weight_conversion(model, {name: torch.tensor(i) for i, name in enumerate(names)})
    renamed = {key: names[int(marker)] for key, marker in saved.items()
               if isinstance(marker, torch.Tensor) and marker.dim() == 0 and names[int(marker)] != key}
    return {renamed.get(key, key): tensor for key, tensor in state.items()}


def _checkpoint_state(path) -> dict:
    """Every tensor of a save_pretrained directory (safetensors, sharded or not; else pytorch_model.bin)."""
    import json

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


def _check_peft_saves_modules(model: nn.Module):
    for name, config in model.peft_config.items():
        if not hasattr(config, "modules_to_save"):  # prompt learning: nothing wraps modules to save
            raise NotImplementedError(
                f"revify(preserve=...) of a PEFT model needs PEFT adapters that save modules (LoRA and the like), "
                f"to train and save the preserving adapters; PEFT adapter {name!r} ({type(config).__name__}) has "
                f"no modules_to_save")


def _peft_trains_adapters(model: nn.Module, target: nn.Module):
    """A PEFT model converted with ``preserve``: its adapters join every PEFT adapter's
    ``modules_to_save`` (PEFT wraps each, trains a copy per PEFT adapter, and saves it with the LoRA
    weights: ``save_pretrained``, the Trainer's checkpoints, ``load_adapter`` on resume)."""
    from peft.utils import set_additional_trainable_modules

    for name, config in model.peft_config.items():
        names = list(config.modules_to_save or [])
        config.modules_to_save = names + [m for m in ADAPTER_MODULES if m not in names]
        set_additional_trainable_modules(target, config, getattr(target, "config", None), name,
                                         activate_adapter=name in model.active_adapters)


# Swapped class name -> (library module, class name, mixin), for unpickling in a fresh process (the
# families' fixed names; names of models admitted by conventions are added as they are met).
_BLOCK_BASES = {name: entry for family in FAMILIES for name, entry in family.pickled.items()}
# (name prefix, "Ordinary" or None, kind) of a swapped class of a model admitted by conventions -> its mixin.
_CONVENTION_MIXINS = {key: mixin for family in FAMILIES for key, mixin in family.conventions.items()}
_CONVENTION_NAME = re.compile(
    rf"Revified({'|'.join(sorted({prefix for prefix, _, _ in _CONVENTION_MIXINS}, key=len, reverse=True))})?"
    rf"(Ordinary)?((\w+?)({'|'.join(sorted({kind for _, _, kind in _CONVENTION_MIXINS}))}|For[A-Z]\w*))")


def __getattr__(name):  # module attribute hook: a swapped class, rebuilt on unpickling in a fresh process
    if name in _named:  # made by a conversion in this process
        return _named[name]
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
    ``RevifiedHostGPT2Style<Family>Model``), parallel ones (``RevifiedHostParallel...``: GPT-J,
    Phi) or sandwich-norm ones (``RevifiedHostSandwich[Ordinary]<Family>DecoderLayer``: Gemma 2,
    OLMo 2), or a pre-norm BERT-style encoder (``RevifiedHostEncoder[Ordinary]<Family>Layer``,
    ``RevifiedHostEncoder<Family>Model``), its class found in the module of transformers'
    ``<Family>Model``; or the head class around any of them (``Revified<Head class>``: an LM, a
    classifier), which transformers exports by its name."""
    match = _CONVENTION_NAME.fullmatch(name)
    if match is None:
        return None
    host, ordinary, class_name, family, kind = match.groups()
    if host is None:  # a head class (an LM, a classifier): transformers exports each by its name
        holder, mixin = class_name, None if ordinary else _RevifiedLM
    else:
        holder, mixin = f"{family}Model", _CONVENTION_MIXINS.get((host, ordinary, kind))
    if mixin is None:
        return None
    module = _library_module(holder, class_name)
    return None if module is None else (module.__name__, class_name, mixin)


def _library_module(holder: str, class_name: str):
    """The transformers module that defines ``class_name``: the module of the exported class ``holder``,
    else ``transformers.models.<m>.modeling_<m>`` for ``<m>`` the snake case of the class name's longest
    CamelCase prefix that names one (a layer class whose model is not ``<prefix>Model``: Mllama's
    ``MllamaSelfAttentionDecoderLayer``, CSM's ``CsmDecoderLayer``); None if none does."""
    transformers = importlib.import_module("transformers")
    candidates = []
    try:
        candidates.append(getattr(transformers, holder).__module__)
    except (ImportError, AttributeError):
        pass
    words = re.findall(r"[A-Z][a-z0-9]*", class_name)
    candidates += [f"transformers.models.{snake}.modeling_{snake}"
                   for snake in ("_".join(words[:k]).lower() for k in range(len(words) - 1, 0, -1))]
    for name in candidates:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, class_name):
            return module
    return None

