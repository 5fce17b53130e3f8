"""Whisper under revify: its audio encoder (revtriton/convert/whisper.py) and its decoder (the BART
lineage's, revtriton/convert/bart.py: its cross-attention reads the encoder's states through the
conditioning; its cache while decoding) reversible stacks run through the library's own forward."""
import copy
import warnings

import pytest
import torch

from revtriton import ReversibleStack
from revtriton.convert import revify

from revified import (assert_exact_step_equals_twin, assert_greedy_tokens_are_the_librarys, assert_round_trips,
                      assert_seq2seq_step_equals_its_twin)

transformers = pytest.importorskip("transformers")

DEPTH = 3
FRAMES = 32  # mel frames: 16 encoder positions after the stride-2 convolution


def _whisper(seed, head="ForConditionalGeneration", **overrides):
    torch.manual_seed(seed)
    config = dict(vocab_size=100, d_model=32, encoder_layers=DEPTH, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=1, bos_token_id=0,
                  eos_token_id=2, decoder_start_token_id=0, max_source_positions=FRAMES // 2, max_target_positions=32,
                  num_mel_bins=8, suppress_tokens=None, begin_suppress_tokens=None, num_labels=3)
    model = getattr(transformers, f"Whisper{head}")(transformers.WhisperConfig(**{**config, **overrides}))
    with torch.no_grad():  # weights off their small init: every branch shows in the outputs
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval()


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return dict(input_features=torch.randn(2, 8, FRAMES, generator=generator),
                decoder_input_ids=torch.randint(3, 100, (2, 5), generator=generator))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_a_preserving_conversion_keeps_whispers_function(seeded):
    """meft3 converts the encoder and the decoder (two stacks) and keeps the logits and every hidden
    state of both (the encoder's last one after the final layer norm, as the library's); greedy
    generation (the library's cache, the cross-attention's keys and values computed once) is the
    library's but where its own logits tie within the coupling's term."""
    original = _whisper(seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    stacks = [model.model.encoder.layers, model.model.decoder.layers]
    assert [m for m in model.modules() if isinstance(m, ReversibleStack)] == stacks
    inputs = _inputs(seeded)
    with torch.no_grad():
        theirs = original(**inputs, output_hidden_states=True)
        ours = model(**inputs, output_hidden_states=True)
    for got, expected in zip([ours.logits, *ours.encoder_hidden_states, *ours.decoder_hidden_states],
                             [theirs.logits, *theirs.encoder_hidden_states, *theirs.decoder_hidden_states]):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-3 * expected.abs().max().item())
    assert len(ours.encoder_hidden_states) == DEPTH + 1 and len(ours.decoder_hidden_states) == 3
    features = inputs["input_features"]
    assert_greedy_tokens_are_the_librarys(original, model.generate(features, max_new_tokens=4),
                                          original.generate(features, max_new_tokens=4),
                                          source=dict(input_features=features))


def test_whisper_trains_bitwise_its_twin_saves_and_pickles(seeded, tmp_path):
    """The library's loss on the transcript: an exact training step's loss and the decoder's gradients
    bitwise the stored-activation twin's, the encoder's within float rounding (the cross-attention's
    contributions to the encoder's states summed in another order); save_pretrained ->
    revtriton.from_pretrained, a pickle and a fresh process give the logits."""
    model = revify(_whisper(seeded), exact=True).train()
    inputs = _inputs(seeded)
    labels = inputs.pop("decoder_input_ids")
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=labels).loss)
    assert all(p.grad is not None for name, p in model.named_parameters() if "encoder.layers." in name)
    assert_round_trips(model, _inputs(seeded), tmp_path)


def test_the_fused_kernels_run_the_encoders_halves(seeded):
    """Without dropout, a training step runs neither the library's attention module nor its MLP
    layers in the encoder (the attention's key projection has no bias: a zero one), and its gradients
    are those of the layers' own modules (float64: up to its rounding)."""
    model = revify(_whisper(seeded, dropout=0.0, attention_dropout=0.0), exact=False).double().train()
    calls = {"self_attn": 0, "fc1": 0}

    def counter(name):
        def count(*_):
            calls[name] += 1
        return count

    for layer in model.model.encoder.layers:
        for name in calls:
            getattr(layer, name).register_forward_pre_hook(counter(name))
    inputs = _inputs(seeded)
    inputs["input_features"] = inputs["input_features"].double()

    def step():
        model.zero_grad(set_to_none=True)
        loss = model.model.encoder(inputs["input_features"]).last_hidden_state.square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step()
    assert calls == {"self_attn": 0, "fc1": 0}
    for layer in model.model.encoder.layers:
        layer._revtriton_spec.fused_attention, layer._revtriton_spec.activation = False, None
    module_loss, module_grads = step()
    assert calls == {"self_attn": 2 * DEPTH, "fc1": 2 * DEPTH}  # the forward and the rebuild
    torch.testing.assert_close(loss, module_loss, rtol=1e-12, atol=0)
    assert grads.keys() == module_grads.keys()
    scale = max(g.abs().max().item() for g in module_grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, module_grads[name], rtol=0, atol=1e-10 * scale, msg=name)


def test_encoder_layerdrop_is_refused_naming_it():
    """Layerdrop in the encoder: it stays as it is, with a warning naming it, and the decoder converts;
    in both stacks, revify raises and converts nothing."""
    with pytest.warns(UserWarning, match="encoder_layerdrop=0.1"):
        model = revify(_whisper(0, encoder_layerdrop=0.1))
    assert [m for m in model.modules() if isinstance(m, ReversibleStack)] == [model.model.decoder.layers]
    model = _whisper(0, encoder_layerdrop=0.1, decoder_layerdrop=0.1)
    with pytest.raises(NotImplementedError, match="layerdrop=0.1"):
        revify(model)
    assert not [m for m in model.modules() if isinstance(m, ReversibleStack)]


def test_the_audio_classifier_converts_its_encoder(seeded):
    model = revify(_whisper(seeded, head="ForAudioClassification"), exact=True).train()
    assert isinstance(model.encoder.layers, ReversibleStack)
    model(input_features=_inputs(seeded)["input_features"], labels=torch.tensor([0, 2])).loss.backward()
    assert model.encoder.layers[0].fc1.weight.grad is not None


# The audio towers with Whisper's layers (the audio-language models' encoders): (class, its config class)
AUDIO_TOWERS = {"Qwen2AudioEncoder": "Qwen2AudioEncoderConfig", "VoxtralEncoder": "VoxtralEncoderConfig",
                "AudioFlamingo3Encoder": "AudioFlamingo3EncoderConfig"}


def _audio_tower(name, seed, **overrides):
    torch.manual_seed(seed)
    config = getattr(transformers, AUDIO_TOWERS[name])(**{**dict(
        d_model=32, encoder_layers=DEPTH, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=FRAMES // 2), **overrides})
    model = getattr(transformers, name)(config)
    with torch.no_grad():  # weights off their small init: every branch shows in the outputs
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval()


def _audio_inputs(name, seed=0):
    """Two clips of mel features; Audio Flamingo 3's encoder takes their frames' mask (the second clip
    padded past 3 / 4 of its frames)."""
    features = torch.randn(2, 8, FRAMES, generator=torch.Generator().manual_seed(seed))
    if name != "AudioFlamingo3Encoder":
        return dict(input_features=features)
    mask = torch.ones(2, FRAMES, dtype=torch.long)
    mask[1, 3 * FRAMES // 4:] = 0
    return dict(input_features=features, input_features_mask=mask)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("name", sorted(AUDIO_TOWERS))
def test_audio_towers_with_whispers_layers_keep_the_librarys_function(name, seeded):
    """Qwen2-Audio's, Voxtral's and Audio Flamingo 3's audio towers (their key projections without a
    bias, as Whisper's): a preserving conversion keeps their output (Audio Flamingo 3's with its padded
    frames masked); the fused kernels run their halves as Whisper's."""
    original = _audio_tower(name, seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert [m for m in model.modules() if isinstance(m, ReversibleStack)] == [model.layers]
    assert model.layers[0]._revtriton_spec.fused_attention
    inputs = _audio_inputs(name, seeded)
    with torch.no_grad():
        theirs, ours = original(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


@pytest.mark.parametrize("name", sorted(AUDIO_TOWERS))
def test_audio_towers_with_whispers_layers_train_bitwise_their_twin_save_and_pickle(name, seeded, tmp_path):
    """An exact training step with their dropouts (a loss on the tower's output) bitwise its
    stored-activation twin's; save_pretrained -> revtriton.from_pretrained, a pickle and a fresh
    process give the output back."""
    model = revify(_audio_tower(name, seeded, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1),
                   exact=True).train()
    inputs = _audio_inputs(name, seeded)
    assert_exact_step_equals_twin(model, lambda m: m(**inputs).last_hidden_state.square().mean(), seed=seeded)
    assert_round_trips(model, inputs, tmp_path, output="last_hidden_state")


def test_an_audio_language_model_converts_its_audio_tower_and_its_language_model(seeded):
    """Qwen2-Audio found part by part: its Whisper-style audio tower and its Qwen2 language model, one
    stack each, and no part left with a warning."""
    torch.manual_seed(seeded)
    config = transformers.Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=8,
                          max_source_positions=FRAMES // 2),
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2))
    model = transformers.Qwen2AudioForConditionalGeneration(config)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*left .* as it is")
        revify(model)
    assert [m for m in model.modules() if isinstance(m, ReversibleStack)] == [
        model.model.audio_tower.layers, model.model.language_model.layers]
