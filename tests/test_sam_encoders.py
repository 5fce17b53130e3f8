"""The SAM-style image encoders under revify (revtriton/convert/sam.py): SAM's, SAM-HQ's, and the vision
towers built on their layers of GOT-OCR 2, DeepSeek-OCR 2, Unlimited-OCR, PP-FormulaNet (and its mBART decoder, the
bart family's) and SLANeXt.
Streams are grids of patches ([batch, height, width, dim]); the windowed layers pad an 8 x 8 grid to
windows of 3 and put it back, layer 1 attends globally; relative positions in every layer's scores."""
import copy
import importlib
import warnings

import pytest
import torch

from revtriton import ReversibleStack
from revtriton.convert import revify

from revified import assert_exact_step_equals_twin, assert_round_trips
from test_revify import DEPTH

transformers = pytest.importorskip("transformers")

# encoder -> (transformers module, config class, encoder class, config overrides)
ENCODERS = {"sam": ("sam", "SamVisionConfig", "SamVisionEncoder", {}),
            "sam_hq": ("sam_hq", "SamHQVisionConfig", "SamHQVisionEncoder", {}),
            "got_ocr2": ("got_ocr2", "GotOcr2VisionConfig", "GotOcr2VisionEncoder", {}),
            "deepseek_ocr2": ("deepseek_ocr2", "DeepseekOcr2SamVisionConfig", "DeepseekOcr2SamVisionEncoder", {}),
            "unlimited_ocr": ("unlimited_ocr", "UnlimitedOcrSamVisionConfig", "UnlimitedOcrSamVisionEncoder", {}),
            "pp_formulanet": ("pp_formulanet", "PPFormulaNetVisionConfig", "PPFormulaNetVisionModel",
                              dict(post_conv_in_channels=16, post_conv_mid_channels=16, post_conv_out_channels=16)),
            "slanext": ("slanext", "SLANeXtVisionConfig", "SLANeXtVisionEncoder", {})}


def _encoder(kind, seed, **overrides):
    """A tiny encoder, its weights off their small init and its norms' off one (every branch shows)."""
    module, config_class, encoder_class, own = ENCODERS[kind]
    configs = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    models = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    torch.manual_seed(seed)
    config = getattr(configs, config_class)(**{**dict(
        hidden_size=32, output_channels=16, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=64,
        patch_size=8, mlp_dim=64, window_size=3, global_attn_indexes=[1], use_rel_pos=True), **own, **overrides})
    model = getattr(models, encoder_class)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.eval()


def _pixels(seed):
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def _stacks(model):
    return [m for m in model.modules() if isinstance(m, ReversibleStack)]


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", sorted(ENCODERS))
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_sam_style_encoders_keep_the_librarys_function(kind, preserve, seeded):
    """A preserving conversion keeps the encoder's output (its neck's, after the layers): windowed layers whose
    grid is padded to whole windows, a global layer, relative positions."""
    original = _encoder(kind, seeded)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    assert _stacks(model) == [model.layers]
    pixels = _pixels(seeded)
    with torch.no_grad():
        theirs, ours = original(pixel_values=pixels).last_hidden_state, model(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")
def test_sam_hq_reads_its_global_layers_outputs(seeded):
    """SAM-HQ's loop reads the global layers' outputs (its intermediate embeddings): the stack runs in segments
    ending there, so they are the layers' outputs, as the library's (the stand-ins of other layers hand on
    their inputs)."""
    original = _encoder("sam_hq", seeded, global_attn_indexes=[0, 1])
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    pixels = _pixels(seeded)
    with torch.no_grad():
        theirs = original(pixel_values=pixels).intermediate_embeddings
        ours = model(pixel_values=pixels).intermediate_embeddings
    assert len(ours) == len(theirs) == 2
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * want.abs().max().item())


@pytest.mark.parametrize("kind", ["sam", "sam_hq", "got_ocr2"])
def test_sam_style_encoders_train_bitwise_their_twin_save_and_pickle(kind, seeded, tmp_path):
    """An exact training step with attention dropout (a loss on the encoder's output) bitwise its
    stored-activation twin's; save_pretrained -> revtriton.from_pretrained, a pickle and a fresh process
    give the output back."""
    model = revify(_encoder(kind, seeded, attention_dropout=0.1), exact=True).train()
    pixels = _pixels(seeded)
    assert_exact_step_equals_twin(model, lambda m: m(pixel_values=pixels).last_hidden_state.square().mean(),
                                  seed=seeded)
    assert all(layer.attn.rel_pos_h.grad is not None for layer in model.layers)
    assert_round_trips(model, dict(pixel_values=pixels), tmp_path, output="last_hidden_state")


def test_sam_and_got_ocr2_convert_their_encoders_part_by_part(seeded):
    """SamModel converts its vision encoder (its prompt encoder and mask decoder are not repeated layers a
    family takes); GOT-OCR 2 its SAM-style vision tower and its Qwen2 language model, no part left."""
    torch.manual_seed(seeded)
    vision = dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4, image_size=64,
                  patch_size=8, mlp_dim=64, window_size=3, global_attn_indexes=[1])
    sam = transformers.SamModel(transformers.SamConfig(
        vision_config=vision,
        prompt_encoder_config=dict(hidden_size=16, image_size=64, patch_size=8, image_embedding_size=8,
                                   mask_input_channels=4),
        mask_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_dim=32,
                                 iou_head_hidden_dim=16)))
    got = transformers.GotOcr2ForConditionalGeneration(transformers.GotOcr2Config(
        vision_config=vision, text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               model_type="qwen2")))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*left .* as it is")
        revify(sam)
        revify(got)
    assert _stacks(sam) == [sam.vision_encoder.layers]
    assert _stacks(got) == [got.model.vision_tower.layers, got.model.language_model.layers]


def _pp_formulanet(seed, **overrides):
    """PP-FormulaNet: a SAM-style encoder (the sam family's) and mBART's decoder under another class name,
    PPFormulaNetTextModel (the bart family's), cross-attending to the encoder's projected grid."""
    torch.manual_seed(seed)
    config = transformers.PPFormulaNetConfig(
        vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=8, mlp_dim=64, window_size=3, global_attn_indexes=[1],
                           post_conv_in_channels=16, post_conv_mid_channels=16, post_conv_out_channels=32),
        vocab_size=100, d_model=32, decoder_layers=DEPTH, decoder_attention_heads=4, decoder_ffn_dim=64,
        max_position_embeddings=64, decoder_hidden_size=32, **overrides)
    return transformers.PPFormulaNetForConditionalGeneration(config).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")
def test_pp_formulanet_converts_its_encoder_and_its_decoder(seeded, tmp_path):
    """Both stacks found part by part, no part left; a preserving conversion keeps the logits; an exact
    training step with dropout is bitwise its twin's, and it saves, loads and pickles."""
    original = _pp_formulanet(seeded)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*left .* as it is")
        model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert _stacks(model) == [model.model.decoder.layers, model.model.encoder.layers]
    inputs = dict(pixel_values=_pixels(seeded)[:1], decoder_input_ids=torch.randint(3, 100, (1, 7)))
    with torch.no_grad():
        theirs, ours = original(**inputs).logits, model(**inputs).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    model = revify(_pp_formulanet(seeded, dropout=0.1, attention_dropout=0.1), exact=True).train()
    assert_exact_step_equals_twin(model, lambda m: m(**inputs, labels=inputs["decoder_input_ids"]).loss, seed=seeded)
    assert_round_trips(model, inputs, tmp_path)
