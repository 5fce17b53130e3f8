"""The RevViT presets as timm models (issue 15): importing this module registers
``rev_vit_tiny_patch16_224``, ``rev_vit_small_patch16_224``, ``rev_vit_base_patch16_224`` and
``rev_vit_large_patch16_224`` with timm, so ``timm.create_model`` builds them (RevViT keyword
arguments pass through: ``num_classes``, ``img_size``, ``drop_path_rate``, ``exact``, ...)::

    import timm
    import revtriton.models.timm_models  # noqa: F401 (registers the presets)

    model = timm.create_model("rev_vit_small_patch16_224", num_classes=10, img_size=32, exact=True)

They have no pretrained weights (``pretrained=True`` raises) and no per-block features
(``features_only=True`` raises): for either, revify a timm ViT. Needs timm, imported here only
(``import revtriton`` does not import this module).
"""
from __future__ import annotations

import contextlib

import torch
from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import register_model, resolve_pretrained_cfg

from .vit import REVIFY_TIMM_ADVICE, VIT_PRESETS, RevViT, pool_named


def _cfg() -> dict:
    """timm's data config of a ViT-*/16 at 224 px (as its vit_*_patch16_224), with no weights to download."""
    return dict(url="", num_classes=1000, input_size=(3, 224, 224), pool_size=None, crop_pct=0.9,
                interpolation="bicubic", fixed_input_size=True, mean=IMAGENET_INCEPTION_MEAN,
                std=IMAGENET_INCEPTION_STD, first_conv="patch_embed", classifier="head")


# Read by timm's register_model (it must exist before the entrypoints below are registered).
default_cfgs = {f"rev_vit_{preset}_patch16_224": _cfg() for preset in VIT_PRESETS}


def _create_rev_vit(preset: str, variant: str, pretrained: bool = False, pretrained_cfg=None,
                    pretrained_cfg_overlay=None, cache_dir=None, features_only: bool = False,
                    pretrained_model_args=None, device=None, dtype=None, **kwargs) -> RevViT:
    """RevViT preset ``preset`` built for ``timm.create_model(variant, ...)``.

    ``cache_dir`` and ``pretrained_model_args`` concern weight downloads and are unused.
    ``global_pool`` (timm's name, ``"token"`` or ``"avg"``) sets RevViT's ``pool``; ``img_size``
    may be timm's ``(height, width)`` of a square.
    """
    if pretrained:
        raise ValueError(f"{variant} has no pretrained weights; {REVIFY_TIMM_ADVICE}. "
                         f"(Your own checkpoint: timm.create_model({variant!r}, checkpoint_path=...).)")
    if features_only:
        raise NotImplementedError(f"{variant} has no features_only mode (no per-block features); "
                                  f"{REVIFY_TIMM_ADVICE}")
    if "global_pool" in kwargs:
        if "pool" in kwargs:
            raise ValueError("pass pool (RevViT's name) or global_pool (timm's), not both")
        kwargs["pool"] = pool_named(kwargs.pop("global_pool"))
    img_size = kwargs.get("img_size")
    if isinstance(img_size, (tuple, list)):
        if len(img_size) != 2 or img_size[0] != img_size[1]:
            raise ValueError(f"RevViT takes square images, got img_size={img_size!r}")
        kwargs["img_size"] = img_size[0]

    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = RevViT(**{**VIT_PRESETS[preset], **kwargs})
    if dtype is not None:
        model.to(dtype)

    # timm's data config (timm.data.resolve_model_data_config) reads the model's pretrained_cfg;
    # RevViT takes its img_size only, so the config says that size.
    cfg = resolve_pretrained_cfg(variant, pretrained_cfg=pretrained_cfg,
                                 pretrained_cfg_overlay=pretrained_cfg_overlay).to_dict()
    cfg["input_size"] = (model.in_chans, model.img_size, model.img_size)
    model.pretrained_cfg = model.default_cfg = cfg
    return model


@register_model
def rev_vit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> RevViT:
    """RevViT-Ti/16 (dim 192, depth 12, 3 heads): timm's vit_tiny_patch16_224 with reversible blocks."""
    return _create_rev_vit("tiny", "rev_vit_tiny_patch16_224", pretrained=pretrained, **kwargs)


@register_model
def rev_vit_small_patch16_224(pretrained: bool = False, **kwargs) -> RevViT:
    """RevViT-S/16 (dim 384, depth 12, 6 heads): timm's vit_small_patch16_224 with reversible blocks."""
    return _create_rev_vit("small", "rev_vit_small_patch16_224", pretrained=pretrained, **kwargs)


@register_model
def rev_vit_base_patch16_224(pretrained: bool = False, **kwargs) -> RevViT:
    """RevViT-B/16 (dim 768, depth 12, 12 heads): timm's vit_base_patch16_224 with reversible blocks."""
    return _create_rev_vit("base", "rev_vit_base_patch16_224", pretrained=pretrained, **kwargs)


@register_model
def rev_vit_large_patch16_224(pretrained: bool = False, **kwargs) -> RevViT:
    """RevViT-L/16 (dim 1024, depth 24, 16 heads): timm's vit_large_patch16_224 with reversible blocks."""
    return _create_rev_vit("large", "rev_vit_large_patch16_224", pretrained=pretrained, **kwargs)
