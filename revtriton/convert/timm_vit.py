"""timm ``VisionTransformer`` (standard ``Block``): fused halves over the block's weights (LayerScale
folded into the output projection, stochastic depth as a row scale), its own modules otherwise."""
from __future__ import annotations

from torch import nn

from ..halves.base import parameter
from ..halves.transformer import drop_path_scale, layer_scaled
from ..ops.attention import norm_attention_couple
from ..ops.mlp import norm_mlp_couple
from .core import (Family, _convert_blocks, _Half, _OrdinaryBlock, _p, _parts, _RevifiedBlock, _swap_class,
                   CHECKPOINTING_MESSAGE)
from .host import _BlockSteps


def _scale_rows(h, row_scale):
    return h if row_scale is None else h * row_scale.unsqueeze(-1).to(h.dtype)


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
        return drop_path_scale(x, float(getattr(self.block.drop_path1, "drop_prob", 0.0)), self.block.training)

    couple_op = norm_attention_couple

    def operands(self, x, layout=None):  # (a ViT's rows carry no token layout)
        b = _parts(self.block)
        norm, a = b["norm1"], b["attn"]
        qkv, proj = _parts(a)["qkv"], _parts(a)["proj"]
        w_proj, b_proj = layer_scaled(parameter(proj, "weight"), parameter(proj, "bias"), parameter(b["ls1"], "gamma"))
        return ((parameter(norm, "weight"), parameter(norm, "bias"), parameter(qkv, "weight"), parameter(qkv, "bias"),
                 w_proj, b_proj), dict(heads=a.num_heads, causal=False, norm="layer", eps=norm.eps,
                                       row_scale=self._row(x)))

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
        return drop_path_scale(x, float(getattr(self.block.drop_path2, "drop_prob", 0.0)), self.block.training)

    couple_op = norm_mlp_couple

    def operands(self, x, layout=None):
        b = _parts(self.block)
        norm, m = b["norm2"], b["mlp"]
        fc1, fc2 = _parts(m)["fc1"], _parts(m)["fc2"]
        w2, b2 = layer_scaled(parameter(fc2, "weight"), parameter(fc2, "bias"), parameter(b["ls2"], "gamma"))
        return ((parameter(norm, "weight"), parameter(norm, "bias"), parameter(fc1, "weight"), parameter(fc1, "bias"),
                 w2, b2), dict(norm="layer", activation=_timm_activation(_parts(m)["act"]), eps=norm.eps,
                               row_scale=self._row(x)))

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


def _convert_timm_vit(model, conversion, found=None):
    for i, block in enumerate(model.blocks):
        _check_timm_block(i, block)
    model.grad_checkpointing = False  # checkpoint_seq would call blocks one by one
    _swap_class(model, _TimmRevifiedModel)
    _convert_blocks(model, "blocks", model.embed_dim, conversion, (_TimmBlock, _TimmOrdinaryBlock))


_TIMM_VIT = "timm.models.vision_transformer"
FAMILY = Family("timm_vit", ("timm VisionTransformer",), _convert_timm_vit, classes=(("timm", "VisionTransformer"),),
                pickled={"RevifiedBlock": (_TIMM_VIT, "Block", _TimmBlock),
                         "RevifiedOrdinaryBlock": (_TIMM_VIT, "Block", _TimmOrdinaryBlock),
                         "RevifiedVisionTransformer": (_TIMM_VIT, "VisionTransformer", _TimmRevifiedModel)})
