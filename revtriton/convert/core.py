"""The shared mechanism of a conversion: the swapped block classes (reversible and ordinary), the
coupling halves over a block's own weights (:class:`_Half`), the block list replaced by a
:class:`~revtriton.engine.ReversibleStack`, and the small readers every family uses (dropouts,
norms, activations, RoPE). Family modules (``llama``, ``gpt2``, ...) build on this one."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..engine import ReversibleStack, block_phase
from ..halves.base import OpHalf, parameter
from ..ops.dispatch import run_bound
from ..ops.mlp import norm_mlp_couple
from ..ops.reference import rope_inv_freq
from ..ops.streams import couple_output
from .preserve import (_add_adapters, _Conversion, _SublayerWithAdapter, _WholeLayer, active_adapter,
                       check_adapters_train)


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
        adapters = preserving_adapters(self)
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


def preserving_adapters(block) -> dict:
    """A preserving conversion's adapters of ``block`` by slot, as its forward runs them (PEFT's
    trained copy when PEFT wraps them); a training forward checks that they train."""
    adapters = {slot: active_adapter(module) for slot, module in block.revtriton_adapters.items()}
    if block.training and torch.is_grad_enabled():
        check_adapters_train(block, list(adapters.values()))
    return adapters


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


def _pickled_host_classes(module: str, layer: str, blocks: tuple, model: str, model_mixin: type) -> dict:
    """``Family.pickled`` of a family converted by its class: its swapped layer classes (reversible,
    ordinary: ``blocks`` from :func:`_host_block_mixins`) and its swapped base model class, each under
    the name ``_swap_class`` gives it (the mixin's ``_class_prefix`` and the library class's name) ->
    (the library's module, class name, mixin)."""
    reversible, ordinary = blocks
    return {f"{reversible._class_prefix}{layer}": (module, layer, reversible),
            f"{ordinary._class_prefix}{layer}": (module, layer, ordinary),
            f"{model_mixin._class_prefix}{model}": (module, model, model_mixin)}


def _pickled_models(blocks: tuple, models) -> dict:
    """``Family.pickled`` of a family that takes several library models with one set of block mixins
    (``blocks``): :func:`_pickled_host_classes` of each ``(module, layer class, model class, model mixin)``
    of ``models``, ``module`` the model's directory in transformers (``transformers.models.<module>``)."""
    return {name: entry for module, layer, model, mixin in models
            for name, entry in _pickled_host_classes(f"transformers.models.{module}.modeling_{module}", layer, blocks,
                                                     model, mixin).items()}


def bound_couple(couple, res, x, sign, frac_bits, *weights, **options):
    """``couple(res, x, sign, frac_bits, *weights, **options)``, an op's dispatching couple, through
    ``ops.dispatch.run_bound``: a repeated call of its signature (every layer, every step) runs a
    runner bound to it, without the checks and the dispatch."""
    return run_bound(couple, res, x, sign, frac_bits, weights, options)


def _concatenated_qkv(q: nn.Module, k: nn.Module, v: nn.Module) -> tuple:
    """The weight and bias (None without) of three q / k / v projections as one, rows [q; k; v]
    (what the fused attention reads)."""
    weight = torch.cat([parameter(q, "weight"), parameter(k, "weight"), parameter(v, "weight")])
    q_bias = parameter(q, "bias")
    return weight, None if q_bias is None else torch.cat([q_bias, parameter(k, "bias"), parameter(v, "bias")])


def _scores_scaled_plainly(attention: nn.Module, head_dim: int) -> bool:
    """Whether an attention module scales its scores by ``head_dim ** -0.5`` (its ``scaling``, when it
    keeps one), as the fused kernels do."""
    return abs(float(getattr(attention, "scaling", head_dim**-0.5)) - head_dim**-0.5) <= 1e-12


def _refuse_meft3_with_parallel_layers(name: str, conversion: _Conversion):
    """meft3's halves are the layer's two sublayers, one after the other: a parallel residual
    (``x + A(x) + M(x)``) does not compose them."""
    if conversion.preserve == "meft3":
        raise NotImplementedError(f"revify: {name} cannot be converted with preserve='meft3': its layers add "
                                  f"attention and MLP in parallel (x + A(x) + M(x)), which meft3's halves (one "
                                  f"sublayer after the other) do not compose; use 'meft1' or 'meft2'")


def _parallel_residual(block) -> bool:
    """A parallel residual, ``x + A(x) + M(x)``: GPT-NeoX's (an attribute of its layers), GPT-J's."""
    return bool(getattr(block, "use_parallel_residual", False) or _spec_of(block).parallel)


def _convert_blocks(owner: nn.Module, attribute: str, dim: int, conversion: _Conversion, mixins):
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
            _swap_class(block, ordinary)
            continue
        _swap_class(block, reversible)
        if coupling is not None:
            block._revtriton_preserve = conversion.preserve
            block.coupling = coupling
            _add_adapters(block, dim, conversion)
    setattr(owner, attribute, ReversibleStack(list(blocks), **conversion.stack_options()))


@dataclass(frozen=True)
class Family:
    """What revify needs of a model family, declared by its module (``FAMILY``); the package's
    registry derives from these: the error's supported list, the order of detection and the names
    swapped classes pickle by.

    A model is converted by the first family one of whose ``classes`` its class is (or derives
    from), else by the first whose ``detect`` finds it (the registry's order), a model admitted by
    its layer conventions. ``convert(model, conversion, found)`` converts it in place; ``found`` is
    None for a model taken by its class, else what ``detect`` returned (detected once).
    """

    name: str
    supported: tuple  # lines of revify's "supported:" list
    convert: Callable
    halves: str = "fused"  # what its halves run: FAMILY_HALVES' keys (README's family table)
    classes: tuple = ()  # (module prefix, class name) of the model classes taken by their class
    detect: Callable | None = None  # detect(model) -> what convert needs, or None (raises for a near miss)
    pickled: dict = field(default_factory=dict)  # swapped class name -> (library module, class name, mixin)
    # (name prefix, "Ordinary" or None, layer / model kind) -> mixin, for the swapped classes of models
    # admitted by conventions, named after whatever family they are (see the package's _convention_class)
    conventions: dict = field(default_factory=dict)


# What a family's halves run, as README's family table says it.
FAMILY_HALVES = {
    "fused": "fused kernels where they compute the layer's branch, else the layer's own modules",
    "library": "the layer's own modules (its attention as its library runs it)",
    "whole layer": "the whole pretrained layer as one half: preserve='meft1' / 'meft2' only",
}


# Swapped classes pickle as attributes of the package (``revtriton.convert.<name>``), wherever the
# mixin that made them lives: the package's module hook finds them (or rebuilds them in a fresh
# process from its registry), so pickles stay valid when code moves between its modules.
SWAPPED_MODULE = "revtriton.convert"
_swapped = {}  # (library class, mixin) -> swapped class
_named = {}  # name -> the first swapped class made under it in this process


def _swapped_class(name: str, mixin: type, cls: type) -> type:
    """The class ``mixin + cls``, found by pickle as ``revtriton.convert.<name>`` (its ``__qualname__``,
    :data:`SWAPPED_MODULE`).

    A mixin with ``_keeps_class_name`` keeps ``cls.__name__`` (Hugging Face writes a model's class
    name into the saved config's ``architectures``).
    """
    new_cls = type(name, (mixin, cls), {"__module__": SWAPPED_MODULE, "__qualname__": name})
    if getattr(mixin, "_keeps_class_name", False):
        new_cls.__name__ = cls.__name__
    _record_outputs_as(new_cls, cls, getattr(mixin, "_recorded_outputs", ()))
    return new_cls


def _record_outputs_as(new_cls: type, cls: type, names: tuple):
    """transformers 5 records some outputs of a model's modules by hooks (``capture_outputs``: Switch
    Transformers' router logits), looked up by the model's class name: the swapped class records
    ``names`` of them as the library's class does (only those its mixin says its forward keeps right)."""
    recordable = {key: spec for key, spec in (getattr(cls, "_can_record_outputs", None) or {}).items() if key in names}
    if not recordable:
        return
    from transformers.utils import output_capturing

    registry = output_capturing._CAN_RECORD_REGISTRY  # keyed by str(the model's class) (its __setitem__ takes a model)
    dict.__setitem__(registry, str(new_cls), recordable)


def _swap_class(module: nn.Module, mixin: type):
    """Give ``module`` the class ``mixin + its class`` (made once per pair; the package answers its
    name, the first class made under a name keeping it)."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    name = f"{getattr(mixin, '_class_prefix', 'Revified')}{cls.__name__}"
    if (cls, mixin) not in _swapped:
        new_cls = _swapped[(cls, mixin)] = _swapped_class(name, mixin, cls)
        _named.setdefault(name, new_cls)
    module.__class__ = _swapped[(cls, mixin)]


class _Half(OpHalf):
    """A coupling half over a block's own weights (not an nn.Module: the block keeps them).

    Two paths with the same math: ``_fused`` hands the raw weights to the ops layer (fused
    Triton kernels on CUDA, the pure-torch reference elsewhere); ``_modules`` calls the block's
    own submodules. The module path runs when dropout is active in training or when a
    projection is not a plain layer (a PEFT/LoRA wrapper, a quantized linear), so adapters
    are never bypassed. Halves that take the model's layer inputs as conditioning (a Hugging
    Face model's attention, EVA's) override ``couple`` / ``__call__``; here ``cond`` is None.
    """

    takes_cond = False  # the attention halves of Hugging Face models and EVA: True (see _pack_host_cond)
    rows_independent = False  # token-wise halves (the families' MLPs): True (revtriton.engine.rows)

    def __init__(self, block: nn.Module):
        self.block = block

    def _spec(self) -> LayerSpec:
        return _spec_of(self.block)

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

    # The fused path: ``couple_op`` (ops.mlp / ops.attention) over ``operands``, as halves.transformer's
    # halves compute theirs (halves.base.OpHalf): every family's fused path.
    couple_op = None

    def operands(self, x, layout=None) -> tuple:
        """(positional weights, keyword options) of ``couple_op`` for input ``x``, read from the block's
        own modules; ``layout``: the token layout (attention halves that take one)."""
        raise NotImplementedError

    def _fused(self, res, x, sign, frac_bits, layout=None):
        weights, options = self.operands(x, layout)
        x = self._input(x, weights[0])  # the norm's weight: the block's dtype
        return bound_couple(type(self).couple_op, res, x, sign, frac_bits, *weights, **options)

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


# Hugging Face activation names -> the fused MLP's (GPT-2's activation_function, ViT's hidden_act).
_HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def _norm_eps(norm) -> float:
    eps = getattr(norm, "variance_epsilon", None)  # (no eager default: an absent attribute costs a raise)
    return float(getattr(norm, "eps", 1e-6) if eps is None else eps)



class _NormMlpHalf(_Half):
    """A token-wise half ``out(act(inner(norm(x))))`` over a LayerNorm and two projections: the fused
    MLP couple where the kernels have the activation (the layer's spec: ``activation``, None where
    they have not), else the layer's own modules. A family names the norm (``_mlp_norm``) and the
    projections (``_projections``: inner, out)."""

    rows_independent = True  # each token's MLP output from its own row (ReversibleStack token_chunk)
    couple_op = norm_mlp_couple

    def _mlp_norm(self) -> nn.Module:
        raise NotImplementedError

    def _beyond_fused(self, x):
        return self._spec().activation is None

    def operands(self, x, layout=None):
        norm = self._mlp_norm()
        inner, out = self._projections()
        return ((parameter(norm, "weight"), parameter(norm, "bias"), parameter(inner, "weight"),
                 parameter(inner, "bias"), parameter(out, "weight"), parameter(out, "bias")),
                dict(norm="layer", activation=self._spec().activation, eps=norm.eps))


class _LibraryHalf(_Half):
    """A half that always runs its layer's own modules (``_modules``): a branch the fused kernels do
    not compute (the families converted on the library path)."""

    def _beyond_fused(self, x):
        return True


class _LibraryMlpHalf(_LibraryHalf):
    """G of a layer whose MLP branch is ``mlp(norm(x))`` on its own modules, named by the family:
    ``_norm_name`` and ``_mlp_name`` (BLIP's ``layer_norm2`` and ``mlp``, LFM2's ``ffn_norm`` and
    ``feed_forward``, ...)."""

    _norm_name = _mlp_name = ""

    def _modules(self, x):
        parts = _parts(self.block)
        norm = parts[self._norm_name]
        return parts[self._mlp_name](norm(self._input(x, norm.weight)))

def _residual_dropout(block, name):
    """A dropout on a branch's output before the residual add (Phi-3's, Phi's, an encoder's output
    dropout; Falcon's ``hidden_dropout``, a probability its layer applies with ``dropout_add``), or
    Identity where the block has none."""
    found = getattr(block, name, None)
    if isinstance(found, (int, float)) and not isinstance(found, bool):
        return _dropout(found, block.training)
    return found or nn.Identity()


def _dropout(p: float, training: bool):
    """``F.dropout`` at probability ``p`` (Identity at 0)."""
    return functools.partial(nn.functional.dropout, p=p, training=training) if p else nn.Identity()


def _parts(module: nn.Module) -> dict:
    """``module``'s submodules by name (its ``_modules``). The fused halves read a dozen a call:
    ``module.name`` goes through ``nn.Module.__getattr__`` (about a microsecond a read), and
    ``hasattr`` of an absent one raises inside it (1.7)."""
    return module._modules


def _branch_p(block, name) -> float:
    """The probability of :func:`_residual_dropout`'s dropout (0.0 where the block has none), found
    without ``nn.Module.__getattr__`` (a submodule, an instance or a class attribute)."""
    found = block._modules.get(name)
    if found is None:
        found = vars(block).get(name, getattr(type(block), name, None))
    return _p(found)


# RoPE variants whose frequencies are fixed when the model is built (the rotary embedding's inv_freq
# and attention_scaling say it all); "dynamic" and "longrope" change them with the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_spec(config, name, base, head_dim) -> dict:
    """``rope_theta`` and ``rope_module``: None for default RoPE (the fused kernels compute it from
    theta), else the model's rotary embedding, whose scaled frequencies the library path reads;
    ``library_rope``: RoPE only the model's own rotary embedding and attention compute (dynamic /
    longrope scaling, partial rotary, multimodal RoPE), on the library path."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    rotary = getattr(base, "rotary_emb", None)
    # Multimodal RoPE (Qwen2-VL's: frequency bands rotated by a temporal, height and width position
    # each) is plain RoPE only while the three positions agree: the model's own rotary embedding.
    multimodal = bool(params.get("mrope_section") or scaling.get("mrope_section"))
    if rotary is not None and (multimodal or rope_type not in STATIC_ROPE_TYPES or getattr(
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


@dataclass
class LayerSpec:
    """A converted layer's spec, set at conversion and kept on the block (``_revtriton_spec``, pickled
    with it): what its halves compute fused, its attention's heads and RoPE, its attention kind, its
    parts' names. Families set the fields they use; the defaults describe a layer with nothing to say."""

    fused_attention: bool = True  # the fused kernels compute the layer's attention branch
    fused_mlp: bool = True
    fused_norm: bool | None = True  # None: not decided yet (weights on the meta device or sharded)
    fused_heads: bool = True  # head_dim * heads == width
    activation: str | None = None  # the fused MLP's activation (None: one it does not have)
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    rope_theta: float = 0.0
    rope_dims: int = 0  # rotated dims of a head (GPT-NeoX's partial rotary)
    rope_module: nn.Module | None = None  # the model's rotary embedding, where its frequencies are scaled
    library_rope: bool = False  # RoPE only the model's rotary embedding computes (the library path)
    window: int | None = None  # a sliding window (None: full attention)
    parallel: bool = False  # x + A(x) + M(x)
    gpt2_layout: bool = True  # GPT-2's q/k/v: transformers' Conv1D, side by side
    norm: str = ""  # parallel layers: the names of the norm and attention submodules
    attention: str = ""
    mlp_norm: str = ""  # parallel layers whose MLP has a norm of its own (Falcon's ln_mlp): its name
    library_causal: bool = False  # the library's loop passes is_causal=True to the attention (CLIP's text)
    # Layer tensors the library's loop makes again for each layer, the same values from the same module
    # (Data2Vec-vision's shared relative_position_bias): the first layer's stands for all of them
    loop_remade: tuple = ()


LayerSpec.__module__ = SWAPPED_MODULE  # pickled with the blocks by the package's name, wherever it lives


def _spec_of(block) -> LayerSpec:
    """A converted layer's spec (:class:`LayerSpec`; the defaults for families that keep none)."""
    spec = getattr(block, "_revtriton_spec", None)
    if spec is None:
        return LayerSpec()
    if isinstance(spec, dict):  # a model pickled when specs were dicts
        spec = block._revtriton_spec = LayerSpec(**spec)
    return spec
