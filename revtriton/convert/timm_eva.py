"""timm ``Eva`` (EVA-02: rotary position embeddings, SwiGLU; pre-norm ``EvaBlock``): its halves run
the block's own modules, with the model's rotary embedding passed by the stand-ins."""
from __future__ import annotations

from ..halves.transformer import drop_path_scale
from ..ops.streams import couple_output
from .core import Family, _convert_blocks, _Half, _host_block_mixins, _swap_class
from .host import _HOST_CALL, _host_layer_calls, _HostCall, _unpack_host_cond
from .timm_vit import _scale_rows, _TimmRevifiedModel


class _EvaHalf(_Half):
    """A half of a timm EvaBlock, always through its own modules: EVA's rotary leaves the prefix
    tokens unrotated and its attention may gate or norm its output, which the fused kernels do not.
    Layer scale (gamma) and stochastic depth as the block applies them."""

    def _use_modules(self, x) -> bool:
        return True

    def _scaled(self, h, gamma, drop_path, x):
        if gamma is not None:
            h = gamma * h
        return _scale_rows(h, drop_path_scale(x, float(getattr(drop_path, "drop_prob", 0.0)), self.block.training))


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


def _convert_eva(model, conversion, found=None):
    from timm.models.eva import EvaBlock

    for i, block in enumerate(model.blocks):
        if type(block) is not EvaBlock:
            raise NotImplementedError(f"timm block {i} ({type(block).__name__}): revify supports EVA's pre-norm "
                                      f"EvaBlock only (a post-norm block norms after the residual add)")
    if getattr(model, "rope_mixed", False):
        raise NotImplementedError("revify: timm EVA with mixed (per-layer) rotary embeddings is not supported")
    model.grad_checkpointing = False
    _convert_blocks(model, "blocks", model.embed_dim, conversion, (_EvaBlock, _EvaOrdinaryBlock))
    model.blocks.layers_view = _host_layer_calls
    _swap_class(model, _EvaRevifiedModel)


FAMILY = Family("timm_eva", ("timm Eva (EVA-02, pre-norm EvaBlock)",), _convert_eva, halves="library",
                classes=(("timm", "Eva"),),
                pickled={"RevifiedHostEvaBlock": ("timm.models.eva", "EvaBlock", _EvaBlock),
                         "RevifiedHostOrdinaryEvaBlock": ("timm.models.eva", "EvaBlock", _EvaOrdinaryBlock),
                         "RevifiedEva": ("timm.models.eva", "Eva", _EvaRevifiedModel)})
