"""Vision-language models under revify: no family takes LLaVA, PaliGemma, Gemma 3, Idefics 3 or SmolVLM
whole, but their vision tower (CLIP, SigLIP) and language model (LLaMA, Gemma by their class; Gemma
3's by its layers) are each converted by theirs, each a reversible stack of its own, and the model's
own forward (image features spliced into the token embeddings, PaliGemma's prefix mask) and generate
run over them."""
import copy
import warnings

import pytest
import torch

from revtriton import from_pretrained, ReversibleStack
from revtriton.convert import revify

from revified import (assert_exact_step_equals_twin, assert_greedy_tokens_are_the_librarys, assert_round_trips,
                      assert_seq2seq_step_equals_its_twin)

transformers = pytest.importorskip("transformers")

DEPTH = 3
IMAGE_TOKENS = 16  # 32 x 32 pixels in 8 x 8 patches
IMAGE_ID = 127
KINDS = ("llava", "paligemma", "gemma3", "idefics2", "idefics3", "smolvlm")


def _model(kind, seed):
    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, eos_token_id=None, initializer_range=0.3)
    if kind == "llava":
        config = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**vision).to_dict(),
                                          text_config=transformers.LlamaConfig(**text).to_dict(),
                                          image_token_index=IMAGE_ID)
        return transformers.LlavaForConditionalGeneration(config).eval()
    if kind == "idefics2":  # a SigLIP tower of its own, a perceiver resampler of 4 latents an image, Mistral
        config = transformers.Idefics2Config(
            vision_config=vision, text_config=transformers.MistralConfig(**text).to_dict(), image_token_id=IMAGE_ID,
            perceiver_config=dict(resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2, resampler_head_dim=8,
                                  num_key_value_heads=1))
        return transformers.Idefics2ForConditionalGeneration(config).eval()
    if kind in ("idefics3", "smolvlm"):  # a SigLIP tower of their own, 16 patches pooled to 4 tokens
        prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[kind]
        config = getattr(transformers, f"{prefix}Config")(
            vision_config=getattr(transformers, f"{prefix}VisionConfig")(**vision).to_dict(),
            text_config=transformers.LlamaConfig(**text).to_dict(), image_token_id=IMAGE_ID, scale_factor=2)
        return getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    if kind == "gemma3":  # its text model: Gemma 3's sandwich-norm layers, found by their conventions
        config = transformers.Gemma3Config(vision_config=transformers.SiglipVisionConfig(**vision).to_dict(),
                                           text_config=transformers.Gemma3TextConfig(**text, head_dim=8).to_dict(),
                                           mm_tokens_per_image=4, image_token_index=IMAGE_ID, boi_token_index=125,
                                           eoi_token_index=126)
        return transformers.Gemma3ForConditionalGeneration(config).eval()
    config = transformers.PaliGemmaConfig(vision_config=transformers.SiglipVisionConfig(**vision).to_dict(),
                                          text_config=transformers.GemmaConfig(**text, head_dim=8).to_dict(),
                                          image_token_index=IMAGE_ID, projection_dim=32)
    return transformers.PaliGemmaForConditionalGeneration(config).eval()


def _inputs(kind):
    """Two samples of the image's tokens then text (PaliGemma: a 2-token prompt seen both ways, then
    the suffix causally)."""
    pooled = kind in ("gemma3", "idefics2", "idefics3", "smolvlm")  # the 16 patches pooled (resampled) to 4 tokens
    image = 4 if pooled else IMAGE_TOKENS
    ids = torch.randint(1, 120, (2, image + 6))
    ids[:, :image] = IMAGE_ID
    pixels = torch.randn(2, 1, 3, 32, 32) if kind in ("idefics2", "idefics3", "smolvlm") else torch.randn(2, 3, 32, 32)
    inputs = dict(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids))
    if kind in ("paligemma", "gemma3"):  # (Gemma 3: the image's tokens see each other both ways)
        inputs["token_type_ids"] = (ids == IMAGE_ID).long() if kind == "gemma3" else (
            torch.arange(ids.shape[1]) >= IMAGE_TOKENS + 2).long().expand(2, -1)
    return inputs


def _stacks(model):
    return [m for m in model.modules() if isinstance(m, ReversibleStack)]


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", KINDS)
def test_a_preserving_conversion_keeps_the_vision_language_models_function(kind, seeded):
    """meft3 converts the vision tower and the language model, each a stack, and keeps the logits and
    the language model's hidden states."""
    original = _model(kind, seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    inner = model.model
    towers = ((inner.vision_model.encoder.layers, inner.text_model.layers) if hasattr(inner, "vision_model") else
              (inner.vision_tower.encoder.layers, inner.language_model.layers))
    assert _stacks(model) == list(towers)
    inputs = _inputs(kind)
    with torch.no_grad():
        theirs, ours = original(**inputs).logits, model(**inputs).logits
        # The language model's hidden states too: the model's own output capture must not record what
        # the stack's blocks return (it hooks every module of the layer class, the swapped ones too)
        theirs_states = original(**inputs, output_hidden_states=True, use_cache=False).hidden_states
        ours_states = model(**inputs, output_hidden_states=True, use_cache=False).hidden_states
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    assert len(ours_states) == len(theirs_states) == DEPTH + 1
    for got, expected in zip(ours_states, theirs_states):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-3 * expected.abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
def test_vision_language_models_train_bitwise_their_twin_save_and_pickle(kind, seeded, tmp_path):
    """The library's loss on the text (labels): an exact training step's loss and gradients are bitwise
    the stored-activation twin's, both towers' layers included; then save_pretrained ->
    revtriton.from_pretrained (both towers converted again), a pickle and a fresh process give the
    logits."""
    model = revify(_model(kind, seeded), exact=True).train()
    inputs = _inputs(kind)
    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] == IMAGE_ID, -100)
    assert_exact_step_equals_twin(model, lambda m: m(**inputs, labels=labels).loss)
    # Every layer trains but the vision tower's last in LLaVA, whose features are the one before it.
    unused = f"vision_tower.encoder.layers.{DEPTH - 1}." if kind == "llava" else None
    layers = {name: p for name, p in model.named_parameters() if ".layers." in name}
    assert layers and all((p.grad is None) == (unused is not None and unused in name) for name, p in layers.items())
    assert len(_stacks(assert_round_trips(model, inputs, tmp_path))) == 2


def test_llava_generates_as_the_library(seeded):
    """Greedy generation with the cache (the language model decoding under no_grad) gives the
    library's tokens after a preserving conversion."""
    original = _model("llava", seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    inputs = _inputs("llava")
    ours = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert torch.equal(ours, original.generate(**inputs, max_new_tokens=5, do_sample=False))


def test_a_model_with_no_convertible_part_still_raises_naming_its_layers():
    """No family takes the model nor any of its sub-models: the error names its layers, as before."""
    with pytest.raises(TypeError, match=r"its layers \(1: 3 x Linear"):
        revify(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList(
            [torch.nn.Linear(2, 2) for _ in range(3)])))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_a_preserving_conversions_adapters_load_under_the_names_the_library_saves(seeded, tmp_path):
    """Transformers saves LLaVA's weights under its older names (``language_model.model.*``), the
    preserving adapters inside them too: revtriton.from_pretrained finds every one (trained, not zero)."""
    model = revify(_model("llava", seeded), preserve="meft3", exact=True)
    adapters = [p for name, p in model.named_parameters() if "revtriton_adapters" in name]
    assert adapters
    with torch.no_grad():
        for p in adapters:
            p.normal_(0.0, 0.1)
    model.eval().save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path).eval()
    inputs = _inputs("llava")
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


def test_a_training_steps_memory_stays_flat_in_both_towers_depth(seeded):
    """PaliGemma with 4 and 8 layers in each tower (64 image tokens, 32 of text, batch 4): the
    converted model's step peak past its parameter gradients does not grow with depth, where the
    unconverted model's nearly doubles (measured: 1.00x against 1.93x)."""
    from revtriton.profiling import peak_memory

    g = torch.Generator().manual_seed(seeded)
    ids = torch.randint(1, 120, (4, 96), generator=g)
    ids[:, :64] = IMAGE_ID
    inputs = dict(input_ids=ids, pixel_values=torch.randn(4, 3, 64, 64, generator=g),
                  attention_mask=torch.ones_like(ids), token_type_ids=(torch.arange(96) >= 66).long().expand(4, -1),
                  labels=ids.masked_fill(ids == IMAGE_ID, -100))

    def step_peak(depth, convert):
        torch.manual_seed(seeded)
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=depth, num_attention_heads=4,
                      image_size=64, patch_size=8)
        text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=depth,
                    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None, head_dim=16)
        model = transformers.PaliGemmaForConditionalGeneration(transformers.PaliGemmaConfig(
            vision_config=transformers.SiglipVisionConfig(**vision).to_dict(),
            text_config=transformers.GemmaConfig(**text).to_dict(), image_token_index=IMAGE_ID, projection_dim=64))
        model = (revify(model) if convert else model).train()
        model(**inputs).loss.backward()  # the .grad buffers exist from here on
        return peak_memory(lambda: model(**inputs).loss.backward())

    assert step_peak(8, True) <= 1.25 * step_peak(4, True)
    assert step_peak(8, False) >= 1.5 * step_peak(4, False)  # what the reversible stacks remove


def test_lora_on_both_towers_in_either_order(seeded):
    """PEFT's LoRA on the attention projections of both towers, before or after revify: the same loss,
    and every LoRA weight trains but those of LLaVA's last vision layer (its features are the one
    before it)."""
    peft = pytest.importorskip("peft")
    inputs = _inputs("llava")
    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] == IMAGE_ID, -100)
    losses = []
    for peft_first in (True, False):
        model, config = _model("llava", seeded), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        model = revify(peft.get_peft_model(model, config)) if peft_first else peft.get_peft_model(revify(model), config)
        assert len(_stacks(model)) == 2
        losses.append(model.train()(**inputs, labels=labels).loss)
        losses[-1].backward()
        lora = {name: p for name, p in model.named_parameters() if "lora_" in name}
        unused = f"vision_tower.encoder.layers.{DEPTH - 1}."
        assert lora and all((p.grad is None) == (unused in name) for name, p in lora.items())
    assert torch.equal(*losses)


def _qwen2_vl(seed, version="2"):
    """Qwen2-VL / Qwen2.5-VL: its own vision transformer (the qwen_vision family's: the images' patches in
    one row, Qwen2.5-VL's windowed blocks beside its full ones) and a text model with LLaMA's layer parts
    and multimodal RoPE (a temporal, height and width position a token)."""
    torch.manual_seed(seed)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, head_dim=8,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=2, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                  in_channels=3)
    if version == "2":
        vision.update(embed_dim=32)
        classes = transformers.Qwen2VLForConditionalGeneration, transformers.Qwen2VLConfig
    else:  # Qwen2.5-VL: windowed attention in its vision transformer
        vision.update(out_hidden_size=32, intermediate_size=64, fullatt_block_indexes=[1], window_size=16)
        classes = transformers.Qwen2_5_VLForConditionalGeneration, transformers.Qwen2_5_VLConfig
    model = classes[0](classes[1](vision_config=vision, text_config=text, image_token_id=IMAGE_ID,
                                  vision_start_token_id=125, vision_end_token_id=126))
    with torch.no_grad():  # weights off their small init: the image's positions show in the logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval()


def _qwen2_vl_inputs():
    """One image of 8 x 8 patches (16 tokens once merged) inside 24 tokens."""
    ids = torch.randint(1, 120, (1, 24))
    ids[0, 2], ids[0, 3:19], ids[0, 19] = 125, IMAGE_ID, 126
    return dict(input_ids=ids, pixel_values=torch.randn(64, 3 * 2 * 4 * 4), image_grid_thw=torch.tensor([[1, 8, 8]]),
                attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE_ID).long())


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("version", ["2", "2.5"])
def test_qwen2_vl_converts_its_language_model_with_multimodal_rope(version, seeded, tmp_path):
    """Qwen2-VL's text model (its loop: ``for i, layer in enumerate(self.layers)``) and vision tower
    convert; its multimodal RoPE (the image's tokens at 2-D positions) runs on the model's rotary
    embedding, so a preserving conversion keeps the logits, an exact training step is bitwise its
    twin's, and it saves, loads and pickles (its swapped classes found by name in a fresh process)."""
    original = _qwen2_vl(seeded, version)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert _stacks(model) == [model.model.visual.blocks, model.model.language_model.layers]
    assert all(layer._revtriton_spec.library_rope for layer in model.model.language_model.layers)
    inputs = _qwen2_vl_inputs()
    with torch.no_grad():
        theirs, ours = original(**inputs).logits, model(**inputs).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())

    model = revify(copy.deepcopy(original), exact=True).train()
    assert_exact_step_equals_twin(model, lambda m: m(**inputs, labels=inputs["input_ids"]).loss)
    assert_round_trips(model, inputs, tmp_path)


def _image_captioner(seed):
    """A ViT encoder and a GPT-2 decoder that cross-attends to it (VisionEncoderDecoderModel)."""
    torch.manual_seed(seed)
    encoder = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH,
                                     num_attention_heads=4, image_size=32, patch_size=8)
    decoder = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, add_cross_attention=True,
                                      is_decoder=True, initializer_range=0.3)
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = config.pad_token_id = 0
    return transformers.VisionEncoderDecoderModel(config).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_an_image_captioner_converts_its_encoder_and_its_cross_attending_decoder(seeded):
    """An image captioner: the ViT encoder and the GPT-2 decoder that cross-attends to it (its halves
    read the encoder's states through the conditioning; the fused kernels where no states are given)
    both convert. The preserving conversion keeps the logits and greedy generation with the library's
    cache; an exact step against its twin: the decoder's gradients bitwise, the encoder's within float
    rounding (the cross-attention's contributions summed in another order). (A part its family
    refuses stays as it is with a warning: tests/test_bart.py, layerdrop in one stack.)"""
    original = _image_captioner(seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert _stacks(model) == [model.encoder.layers, model.decoder.transformer.h]
    inputs = dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.randint(1, 100, (2, 6)))
    with torch.no_grad():
        theirs, ours = original(**inputs).logits, model(**inputs).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    pixels = dict(pixel_values=inputs["pixel_values"])
    assert_greedy_tokens_are_the_librarys(original, model.generate(**pixels, max_new_tokens=5, do_sample=False),
                                          original.generate(**pixels, max_new_tokens=5, do_sample=False),
                                          source=pixels)
    model = revify(copy.deepcopy(original), exact=True).train()
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs).loss, seed=seeded, encoder_side=("encoder.",))


def test_when_every_part_is_refused_the_refusal_is_raised():
    """BERT's post-norm layers under revify(model) (no preserving mode), as both halves of an
    encoder-decoder: nothing converts, and the first refusal is raised as it would be alone."""
    encoder = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=100)
    decoder = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=100, is_decoder=True, add_cross_attention=True)
    model = transformers.EncoderDecoderModel(
        transformers.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder))
    with pytest.raises(NotImplementedError, match="post-norm"):
        revify(model)
    assert not _stacks(model)


def test_a_causal_lm_inside_a_model_of_ones_own_converts_with_its_fused_loss(seeded):
    """A user's module around a Hugging Face causal LM (and a head of its own): revify converts the
    LM, and the LM trained with labels computes its loss through the fused head (no logits), as it
    would converted alone."""
    torch.manual_seed(seeded)

    class Scorer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4,
                                                                           vocab_size=100))
            self.score = torch.nn.Linear(32, 1)

    model = revify(Scorer(), exact=True).train()
    assert _stacks(model) == [model.lm.transformer.h]
    ids = torch.randint(0, 100, (2, 8))
    out = model.lm(input_ids=ids, labels=ids)
    assert out.logits is None and torch.isfinite(out.loss)
    out.loss.backward()


def test_a_part_that_nearly_has_a_familys_layers_stays_as_it_is(seeded):
    """Gemma 3 with a part its text layers do not have in the library (a near miss of the families'
    layer conventions, whose detector names it): the vision tower converts, the text model stays as it
    is with a warning naming the parts; before, the detector's refusal stopped the whole conversion."""
    model = _model("gemma3", seeded)
    for layer in model.model.language_model.layers:
        layer.extra_norm = torch.nn.Identity()
    left = r"left Gemma3ForConditionalGeneration\.model\.language_model as it is .*extra_norm"
    with pytest.warns(UserWarning, match=left):
        revify(model)
    assert _stacks(model) == [model.model.vision_tower.encoder.layers]


def test_a_library_part_no_family_takes_is_named_when_the_others_convert(seeded):
    """A model of two library parts, one a family converts (GPT-2) and one no family takes (Mamba's
    layers, as LFM2-VL's hybrid language model beside its SigLIP): the first converts, and the other
    is named in a warning with its layers (before, it stayed as it is without a word); a model whose
    parts all convert warns nothing of the kind."""
    torch.manual_seed(seeded)

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4,
                                                                           vocab_size=100))
            self.ssm = transformers.MambaModel(transformers.MambaConfig(vocab_size=100, hidden_size=32,
                                                                        num_hidden_layers=2, state_size=4))

    model = Pair()
    with pytest.warns(UserWarning, match=r"left Pair\.ssm as it is \(no family converts MambaModel: its layers "
                                         r"\(layers: 2 x MambaBlock"):
        revify(model)
    assert _stacks(model) == [model.lm.transformer.h]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*left .* as it is")
        revify(_model("llava", seeded))


def _qwen2_vl_two_images():
    """Two images in one row of patches (8 x 8 and 4 x 8 patches: 16 and 8 tokens once merged), each
    attending to itself only (the tower's cu_seqlens), inside one 32-token sequence."""
    ids = torch.randint(1, 120, (1, 32))
    ids[0, 1], ids[0, 2:18], ids[0, 18] = 125, IMAGE_ID, 126
    ids[0, 20], ids[0, 21:29], ids[0, 29] = 125, IMAGE_ID, 126
    return dict(input_ids=ids, pixel_values=torch.randn(64 + 32, 3 * 2 * 4 * 4),
                image_grid_thw=torch.tensor([[1, 8, 8], [1, 4, 8]]), attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == IMAGE_ID).long())


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("version", ["2", "2.5"])
def test_qwen2_vl_vision_towers_keep_the_librarys_function(version, seeded):
    """The vision towers under a preserving conversion: two images of different sizes packed in one row,
    each attending to itself (Qwen2.5-VL's windowed blocks to their windows: the other attention kind,
    with its own boundaries and longest length in the conditioning); the logits within the coupling's
    term of the library's, and the tower's output too. Each block's attention gets the boundaries and
    the longest length (what flash attention reads; given precomputed here) the library's loop gives it."""
    original = _qwen2_vl(seeded, version)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    windows = [block._revtriton_spec.window is not None for block in model.model.visual.blocks]
    assert windows == ([False, False] if version == "2" else [True, False])  # (fullatt_block_indexes=[1])
    inputs = _qwen2_vl_two_images()
    with torch.no_grad():
        theirs, ours = original(**inputs).logits, model(**inputs).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
        pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
        seen = {}
        for name, tower in (("theirs", original.model.visual), ("ours", model.model.visual)):
            seen[name] = []
            hooks = [block.attn.register_forward_pre_hook(
                lambda module, args, kwargs, calls=seen[name]: calls.append(
                    (kwargs["cu_seqlens"].tolist(), kwargs["max_seqlen"])), with_kwargs=True)
                for block in tower.blocks]
            out = tower(pixels, grid_thw=grid, max_seqlen=64, max_window_seqlen=4).last_hidden_state
            for hook in hooks:
                hook.remove()
            seen[name + " out"] = out
        torch.testing.assert_close(seen["ours out"], seen["theirs out"], rtol=0,
                                   atol=2e-3 * seen["theirs out"].abs().max().item())
        assert seen["ours"] == seen["theirs"] and {length for _, length in seen["ours"]} == (
            {64} if version == "2" else {64, 4})


def _qwen3_vl(seed):
    """Qwen3-VL: its vision tower (blocks 1 and 2 of 4 read by the loop: the deepstack layers, whose merged
    outputs the language model adds to its first two layers' outputs at the image's tokens) and a text
    model with LLaMA's layer parts, interleaved multimodal RoPE."""
    torch.manual_seed(seed)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, head_dim=8,
                rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True})
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3, out_hidden_size=32, deepstack_visual_indexes=[1, 2],
                  num_position_embeddings=64)
    config = transformers.Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_ID,
                                        vision_start_token_id=125, vision_end_token_id=126)
    model = transformers.Qwen3VLForConditionalGeneration(config)
    with torch.no_grad():  # weights off their small init: the images show in the logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")
def test_qwen3_vl_converts_its_tower_and_language_model_with_deepstack(seeded, tmp_path):
    """Qwen3-VL: its vision tower runs in segments ending at the deepstack layers (the loop reads their
    outputs), its language model too where the loop adds the deepstack features (the streams start
    again from the sum); a preserving conversion keeps the tower's outputs (deepstack features
    included), the logits on two images and the cached greedy generation; an exact training step is
    bitwise its twin's, and it saves, loads and pickles."""
    original = _qwen3_vl(seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert _stacks(model) == [model.model.visual.blocks, model.model.language_model.layers]
    inputs = _qwen2_vl_two_images()
    with torch.no_grad():
        pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
        theirs, ours = original.model.visual(pixels, grid_thw=grid), model.model.visual(pixels, grid_thw=grid)
        for got, expected in zip([ours.last_hidden_state, ours.pooler_output, *ours.deepstack_features],
                                 [theirs.last_hidden_state, theirs.pooler_output, *theirs.deepstack_features]):
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-3 * expected.abs().max().item())
        assert len(ours.deepstack_features) == 2
        theirs, ours = original(**inputs).logits, model(**inputs).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    prompt = {**inputs, "input_ids": inputs["input_ids"][:, :30], "attention_mask": inputs["attention_mask"][:, :30],
              "mm_token_type_ids": inputs["mm_token_type_ids"][:, :30]}
    assert_greedy_tokens_are_the_librarys(original, model.generate(**prompt, max_new_tokens=4, do_sample=False),
                                          original.generate(**prompt, max_new_tokens=4, do_sample=False),
                                          source=prompt)

    model = revify(copy.deepcopy(original), exact=True).train()
    assert_exact_step_equals_twin(model, lambda m: m(**inputs, labels=inputs["input_ids"]).loss)
    assert_round_trips(model, inputs, tmp_path)
