"""The SAM-style ViT image encoders (ViTDet's layers): SAM's and SAM-HQ's (``SamVisionEncoder``, the
``vision_encoder`` of ``SamModel``; ``SamHQVisionEncoder``), and the vision towers built on them of GOT-OCR 2,
DeepSeek-OCR 2, Unlimited-OCR, PP-FormulaNet and SLANeXt. Pre-norm layers over a grid of patches
(``[batch, height, width, dim]`` streams): ``x + attn(layer_norm1(x))``, the attention within windows of
``window_size`` patches (the grid padded and partitioned, then put back) or, in the layers of
``global_attn_indexes`` (``window_size`` 0), over the whole grid, with relative positions in its scores; then
``h + mlp(layer_norm2(h))``. The encoder's loop hands each layer the grid alone; both halves run the layer's
own modules (its own partition and unpartition). SAM-HQ's loop also reads its global layers' outputs (its
intermediate embeddings): that stack runs in segments ending there."""
from __future__ import annotations

from torch.nn.attention import SDPBackend, sdpa_kernel

from .core import Family, _host_block_mixins, _LibraryMlpHalf, _pickled_models
from .host import _blocks, _convert_library_tower, _first, _HostTowerModel, _LibraryAttentionHalf

_LAYER_PARTS = {"layer_norm1", "attn", "layer_norm2", "mlp"}


class _SamAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.attn

    def _library_call(self, x, host, extra):  # (the encoder masks nothing)
        # SAM's SDPA attention takes the relative positions as its mask, and scaled_dot_product_attention picks
        # its kernel by whether that mask needs grad: the forward runs without grad, the rebuild with it. One
        # kernel for both, so that the rebuild computes the forward's bits (exact streams check them).
        with sdpa_kernel(SDPBackend.MATH):
            return self._attention(x)

    def _attention(self, x):
        b = self.block
        normed = b.layer_norm1(self._input(x, b.layer_norm1.weight))
        if b.window_size <= 0:
            return _first(b.attn(hidden_states=normed))
        height, width = normed.shape[1], normed.shape[2]
        windows, padded = b.window_partition(normed, b.window_size)
        return b.window_unpartition(_first(b.attn(hidden_states=windows)), b.window_size, padded, (height, width))


class _SamMlpHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "layer_norm2", "mlp"


_HostSamBlock, _HostSamOrdinaryBlock = _host_block_mixins((_SamAttentionHalf, _SamMlpHalf))


class _HostSamVisionEncoder(_HostTowerModel):
    """A SAM-style encoder (its loop over ``layers``): the grid of patches alone."""


class _HostSamHQVisionEncoder(_HostSamVisionEncoder):
    """SAM-HQ's encoder: its loop also reads the global attention layers' outputs (its intermediate
    embeddings, for the HQ mask decoder), so the stack runs in segments ending there."""

    def _read_layers(self, kwargs) -> tuple:
        return tuple(i for i, layer in enumerate(_blocks(self.layers)) if layer.window_size == 0)


# (transformers module, layer class, encoder class, its host mixin)
_ENCODERS = (("sam", "SamVisionLayer", "SamVisionEncoder", _HostSamVisionEncoder),
             ("sam_hq", "SamHQVisionLayer", "SamHQVisionEncoder", _HostSamHQVisionEncoder),
             ("got_ocr2", "GotOcr2VisionLayer", "GotOcr2VisionEncoder", _HostSamVisionEncoder),
             ("deepseek_ocr2", "DeepseekOcr2SamVisionLayer", "DeepseekOcr2SamVisionEncoder", _HostSamVisionEncoder),
             ("unlimited_ocr", "UnlimitedOcrSamVisionLayer", "UnlimitedOcrSamVisionEncoder", _HostSamVisionEncoder),
             ("pp_formulanet", "PPFormulaNetVisionLayer", "PPFormulaNetVisionModel", _HostSamVisionEncoder),
             ("slanext", "SLANeXtVisionLayer", "SLANeXtVisionEncoder", _HostSamVisionEncoder))
_HOSTS = {encoder: host for _, _, encoder, host in _ENCODERS}


def _convert_sam(model, conversion, found=None):
    host = next(_HOSTS[c.__name__] for c in type(model).__mro__ if c.__name__ in _HOSTS)
    _convert_library_tower(model, model, "layers", _LAYER_PARTS, conversion, (_HostSamBlock, _HostSamOrdinaryBlock),
                           host)
FAMILY = Family("sam", ("the SAM-style image encoders of transformers SAM and SAM-HQ (SamVisionEncoder, "
                        "SamHQVisionEncoder: SamModel's vision_encoder) and the vision towers built on them of "
                        "GOT-OCR 2, DeepSeek-OCR 2, Unlimited-OCR, PP-FormulaNet and SLANeXt: windowed and global "
                        "attention layers over a grid of patches",),
                _convert_sam, halves="library",
                classes=tuple(("transformers", encoder) for _, _, encoder, _ in _ENCODERS),
                pickled=_pickled_models((_HostSamBlock, _HostSamOrdinaryBlock), _ENCODERS))
