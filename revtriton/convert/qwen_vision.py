"""The vision towers of Qwen2-VL (``Qwen2VisionTransformerPretrainedModel``), Qwen2.5-VL
(``Qwen2_5_VisionTransformerPretrainedModel``), Qwen3-VL (``Qwen3VLVisionModel``, its MoE sibling's), Qwen3-Omni's
(``Qwen3OmniMoeVisionEncoder``: Qwen3-VL's), Qwen3.5's and Qwen4-Exp's (Qwen3-VL's blocks, no deepstack layers),
Muse Glimmer's (``MuseGlimmerVisionModel``: Qwen's block names, its loop over ``layers`` by its config's
``layer_types``),
found as a part of their vision-language models (``visual``, ``vision_tower``): pre-norm blocks ``x + attn(norm1(x))``,
then ``h + mlp(norm2(h))``, over every image's patches packed in one row (``[patches, dim]``). Each
image attends to itself: the loop hands every block the images' boundaries (``cu_seqlens``) and the
longest one's length (``max_seqlen``), and Qwen2.5-VL's windowed blocks (all but
``fullatt_block_indexes``) the windows' instead; the 2-D rotary embedding is the tower's. Both halves
run the block's own modules; the conditioning carries the boundaries of each block's kind (full,
windowed) as its mask, so the rebuild in backward sees what the forward saw. Qwen3-VL's loop also reads
some blocks' outputs (its deepstack layers, merged into the language model's first layers): the stack
runs in segments that end at those blocks, each a reversible stack of its own on the streams the
previous one left (its output kept, as the loop keeps it).

The towers that pack their images as Qwen's do with SigLIP's layer names (``layer_norm1``, ``self_attn``,
``layer_norm2``, ``mlp``): VideoLLaMA 3's (its loop its ``encoder``), MiniMax-M3-VL's, Ovis2.5's (its
config's ``layer_types``: full and windowed layers) and Cosmos3-Edge's (no rotary embedding)."""
from __future__ import annotations

from .core import Family, LayerSpec, _LibraryMlpHalf, _pickled_models
from .host import (_blocks_renaming_a_loop_input, _convert_library_tower, _first, _HostTowerModel,
                   _LibraryAttentionHalf)

_BLOCK_PARTS = {"norm1", "norm2", "attn", "mlp"}
_NAVIT_PARTS = {"layer_norm1", "self_attn", "layer_norm2", "mlp"}


class _QwenVisionAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.attn

    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.norm1.weight)
        return b.attn(b.norm1(x), cu_seqlens=host.mask_for(b), max_seqlen=host.max_seqlen_for(b),
                      position_embeddings=host.rotary_for(b))


class _NaViTAttentionHalf(_LibraryAttentionHalf):
    def _attention_module(self):
        return self.block.self_attn

    def _library_call(self, x, host, extra):
        """The attention on the patches as one row of [patches, dim] (MiniMax-M3-VL's layers squeeze the
        tower's [1, patches, dim] for it), its output back in ``x``'s shape."""
        b = self.block
        x = self._input(x, b.layer_norm1.weight)
        normed = b.layer_norm1(x)
        rotary = host.rotary_for(b)  # (Cosmos3-Edge's tower has none)
        out = _first(b.self_attn(normed.reshape(-1, normed.shape[-1]), cu_seqlens=host.mask_for(b),
                                 max_seqlen=host.max_seqlen_for(b),
                                 **({} if rotary is None else {"position_embeddings": rotary})))
        return out.view(x.shape)


class _NaViTMlpHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "layer_norm2", "mlp"


class _QwenVisionMlpHalf(_LibraryMlpHalf):
    _norm_name, _mlp_name = "norm2", "mlp"


# The towers' loops hand each block its images' (or windows') boundaries as cu_seqlens: the conditioning
# carries them as the block's attention mask, one per attention kind.
_HostQwenVisionBlock, _HostQwenVisionOrdinaryBlock = _blocks_renaming_a_loop_input(
    (_QwenVisionAttentionHalf, _QwenVisionMlpHalf), "cu_seqlens", "attention_mask", "_HostQwenVision")
_HostNaViTBlock, _HostNaViTOrdinaryBlock = _blocks_renaming_a_loop_input(
    (_NaViTAttentionHalf, _NaViTMlpHalf), "cu_seqlens", "attention_mask", "_HostNaViT")


class _HostQwenVisionModel(_HostTowerModel):
    """A Qwen vision tower: its blocks ``blocks``."""

    _layers = "blocks"


class _HostQwen3VisionModel(_HostQwenVisionModel):
    """Qwen3-VL's vision tower: its loop reads the deepstack layers' outputs."""

    def _read_layers(self, kwargs) -> tuple:
        return tuple(self.deepstack_visual_indexes)


class _HostNaViTLoop(_HostTowerModel):
    """A SigLIP-named tower's loop (its ``layers``): the images' boundaries and rotary embedding the tower's."""


# The towers with SigLIP's layer names, by class: (module, layer class, the path of their loop in the tower
# ("": the tower itself), its class)
_NAVIT_TOWERS = {"VideoLlama3VisionModel": ("video_llama_3", "VideoLlama3VisionEncoderLayer", "encoder",
                                            "VideoLlama3VisionEncoder"),
                 "MiniMaxM3VLVisionModel": ("minimax_m3_vl", "MiniMaxM3VLVisionEncoderLayer", "",
                                            "MiniMaxM3VLVisionModel"),
                 # (its config's layer_types: full and windowed layers, each kind its own boundaries)
                 "Ovis2_5VisionModel": ("ovis2_5", "Ovis2_5VisionEncoderLayer", "", "Ovis2_5VisionModel"),
                 # (no rotary embedding: learned positions enter with the patches)
                 "Cosmos3EdgeVisionModel": ("cosmos3_edge", "Cosmos3EdgeVisionEncoderLayer", "encoder",
                                            "Cosmos3EdgeEncoder")}


# The towers with Qwen's block names whose loop runs ``layers`` by their config's layer_types (full and windowed
# layers), as Ovis2.5's: (module, layer class)
_LAYER_TYPED_TOWERS = {"MuseGlimmerVisionModel": ("muse_glimmer", "MuseGlimmerVisionEncoderLayer")}


def _specs_by_layer_type(model):
    """Each layer's LayerSpec from the config's ``layer_types`` (windowed layers the other attention kind, their own
    boundaries), or None where the config has none."""
    kinds, window = getattr(model.config, "layer_types", None), getattr(model, "window_size", None)
    return None if kinds is None else [
        LayerSpec(fused_attention=False, fused_mlp=False, window=None if kind == "full_attention" else window)
        for kind in kinds]


def _convert_qwen_vision(model, conversion, found=None):
    names = {c.__name__ for c in type(model).__mro__}
    navit = next((_NAVIT_TOWERS[name] for name in _NAVIT_TOWERS if name in names), None)
    if navit is not None:
        loop = model.get_submodule(navit[2]) if navit[2] else model
        _convert_library_tower(model, loop, "layers", _NAVIT_PARTS, conversion,
                               (_HostNaViTBlock, _HostNaViTOrdinaryBlock), _HostNaViTLoop, _specs_by_layer_type(model))
        return
    if names & set(_LAYER_TYPED_TOWERS):
        _convert_library_tower(model, model, "layers", _BLOCK_PARTS, conversion,
                               (_HostQwenVisionBlock, _HostQwenVisionOrdinaryBlock), _HostNaViTLoop,
                               _specs_by_layer_type(model))
        return
    full = set(getattr(model, "fullatt_block_indexes", range(len(model.blocks))))  # (Qwen2-VL's: every block)
    window = getattr(model.config, "window_size", None)
    # windowed blocks are the other attention kind (their own boundaries)
    specs = [LayerSpec(fused_attention=False, fused_mlp=False, window=None if i in full else window)
             for i in range(len(model.blocks))]
    host = _HostQwen3VisionModel if hasattr(model, "deepstack_visual_indexes") else _HostQwenVisionModel
    _convert_library_tower(model, model, "blocks", _BLOCK_PARTS, conversion,
                           (_HostQwenVisionBlock, _HostQwenVisionOrdinaryBlock), host, specs)


# (module, block class, tower class, host model mixin)
_TOWERS = (("qwen2_vl", "Qwen2VLVisionBlock", "Qwen2VisionTransformerPretrainedModel", _HostQwenVisionModel),
           ("qwen2_5_vl", "Qwen2_5_VLVisionBlock", "Qwen2_5_VisionTransformerPretrainedModel", _HostQwenVisionModel),
           ("exaone4_5", "Exaone4_5_VisionBlock", "Exaone4_5_VisionModel", _HostQwenVisionModel),  # (Qwen2.5-VL's)
           ("qwen3_vl", "Qwen3VLVisionBlock", "Qwen3VLVisionModel", _HostQwen3VisionModel),
           ("qwen3_vl_moe", "Qwen3VLMoeVisionBlock", "Qwen3VLMoeVisionModel", _HostQwen3VisionModel),
           ("qwen3_omni_moe", "Qwen3OmniMoeVisionBlock", "Qwen3OmniMoeVisionEncoder", _HostQwen3VisionModel),
           # (Qwen3-VL's blocks without the deepstack layers)
           ("qwen3_5", "Qwen3_5VisionBlock", "Qwen3_5VisionModel", _HostQwenVisionModel),
           ("qwen3_5_moe", "Qwen3_5MoeVisionBlock", "Qwen3_5MoeVisionModel", _HostQwenVisionModel),
           ("qwen4_exp", "Qwen4ExpVisionBlock", "Qwen4ExpVisionModel", _HostQwenVisionModel))
FAMILY = Family("qwen_vision", ("the vision towers of transformers Qwen2-VL, Qwen2.5-VL and EXAONE 4.5 (their windowed "
                                "blocks too), Qwen3-VL and Qwen3-Omni (their deepstack layers' outputs read between "
                                "segments), Qwen3.5, Qwen4-Exp and Muse Glimmer (its config's layer_types), and "
                                "VideoLLaMA 3's, MiniMax-M3-VL's, Ovis2.5's and Cosmos3-Edge's (SigLIP's layer names; "
                                "Ovis2.5's windowed layers too): the images' patches packed in one row",),
                _convert_qwen_vision, halves="library",
                classes=(*(("transformers", tower) for _, _, tower, _ in _TOWERS),
                         *(("transformers", tower) for tower in (*_NAVIT_TOWERS, *_LAYER_TYPED_TOWERS))),
                pickled={**_pickled_models((_HostQwenVisionBlock, _HostQwenVisionOrdinaryBlock),
                                           (*_TOWERS, *((module, layer, tower, _HostNaViTLoop)
                                                        for tower, (module, layer) in _LAYER_TYPED_TOWERS.items()))),
                         **_pickled_models((_HostNaViTBlock, _HostNaViTOrdinaryBlock),
                                           ((module, layer, loop, _HostNaViTLoop)
                                            for module, layer, _, loop in _NAVIT_TOWERS.values()))})
