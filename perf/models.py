"""Your own model's shape for ``perf.sweep`` and ``perf.autotune``: from its dimensions, a Hugging
Face config or a timm model name, as a :class:`perf.stacks.Preset`.

Only the block's shape is read; nothing is downloaded and no pretrained weight is loaded: the
sweep builds revtriton's halves of that shape with fresh random weights. A model is given as

* dimensions: ``--dim --heads [--hidden] [--kv-heads] [--mlp swiglu|gelu|gelu_tanh|relu]
  [--causal/--no-causal]``;
* ``--model PATH``: a Hugging Face config (a folder with ``config.json``, as ``save_pretrained``
  writes it, or the JSON file itself);
* ``--model TYPE``: a Hugging Face model type (``llama``, ``gpt2``, ``vit``, ...): that
  architecture's default config, built by ``transformers.AutoConfig.for_model`` offline;
* ``--model ORG/NAME``: a Hugging Face model id whose config is already in the local cache
  (``local_files_only``: never fetched);
* ``--model timm:NAME`` (or a bare timm name when timm is installed): a timm ViT, built on the
  ``meta`` device (no memory, no weights) to read its width, heads, MLP and token count.

Dimension flags given with ``--model`` override the config's. The halves are the nearest
revtriton has (perf.stacks.make_halves): SwiGLU models (``--mlp swiglu``, a config with RMSNorm or
a SiLU MLP) get the llama family (RMSNorm + RoPE grouped-query attention, RMSNorm + SwiGLU);
the others LayerNorm + multi-head attention and a LayerNorm + GELU / GELU-tanh / ReLU MLP (the
gpt2 family when causal, vit otherwise). Each approximation (a GeGLU MLP run as SwiGLU, a head
width other than dim / heads) is listed in ``Preset``'s ``notes`` and printed by the sweep.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from .stacks import Preset

MLPS = ("swiglu", "gelu", "gelu_tanh", "relu")
TEXT_TOKENS = 1024  # a text model's sequence length unless --seq (the sweep's suites reduce it on a CPU)
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                   "gelu_python": "gelu", "quick_gelu": "gelu", "relu": "relu", "silu": "swiglu", "swish": "swiglu"}


class ModelError(ValueError):
    """A model the options cannot describe (the message says what to pass instead)."""


@dataclasses.dataclass
class UserModel:
    preset: Preset
    source: str  # "dims", "hf" or "timm"
    layers: int | None = None  # the model's own depth when known
    notes: tuple = ()  # approximations made to fit revtriton's halves

    def describe(self) -> str:
        p = self.preset
        text = (f"{p.name}: dim {p.dim}, heads {p.heads} ({p.kv_heads} KV), hidden {p.hidden}, "
                f"{'swiglu' if p.family == 'llama' else p.activation or 'gelu'} MLP, "
                f"{'causal' if p.causal else 'bidirectional'}, {p.tokens} tokens, {p.family} halves")
        if self.layers:
            text += f", {self.layers} layers in the model"
        return text


def add_model_args(ap: argparse.ArgumentParser, *, dims_help: bool = True) -> None:
    """The options describing a user's model (shared by perf.sweep and perf.autotune)."""
    group = ap.add_argument_group("your model (instead of the presets; see perf/README.md)")
    group.add_argument("--model", help="a Hugging Face config folder or config.json, a Hugging Face model type "
                       "(llama, gpt2, vit, ...), a cached Hugging Face model id, or timm:NAME; never downloads")
    if dims_help:
        group.add_argument("--dim", type=int, help="model width (with --hidden/--kv-heads/--mlp/--model: your model's; "
                           "alone: the presets' width)")
        group.add_argument("--heads", type=int, help="attention heads")
    group.add_argument("--hidden", type=int, help="MLP hidden width (default: 4 x dim, SwiGLU 8/3 x dim to a "
                       "multiple of 64)")
    group.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; --mlp swiglu)")
    group.add_argument("--mlp", choices=MLPS, help="swiglu (RMSNorm + RoPE attention, SwiGLU) or a LayerNorm MLP "
                       "with gelu, gelu_tanh or relu (default: swiglu for dimensions)")
    group.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                       help="causal attention (default: causal for text models, bidirectional for images)")


def wants_user_model(args, dims_define_model: bool = False) -> bool:
    """A user model is described when --model, --hidden, --kv-heads, --mlp or --(no-)causal is given; in
    perf.sweep --dim and --heads alone rescale the presets (``dims_define_model`` False)."""
    names = ("model", "hidden", "kv_heads", "mlp", "causal") + (("dim", "heads") if dims_define_model else ())
    return any(getattr(args, name, None) is not None for name in names)


def model_from_args(args, dims_define_model: bool = False) -> UserModel | None:
    """The user model the options describe, or None when they describe none (raises ModelError)."""
    if not wants_user_model(args, dims_define_model):
        return None
    if args.model:
        model = resolve(args.model)
    else:
        if args.dim is None or args.heads is None:
            raise ModelError("a model given by its dimensions needs --dim and --heads (and --hidden, --kv-heads, "
                             "--mlp as needed), or --model NAME")
        model = None
    return override(model, dim=args.dim, heads=args.heads, hidden=args.hidden, kv_heads=args.kv_heads,
                    mlp=args.mlp, causal=args.causal, tokens=getattr(args, "seq", None))


def _default_hidden(dim: int, mlp: str) -> int:
    if mlp == "swiglu":
        return max(64, round(8 * dim / 3 / 64) * 64)
    return 4 * dim


def from_dims(dim: int, heads: int, hidden: int | None = None, kv_heads: int | None = None, mlp: str = "swiglu",
              causal: bool = True, tokens: int | None = None, unit: str = "tokens", name: str = "custom") -> Preset:
    """A Preset of the nearest revtriton halves for these dimensions (raises ModelError)."""
    if mlp not in MLPS:
        raise ModelError(f"--mlp must be one of {MLPS}, got {mlp!r}")
    for label, value in (("dim", dim), ("heads", heads), ("hidden", hidden), ("kv-heads", kv_heads),
                         ("seq", tokens)):
        if value is not None and value < 1:
            raise ModelError(f"--{label} must be positive, got {value}")
    if dim % heads:
        raise ModelError(f"--heads ({heads}) must divide --dim ({dim})")
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise ModelError(f"--kv-heads ({kv_heads}) must divide --heads ({heads})")
    if kv_heads != heads and mlp != "swiglu":
        raise ModelError(f"grouped-query attention (--kv-heads {kv_heads} < --heads {heads}) is in revtriton's "
                         "RMSNorm + RoPE attention half, paired with SwiGLU: use --mlp swiglu")
    if (dim // heads) % 2 and mlp == "swiglu":
        raise ModelError(f"RoPE needs an even head width, got dim / heads = {dim // heads}")
    family = "llama" if mlp == "swiglu" else ("gpt2" if causal else "vit")
    return Preset(name, family, dim, heads, kv_heads, tokens or TEXT_TOKENS, hidden or _default_hidden(dim, mlp),
                  causal, unit, None if mlp == "swiglu" else mlp)


def override(model: UserModel | None, *, dim=None, heads=None, hidden=None, kv_heads=None, mlp=None, causal=None,
             tokens=None) -> UserModel:
    """``model`` (or a dimensions-only one) with the given figures replaced."""
    if model is None:
        base = dict(dim=dim, heads=heads, hidden=None, kv_heads=None, mlp="swiglu",
                    causal=True if causal is None else causal, tokens=None, unit="tokens", name="custom")
        model = UserModel(None, "dims")
    else:
        p = model.preset
        base = dict(dim=p.dim, heads=p.heads, hidden=p.hidden, kv_heads=p.kv_heads,
                    mlp="swiglu" if p.family == "llama" else p.activation or "gelu", causal=p.causal, tokens=p.tokens,
                    unit=p.unit, name=p.name)
    changed = {k: v for k, v in dict(dim=dim, heads=heads, hidden=hidden, kv_heads=kv_heads, mlp=mlp, causal=causal,
                                     tokens=tokens).items() if v is not None}
    if model.preset is not None and ({"dim", "mlp"} & set(changed)) and "hidden" not in changed:
        base["hidden"] = None  # derived again from the new width / MLP
    if model.preset is not None and "heads" in changed and "kv_heads" not in changed:
        base["kv_heads"] = None
    base.update(changed)
    if base["dim"] is None or base["heads"] is None:
        raise ModelError("the model's width and head count are unknown: pass --dim and --heads")
    preset = from_dims(**base)
    return dataclasses.replace(model, preset=preset)


# --------------------------------------------------------------------------------------------
# Hugging Face configs


def _first(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def hf_config(name: str):
    """A transformers config from a local folder / file, a model type or a cached model id (offline)."""
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ImportError as err:
        raise ModelError(f"--model {name}: reading a Hugging Face config needs transformers "
                         f"(pip install revtriton[hf]): {err}") from None
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"--model {name}: a folder without config.json")
        path = path / "config.json"
    if path.is_file():
        try:
            model_type = json.loads(path.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError) as err:
            raise ModelError(f"--model {name}: not a Hugging Face config.json ({err})") from None
        if model_type not in CONFIG_MAPPING:
            raise ModelError(f"--model {name}: model_type {model_type!r} is not one this transformers knows "
                             "(custom code is never run: give --dim --heads --hidden ... instead)")
        return CONFIG_MAPPING[model_type].from_json_file(str(path))
    if name in CONFIG_MAPPING:
        return AutoConfig.for_model(name)
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelError(f"--model {name}: not a config folder or file, a Hugging Face model type, or a model id in "
                         f"the local cache (perf never downloads; save the config with save_pretrained(DIR) and pass "
                         f"DIR, or give --dim --heads --hidden ...): {str(err).splitlines()[0]}") from None


def _causal_default(config) -> bool:
    try:
        from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                            MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    except ImportError:  # pragma: no cover - older layouts
        return bool(getattr(config, "is_decoder", False))
    kind = getattr(config, "model_type", None)
    return bool(getattr(config, "is_decoder", False)) or (kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                                                           and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def from_hf_config(config, name: str) -> UserModel:
    """The block shape of a transformers config (its text config for multimodal ones)."""
    if hasattr(config, "get_text_config") and _first(config, "hidden_size", "n_embd", "d_model") is None:
        config = config.get_text_config()
    dim = _first(config, "hidden_size", "n_embd", "d_model", "dim")
    heads = _first(config, "num_attention_heads", "n_head", "encoder_attention_heads")
    if dim is None or heads is None:
        raise ModelError(f"--model {name}: no hidden_size / num_attention_heads in the config "
                         f"({type(config).__name__}); give --dim --heads --hidden instead")
    notes = []
    kv_heads = _first(config, "num_key_value_heads", "n_kv_heads") or heads
    act = _first(config, "hidden_act", "activation_function", "hidden_activation") or "gelu"
    rms = _first(config, "rms_norm_eps") is not None
    mlp = _HF_ACTIVATIONS.get(act)
    if rms and mlp != "swiglu":
        notes.append(f"{act} gated MLP run as SwiGLU")
        mlp = "swiglu"
    elif mlp is None:
        notes.append(f"activation {act!r} run as gelu")
        mlp = "gelu"
    elif mlp == "swiglu" and not rms:
        notes.append("LayerNorm run as RMSNorm (revtriton's SwiGLU half)")
    if kv_heads != heads and mlp != "swiglu":
        notes.append(f"{kv_heads} KV heads run as {heads} (grouped-query attention is in the SwiGLU family only)")
        kv_heads = heads
    head_dim = _first(config, "head_dim")
    if head_dim and head_dim * heads != dim:
        notes.append(f"head width {head_dim} run as dim / heads = {dim // heads}")
    hidden = _first(config, "intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim")
    image, patch = _first(config, "image_size"), _first(config, "patch_size")
    if image and patch:
        image = image if isinstance(image, int) else image[0]
        patch = patch if isinstance(patch, int) else patch[0]
        tokens, unit, causal = (image // patch) ** 2 + 1, "images", False
    else:
        tokens = min(TEXT_TOKENS, _first(config, "max_position_embeddings", "n_positions") or TEXT_TOKENS)
        unit, causal = "tokens", _causal_default(config)
    label = Path(name).name if Path(name).expanduser().exists() else name
    if Path(name).expanduser().is_file():
        label = Path(name).expanduser().parent.name or label
    try:
        preset = from_dims(dim, heads, hidden, kv_heads, mlp, causal, tokens, unit, name=f"hf:{label}")
    except ModelError as err:
        raise ModelError(f"--model {name}: {err}") from None
    return UserModel(preset, "hf", _first(config, "num_hidden_layers", "n_layer"), tuple(notes))


# --------------------------------------------------------------------------------------------
# timm


def timm_available() -> bool:
    try:
        import timm  # noqa: F401
    except ImportError:
        return False
    return True


def from_timm(name: str) -> UserModel:
    """The block shape of a timm ViT, read from the model built on the meta device (no weights)."""
    try:
        import timm
        import torch
    except ImportError as err:
        raise ModelError(f"--model timm:{name} needs timm (pip install revtriton[timm]): {err}") from None
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
    except Exception:  # some models compute on their tensors while built: build them for real
        model = timm.create_model(name, pretrained=False)
    blocks = getattr(model, "blocks", None)
    if not blocks or not hasattr(blocks[0], "attn") or not hasattr(blocks[0], "mlp"):
        raise ModelError(f"--model timm:{name}: not a ViT-style model (no blocks[i].attn / .mlp); "
                         "give --dim --heads --hidden instead")
    block = blocks[0]
    dim = getattr(model, "embed_dim", None) or block.attn.qkv.in_features
    heads = block.attn.num_heads
    mlp, notes = "gelu", []
    fc1 = getattr(block.mlp, "fc1", None) or getattr(block.mlp, "fc1_g", None)
    hidden = fc1.out_features
    if hasattr(block.mlp, "fc1_g") or type(block.mlp).__name__.startswith(("Swi", "Glu")):
        mlp = "swiglu"
        if type(block.mlp).__name__ in ("GluMlp", "SwiGLUPacked"):
            hidden //= 2
        notes.append("LayerNorm + attention run as revtriton's RMSNorm + RoPE attention (SwiGLU family)")
    else:
        act = getattr(block.mlp, "act", None)
        if isinstance(act, torch.nn.GELU):
            mlp = "gelu_tanh" if act.approximate == "tanh" else "gelu"
        elif isinstance(act, torch.nn.ReLU):
            mlp = "relu"
        else:
            notes.append(f"activation {type(act).__name__} run as gelu")
    patches = getattr(getattr(model, "patch_embed", None), "num_patches", None)
    if patches is None:
        raise ModelError(f"--model timm:{name}: no patch_embed.num_patches; pass --seq")
    tokens = patches + int(getattr(model, "num_prefix_tokens", 1))
    preset = from_dims(dim, heads, hidden, None, mlp, False, tokens, "images", name=f"timm:{name}")
    return UserModel(preset, "timm", len(blocks), tuple(notes))


def resolve(name: str) -> UserModel:
    """``--model NAME``: a Hugging Face config (path, model type, cached id) or a timm model."""
    if name.startswith("timm:"):
        return from_timm(name[len("timm:"):])
    if name.startswith("hf:"):
        name = name[len("hf:"):]
        return from_hf_config(hf_config(name), name)
    path = Path(name).expanduser()
    if not path.exists() and "/" not in name and timm_available():
        import timm

        if timm.is_model(name):
            return from_timm(name)
    return from_hf_config(hf_config(name), name)
