"""The packed audio towers under revify (revtriton/convert/qwen_audio.py): Qwen2.5-Omni's, Qwen3-Omni's and
Qwen3-ASR's, Whisper's layer parts over every audio chunk's frames in one row, each chunk attending to
itself (the loop's cu_seqlens, carried as the conditioning's mask; its longest length as max_seqlen)."""
import copy
import importlib

import pytest
import torch

from revtriton import ReversibleStack
from revtriton.convert import revify

from revified import assert_exact_step_equals_twin, assert_round_trips
from test_revify import DEPTH

transformers = pytest.importorskip("transformers")

# tower -> (transformers module, config class, encoder class)
TOWERS = {"qwen2_5_omni": ("qwen2_5_omni", "Qwen2_5OmniAudioEncoderConfig", "Qwen2_5OmniAudioEncoder"),
          "qwen3_omni": ("qwen3_omni_moe", "Qwen3OmniMoeAudioEncoderConfig", "Qwen3OmniMoeAudioEncoder"),
          "qwen3_asr": ("qwen3_asr", "Qwen3ASREncoderConfig", "Qwen3ASREncoder")}


def _tower(kind, seed, **overrides):
    """A tiny tower (16 mel bins, chunks of 100 frames), its weights off their small init and its norms' off one."""
    module, config_class, encoder_class = TOWERS[kind]
    configs = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    models = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    options = dict(d_model=32, encoder_layers=DEPTH, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16,
                   output_dim=32, downsample_hidden_size=8, conv_chunksize=4)
    config_type = getattr(configs, config_class)
    known = set(config_type().to_dict())
    torch.manual_seed(seed)
    model = getattr(models, encoder_class)(config_type(**{k: v for k, v in {**options, **overrides}.items()
                                                          if k in known}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.eval()


def _inputs(kind, seed):
    """Two clips: 200 and 150 frames (Qwen3-ASR's padded in a batch with its mask; the Omni towers' in one row)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "qwen3_asr":
        mask = torch.ones(2, 200, dtype=torch.long)
        mask[1, 150:] = 0
        return dict(input_features=torch.randn(2, 16, 200, generator=generator), input_features_mask=mask)
    return dict(input_features=torch.randn(16, 350, generator=generator), feature_lens=torch.tensor([200, 150]))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", sorted(TOWERS))
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_packed_audio_towers_keep_the_librarys_function(kind, preserve, seeded):
    original = _tower(kind, seeded)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    assert [m for m in model.modules() if isinstance(m, ReversibleStack)] == [model.layers]
    inputs = _inputs(kind, seeded)
    with torch.no_grad():
        theirs, ours = original(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")
@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_packed_audio_halves_drop_nothing_as_their_layers(kind, seeded):
    """These layers' forward applies no dropout whatever the config's rates (Whisper's own layers do): in
    training the halves drop nothing either, so the output is the library's training-mode output."""
    original = _tower(kind, seeded, dropout=0.5, activation_dropout=0.5).train()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).train()
    inputs = _inputs(kind, seeded)
    with torch.no_grad():
        theirs, ours = original(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_packed_audio_towers_train_bitwise_their_twin_save_and_pickle(kind, seeded, tmp_path):
    model = revify(_tower(kind, seeded, attention_dropout=0.1), exact=True).train()
    inputs = _inputs(kind, seeded)
    assert_exact_step_equals_twin(model, lambda m: m(**inputs).last_hidden_state.square().mean(), seed=seeded)
    assert_round_trips(model, inputs, tmp_path, output="last_hidden_state")
