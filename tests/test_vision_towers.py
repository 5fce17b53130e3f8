"""The vision towers of vision-language models under revify: Pixtral's (Mistral 3's, LightOnOCR's;
revtriton/convert/pixtral.py), InternVL's and Qianfan-OCR's (revtriton/convert/internvl.py), BLIP's, BLIP-2's and
InstructBLIP's (revtriton/convert/blip.py), EXAONE 4.5's, VideoLLaMA 3's, MiniMax-M3-VL's, Ovis2.5's and
Cosmos3-Edge's (the qwen_vision family's: the images packed in one row), Janus's SigLIP tower (the clip
family's), Mllama's two encoders (revtriton/convert/mllama.py), Llama 4's tower
(revtriton/convert/llama4_vision.py), the Qwen3-VL-style towers of Qwen3.5, Qwen3.5-MoE, Qwen4-Exp and
Qwen3-Omni and Muse Glimmer's (the qwen_vision family's), and AIMv2's towers and Ovis2's
(revtriton/convert/aimv2.py).
Each tower is a stack run through the library's own forward (its loop, its mask and rotary embedding);
found as a part, beside the language model."""
import copy
import warnings

import pytest
import torch

from revtriton import ReversibleStack
from revtriton.convert import revify

from revified import assert_exact_step_equals_twin, assert_round_trips
from test_revify import DEPTH

transformers = pytest.importorskip("transformers")


def _stacks(model):
    return [m for m in model.modules() if isinstance(m, ReversibleStack)]


def _off_their_init(model):
    """Weights off their small init, norms' and layer scales' off one: every branch shows in the output."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
            else:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _pixtral(seed, **overrides):
    torch.manual_seed(seed)
    config = transformers.PixtralVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, head_dim=8,
        image_size=32, patch_size=8), **overrides})
    return _off_their_init(transformers.PixtralVisionModel(config))


def _internvl(seed, **overrides):
    torch.manual_seed(seed)
    config = transformers.InternVLVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=[32, 32],
        patch_size=[8, 8]), **overrides})
    return _off_their_init(transformers.InternVLVisionModel(config))


def _qianfan(seed, **overrides):
    """Qianfan-OCR's tower: InternViT's layers (layer scales on both branches), drop-path on both (0 to 0.2)."""
    torch.manual_seed(seed)
    config = transformers.QianfanOCRVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=32,
        patch_size=8, drop_path_rate=0.2), **overrides})
    return _off_their_init(transformers.QianfanOCRVisionModel(config))


def _blip(kind):
    def make(seed, **overrides):
        torch.manual_seed(seed)
        config = getattr(transformers, f"{kind}VisionConfig")(**{**dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=32,
            patch_size=8), **overrides})
        return _off_their_init(getattr(transformers, f"{kind}VisionModel")(config))
    return make


def _exaone(seed, **overrides):
    """EXAONE 4.5's tower: Qwen2.5-VL's (the qwen_vision family's), a windowed block either side of a full one."""
    torch.manual_seed(seed)
    config = transformers.Exaone4_5_VisionConfig(**{**dict(
        depth=DEPTH, hidden_size=32, intermediate_size=64, num_heads=4, num_key_value_heads=2, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=32, fullatt_block_indexes=[1],
        window_size=16), **overrides})
    return _off_their_init(transformers.Exaone4_5_VisionModel(config))


def _janus(seed, **overrides):
    """Janus's SigLIP tower (the clip family's): q / k norms and a projection_layer in its attention (the
    layer's own modules), two dropouts in its MLP."""
    torch.manual_seed(seed)
    config = transformers.JanusVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=32,
        patch_size=8), **overrides})
    return _off_their_init(transformers.JanusVisionModel(config))


def _videollama3(seed, **overrides):
    """VideoLLaMA 3's tower: SigLIP's layer names, the images packed in one row as Qwen's (its loop its encoder)."""
    torch.manual_seed(seed)
    config = transformers.VideoLlama3VisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, patch_size=4),
        **overrides})
    return _off_their_init(transformers.VideoLlama3VisionModel(config))


def _minimax(seed, **overrides):
    """MiniMax-M3-VL's tower: SigLIP's layer names, the images in one row of [1, patches, dim] (its layers
    squeeze it for their attention), 3-D rotary embeddings."""
    torch.manual_seed(seed)
    config = transformers.MiniMaxM3VLVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, patch_size=4,
        temporal_patch_size=2, spatial_merge_size=2, image_size=32), **overrides})
    return _off_their_init(transformers.MiniMaxM3VLVisionModel(config))


def _ovis(seed, **overrides):
    """Ovis2.5's tower: SigLIP's layer names, the images packed in one row, a full layer between windowed ones
    (its config's layer_types)."""
    torch.manual_seed(seed)
    config = transformers.Ovis2_5VisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=1, window_size=16, image_size=32,
        layer_types=["window_attention", "full_attention", "window_attention"][:DEPTH]), **overrides})
    return _off_their_init(transformers.Ovis2_5VisionModel(config))


def _cosmos(seed, **overrides):
    """Cosmos3-Edge's tower: SigLIP's layer names, the images packed in one row (its encoder's loop makes their
    boundaries), no rotary embedding."""
    torch.manual_seed(seed)
    config = transformers.Cosmos3EdgeVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, patch_size=4,
        spatial_merge_size=2), **overrides})
    return _off_their_init(transformers.Cosmos3EdgeVisionModel(config))


def _qwen3_tower(kind):
    """A Qwen3-VL-style tower (its blocks' names and loop): Qwen3.5's, Qwen3.5-MoE's and Qwen4-Exp's, and
    Qwen3-Omni's, whose loop reads block 1's output (a deepstack layer)."""
    def make(seed, **overrides):
        import importlib

        module, name = {"qwen3_5": ("qwen3_5", "Qwen3_5Vision"), "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeVision"),
                        "qwen4_exp": ("qwen4_exp", "Qwen4ExpVision"),
                        "qwen3_omni": ("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoder")}[kind]
        configs = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
        models = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        torch.manual_seed(seed)
        options = dict(depth=DEPTH, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=32,
                       num_position_embeddings=64)
        if kind == "qwen3_omni":
            options["deepstack_visual_indexes"] = [1]
        config_class = getattr(configs, f"{name}Config")
        model_class = getattr(models, name if kind == "qwen3_omni" else f"{name}Model")
        return _off_their_init(model_class(config_class(**{**options, **overrides})))
    return make


def _aimv2(seed, **overrides):
    """AIMv2's vision tower: RMS-normed pre-norm layers, a SwiGLU MLP (its ffn)."""
    torch.manual_seed(seed)
    config = transformers.Aimv2VisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=32,
        patch_size=8), **overrides})
    return _off_their_init(transformers.Aimv2VisionModel(config))


def _ovis2(seed, **overrides):
    """Ovis2's vision tower: AIMv2's layers, its loop under transformer.encoder."""
    from transformers.models.ovis2.modeling_ovis2 import Ovis2VisionModel

    torch.manual_seed(seed)
    config = transformers.Ovis2VisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=32,
        patch_size=8, vocab_size=16), **overrides})
    return _off_their_init(Ovis2VisionModel(config))


def _muse_glimmer(seed, **overrides):
    """Muse Glimmer's tower: Qwen's block names, its loop over layers by its config's layer_types (a full layer
    between windowed ones, each kind its own boundaries), the images' patches in one row."""
    from transformers.models.muse_glimmer.modeling_muse_glimmer import MuseGlimmerVisionModel

    torch.manual_seed(seed)
    config = transformers.MuseGlimmerVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, patch_size=4,
        pos_emb_height=4, pos_emb_width=4, max_position_embeddings=16, merge_size=2, patch_temporal=2,
        layer_types=["window_attention", "full_attention", "window_attention"][:DEPTH]), **overrides})
    return _off_their_init(MuseGlimmerVisionModel(config))


def _mllama(seed, **overrides):
    """Llama 3.2 Vision's tower: two encoders, the global one's branches gated (tanh of a learned scalar each),
    the first one's layers 1 and 2 read besides its last (their outputs concatenated to the tower's), tiles of
    9 patches and a class token padded to 16 tokens."""
    torch.manual_seed(seed)
    config = transformers.MllamaVisionConfig(**{**dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_global_layers=2, attention_heads=4,
        image_size=24, patch_size=8, max_num_tiles=2, intermediate_layers_indices=[1, 2], vision_output_dim=3 * 32,
        supported_aspect_ratios=[[1, 1], [1, 2]]), **overrides})
    return _off_their_init(transformers.MllamaVisionModel(config))


def _llama4(seed, **overrides):
    """Llama 4's tower: its layers' attention rotates queries and keys by the tower's complex 2-D frequencies
    (freqs_ci), a class token after each tile's 16 patches; its loop reads outputs[0]."""
    torch.manual_seed(seed)
    config = transformers.Llama4VisionConfig(**{**dict(
        hidden_size=32, intermediate_size=128, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=32,
        patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5),
        **overrides})
    return _off_their_init(transformers.Llama4VisionModel(config))


TOWERS = {"pixtral": _pixtral, "internvl": _internvl, "blip": _blip("Blip"), "blip2": _blip("Blip2"),
          "instructblip": _blip("InstructBlip"), "exaone": _exaone, "janus": _janus, "videollama3": _videollama3,
          "minimax": _minimax, "ovis": _ovis, "cosmos": _cosmos, "mllama": _mllama, "llama4": _llama4,
          "aimv2": _aimv2, "ovis2": _ovis2, "qianfan": _qianfan, "muse_glimmer": _muse_glimmer,
          **{kind: _qwen3_tower(kind) for kind in ("qwen3_5", "qwen3_5_moe", "qwen4_exp", "qwen3_omni")}}
QWEN3_TOWERS = ("qwen3_5", "qwen3_5_moe", "qwen4_exp", "qwen3_omni")


def _loop_layers(model, kind) -> list:
    """The tower's stacks: its loop's layers (Mllama's two encoders')."""
    if kind == "mllama":
        return [model.transformer.layers, model.global_transformer.layers]
    return [{"pixtral": lambda: model.transformer.layers, "internvl": lambda: model.encoder.layer,
             "exaone": lambda: model.blocks, "minimax": lambda: model.layers, "ovis": lambda: model.layers,
             "llama4": lambda: model.model.layers, "ovis2": lambda: model.transformer.encoder.layers,
             "qianfan": lambda: model.layers, "muse_glimmer": lambda: model.layers,
             **{kind: lambda: model.blocks for kind in QWEN3_TOWERS}}.get(
        kind, lambda: model.encoder.layers)()]


def _inputs(kind, seed=0):
    """Two images; Pixtral's of two sizes (32 x 32 and 16 x 32 pixels: 16 and 8 patches in one row, each
    attending to itself under the tower's block-diagonal mask)."""
    generator = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 8, 8], [1, 4, 8]])  # two images' patches in one row: 8 x 8 and 4 x 8 patches
    if kind == "exaone" or kind in QWEN3_TOWERS:
        return dict(hidden_states=torch.randn(64 + 32, 3 * 2 * 4 * 4, generator=generator), grid_thw=grid)
    if kind == "videollama3":
        return dict(pixel_values=torch.randn(64 + 32, 3 * 4 * 4, generator=generator), grid_thw=grid,
                    merge_sizes=torch.tensor([2, 2]))
    if kind in ("minimax", "muse_glimmer"):
        return dict(pixel_values=torch.randn(64 + 32, 3 * 2 * 4 * 4, generator=generator), grid_thw=grid)
    if kind in ("ovis", "cosmos"):
        return dict(pixel_values=torch.randn(64 + 32, 3 * 4 * 4, generator=generator), grid_thw=grid)
    if kind == "mllama":  # two images: one tile (the second masked: padding) and two tiles side by side
        return dict(pixel_values=torch.randn(2, 1, 2, 3, 24, 24, generator=generator),
                    aspect_ratio_ids=torch.tensor([[1], [2]]), aspect_ratio_mask=torch.tensor([[[1, 0]], [[1, 1]]]))
    pixels = torch.randn(2, 3, 32, 32, generator=generator)
    if kind == "pixtral":
        return dict(pixel_values=pixels, image_sizes=torch.tensor([[32, 32], [16, 32]]))
    return dict(pixel_values=pixels)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", sorted(TOWERS))
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_vision_towers_keep_the_librarys_function(kind, preserve, seeded):
    """A preserving conversion keeps the tower's output: Pixtral's and EXAONE 4.5's two images of different
    sizes in one row (EXAONE's windowed blocks each image's windows), InternVL's layer scales on both
    branches, the BLIP towers' qkv attention, Janus's q / k norms; VideoLLaMA 3's and MiniMax-M3-VL's two
    images in one row, SigLIP's layer names (Ovis2.5's windowed layers each image's windows; Cosmos3-Edge's
    without a rotary embedding)."""
    original = TOWERS[kind](seeded)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    assert _stacks(model) == _loop_layers(model, kind)
    inputs = _inputs(kind, seeded)
    with torch.no_grad():
        theirs, ours = original(**inputs), model(**inputs)
    pairs = [(ours.last_hidden_state, theirs.last_hidden_state)]
    if kind == "qwen3_omni":  # its deepstack feature: block 1's output, which the loop reads, merged
        assert len(ours.deepstack_features) == len(theirs.deepstack_features) == 1
        pairs += list(zip(ours.deepstack_features, theirs.deepstack_features))
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * want.abs().max().item())


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")
def test_janus_drops_what_its_mlp_dropouts_drop(seeded):
    """Janus's MLP ends in a dropout: at p = 1 its branch is zero in training, so a preserving
    conversion computes the library's training-mode output; a fused MLP (which has no dropout) would
    not: the half keeps the layer's modules where the MLP's dropouts are on."""
    original = _janus(seeded, hidden_dropout_rate=1.0).train()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).train()
    inputs = _inputs("janus", seeded)
    with torch.no_grad():
        theirs, ours = original(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_vision_towers_train_bitwise_their_twin_save_and_pickle(kind, seeded, tmp_path):
    """An exact training step with their dropouts (a loss on the tower's output) bitwise its
    stored-activation twin's, the layer scales' gradients too; save_pretrained ->
    revtriton.from_pretrained, a pickle and a fresh process give the output back."""
    dropouts = {"internvl": dict(hidden_dropout_prob=0.1, attention_dropout=0.1), "exaone": {}, "minimax": {},
                "muse_glimmer": {},
                "qianfan": dict(hidden_dropout_prob=0.1, attention_dropout=0.1, drop_path_rate=0.2),
                **{tower: {} for tower in QWEN3_TOWERS},
                "janus": dict(hidden_dropout_rate=0.1, attention_dropout=0.1), "mllama": {},
                "llama4": dict(attention_dropout=0.1, projector_dropout=0.1)}.get(
        kind, dict(attention_dropout=0.1))
    model = revify(TOWERS[kind](seeded, **dropouts), exact=True).train()
    inputs = _inputs(kind, seeded)
    assert_exact_step_equals_twin(model, lambda m: m(**inputs).last_hidden_state.square().mean(), seed=seeded)
    if kind in ("internvl", "qianfan"):
        layers = model.encoder.layer if kind == "internvl" else model.layers
        assert all(layer.lambda_1.grad is not None and layer.lambda_2.grad is not None for layer in layers)
    if kind == "mllama":  # the global encoder's gates train with the rest
        assert all(layer.gate_attn.grad is not None and layer.gate_ffn.grad is not None
                   for layer in model.global_transformer.layers)
    assert_round_trips(model, inputs, tmp_path, output="last_hidden_state")


@pytest.mark.parametrize("kind", ["Mistral3", "InternVL", "Llama4"])
def test_vision_language_models_convert_their_tower_and_language_model(kind, seeded):
    """Mistral 3 (Pixtral's tower, a Mistral language model), InternVL (its tower, a Qwen2 language model)
    and Llama 4 (its tower, its mixture-of-experts language model), found part by part: one stack each, no
    part left with a warning."""
    torch.manual_seed(seeded)
    text = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    if kind == "Mistral3":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                      image_size=32, patch_size=8, model_type="pixtral")
        config = transformers.Mistral3Config(vision_config=vision, text_config=dict(text, model_type="mistral"))
    elif kind == "InternVL":
        config = transformers.InternVLConfig(vision_config=dict(hidden_size=32, intermediate_size=64,
                                                                num_hidden_layers=2, num_attention_heads=4,
                                                                image_size=[32, 32], patch_size=[8, 8]),
                                             text_config=dict(text, model_type="qwen2"))
    else:
        config = transformers.Llama4Config(
            vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               image_size=32, patch_size=8, vision_output_dim=32, projector_input_dim=32,
                               projector_output_dim=32, pixel_shuffle_ratio=0.5),
            text_config=dict(text, intermediate_size_mlp=64, num_local_experts=2, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2))
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*left .* as it is")
        revify(model)
    if kind == "Llama4":
        assert _stacks(model) == [model.vision_model.model.layers, model.language_model.model.layers]
        return
    tower = model.model.vision_tower
    assert _stacks(model) == [tower.transformer.layers if kind == "Mistral3" else tower.encoder.layer,
                              model.model.language_model.layers]


def test_blip2_converts_its_tower_and_language_model_and_names_its_q_former(seeded):
    """BLIP-2 found part by part: its vision tower and its OPT language model, one stack each; its
    Q-Former (BERT-like post-norm layers with cross-attention) stays as it is, named in a warning."""
    torch.manual_seed(seeded)
    config = transformers.Blip2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        qformer_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            encoder_hidden_size=32),
        text_config=dict(vocab_size=100, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                         word_embed_proj_dim=32, model_type="opt"),
        num_query_tokens=4)
    model = transformers.Blip2ForConditionalGeneration(config)
    with pytest.warns(UserWarning, match=r"left Blip2ForConditionalGeneration\.qformer as it is"):
        revify(model)
    assert _stacks(model) == [model.vision_model.encoder.layers, model.language_model.model.decoder.layers]


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("output_hidden_states", [False, True])
def test_mllama_reads_its_intermediate_layers_and_leaves_no_stale_state(output_hidden_states, seeded):
    """Mllama's first encoder runs in segments ending at the layers its tower reads (1 and 2 of 3, their
    outputs concatenated to the tower's): the loop's hidden states hold those layers' outputs, the
    library's, and None for the others, which the stack does not keep (a stale tensor would go unseen);
    a config asking for hidden states changes nothing (the loop's are its layers' outputs, not the
    embeddings first as a model's hidden states are)."""
    original = _mllama(seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    original.config.output_hidden_states = model.config.output_hidden_states = output_hidden_states
    inputs = _inputs("mllama", seeded)
    seen = {}
    for name, tower in (("theirs", original), ("ours", model)):
        tower.transformer.register_forward_hook(lambda module, args, out, name=name: seen.__setitem__(name, out))
    with torch.no_grad():
        theirs, ours = original(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    states = seen["ours"].hidden_states
    assert len(states) == DEPTH and states[0] is None
    for i in (1, 2):
        want = seen["theirs"].hidden_states[i]
        torch.testing.assert_close(states[i], want, rtol=0, atol=2e-3 * want.abs().max().item())


def test_mllama_reading_a_layer_its_encoder_lacks_fails_as_the_librarys(seeded):
    """A config whose tower reads a layer past its encoder (the library's defaults on a shallow encoder)
    converts; its tower's forward then fails as the library's does, at the read (no state there)."""
    original = _mllama(seeded, intermediate_layers_indices=[3, 1], vision_output_dim=3 * 32)
    model = revify(copy.deepcopy(original))
    for tower in (original, model):
        with pytest.raises(IndexError):
            tower(**_inputs("mllama", seeded))


def test_mllama_converts_its_tower_and_names_its_cross_attention_language_model(seeded):
    """Llama 3.2 Vision found part by part: its vision tower's two encoders become stacks; its language
    model, LLaMA's layers with cross-attention layers among them, stays as it is, named in a warning
    (before, LLaMA's detector looked at the first layer alone and the conversion failed on a KeyError)."""
    torch.manual_seed(seeded)
    config = transformers.MllamaConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_global_layers=2,
                           attention_heads=4, image_size=24, patch_size=8, max_num_tiles=2,
                           intermediate_layers_indices=[1], vision_output_dim=2 * 32,
                           supported_aspect_ratios=[[1, 1], [1, 2]]),
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1], pad_token_id=0,
                         bos_token_id=1, eos_token_id=2))
    model = transformers.MllamaForConditionalGeneration(config)
    with pytest.warns(UserWarning, match=r"left MllamaForConditionalGeneration\.model\.language_model as it is "
                                         r"\(revify: MllamaCrossAttentionDecoderLayer has parts \['cross_attn'"):
        revify(model)
    vision = model.model.vision_model
    assert _stacks(model) == [vision.transformer.layers, vision.global_transformer.layers]


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_aimv2_converts_both_towers_and_its_text_tower_keeps_its_causal_mask(seeded):
    """Aimv2Model: both towers found part by part, one stack each; the text tower's causal mask with padding
    reaches every layer's attention as the library's loop hands it (its output at the kept tokens is the
    library's)."""
    torch.manual_seed(seeded)
    config = transformers.Aimv2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH,
                         num_attention_heads=4, max_position_embeddings=16, eos_token_id=2),
        projection_dim=16)
    original = transformers.Aimv2Model(config)
    _off_their_init(original)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert _stacks(model) == [model.vision_model.encoder.layers, model.text_model.encoder.layers]
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(seeded))
    mask = torch.tensor([[1] * 12, [1] * 8 + [0] * 4])
    with torch.no_grad():
        theirs = original.text_model(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = model.text_model(input_ids=ids, attention_mask=mask).last_hidden_state
    kept = mask.bool()
    torch.testing.assert_close(ours[kept], theirs[kept], rtol=0, atol=2e-3 * theirs[kept].abs().max().item())


def test_qianfan_halves_drop_their_samples_paths(seeded):
    """Qianfan-OCR's layers drop whole samples' branches (drop_path1 after the attention's layer scale,
    drop_path2 after the MLP's): each layer's halves run its drop-path modules, in training, on what the
    library's layer hands them (an exact twin would not see them left out: it runs the same halves)."""
    model = revify(_qianfan(seeded, drop_path_rate=0.5), exact=True).train()
    called = []
    for i, layer in enumerate(model.layers):
        for name in ("drop_path1", "drop_path2"):
            module = getattr(layer, name)
            if isinstance(module, torch.nn.Identity):  # (layer 0: rate 0)
                continue
            module.register_forward_hook(lambda m, args, out, key=(i, name): called.append(key))
    model(**_inputs("qianfan", seeded)).last_hidden_state.sum().backward()
    assert sorted(set(called)) == [(i, name) for i in range(1, DEPTH) for name in ("drop_path1", "drop_path2")]
