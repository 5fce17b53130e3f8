"""The BART lineage's decoders as causal LMs (convert/bart.py): OPT's layer parts and a cross-attention
that runs only with an encoder's states. Pre-norm layers (MBart, Pegasus, Blenderbot, BigBird-Pegasus,
Whisper's decoder) run OPT's halves; post-norm ones (BART, Marian, Blenderbot-Small, TrOCR, MVP, PLBart) convert under
meft1 / meft2, the whole layer one half."""
import pytest
import torch

from revtriton.convert import revify

from test_host_forward import (assert_preserved_on_whole_and_padded_rows, assert_saves_and_pickles,
                               assert_training_logits_are_the_librarys)
from test_postnorm import assert_exact_step_equals_its_twin
from test_revify import DEPTH

transformers = pytest.importorskip("transformers")

PRE_NORM = ["MBart", "Pegasus", "Blenderbot", "BigBirdPegasus", "Whisper"]
POST_NORM = ["Bart", "Marian", "BlenderbotSmall", "TrOCR", "Mvp", "PLBart"]


def bart_lm(kind, seed, **overrides):
    """A tiny ``{kind}ForCausalLM`` with large weights (every branch shows in the logits), no dropout
    unless asked. Its encoder as deep as its decoder: transformers 5.25 sizes the causal LM's cache
    from the encoder's layer count."""
    torch.manual_seed(seed)
    config = dict(vocab_size=128, d_model=64, decoder_layers=DEPTH, decoder_attention_heads=4, decoder_ffn_dim=96,
                  max_position_embeddings=64, pad_token_id=0, init_std=0.3, dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0)
    if kind != "TrOCR":  # (a decoder-only config)
        config.update(encoder_layers=DEPTH, encoder_attention_heads=4, encoder_ffn_dim=96)
    if kind == "BigBirdPegasus":
        config.update(attention_type="original_full")
    config = getattr(transformers, f"{kind}Config")(**{**config, **overrides})
    return getattr(transformers, f"{kind}ForCausalLM")(config).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", PRE_NORM)
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_pre_norm_bart_decoders_keep_the_librarys_function(kind, preserve, seeded):
    """A preserving conversion computes the library's logits on whole and left-padded rows and its
    cached greedy generation; the dropout after the MLP's activation is kept (at p = 1: the library's
    training-mode logits, no random draw deciding them)."""
    assert_preserved_on_whole_and_padded_rows(bart_lm(kind, seeded), preserve)
    assert_training_logits_are_the_librarys(bart_lm(kind, seeded, activation_dropout=1.0), preserve)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", POST_NORM)
@pytest.mark.parametrize("preserve", ["meft1", "meft2"])
def test_post_norm_bart_decoders_keep_the_librarys_function(kind, preserve, seeded):
    """The whole post-norm layer as one half (TrOCR's and MVP's loops read each layer's output as
    ``outputs[0]``): the library's logits on whole and left-padded rows, its cached greedy generation."""
    assert_preserved_on_whole_and_padded_rows(bart_lm(kind, seeded), preserve)


@pytest.mark.parametrize("kind, preserve", [("MBart", None), ("Pegasus", None), ("Blenderbot", None),
                                            ("BigBirdPegasus", None), ("Whisper", None), ("Bart", "meft1"),
                                            ("Marian", "meft2"), ("BlenderbotSmall", "meft1"), ("TrOCR", "meft1"),
                                            ("Mvp", "meft2"), ("PLBart", "meft1")])
def test_bart_decoders_train_bitwise_their_twins(kind, preserve, seeded):
    """An exact training step with the branch and activation dropouts on bitwise equals its
    stored-activation twin (the draws replayed in the rebuild; the unused cross-attention has no
    gradient in either)."""
    model = revify(bart_lm(kind, seeded, dropout=0.1, activation_dropout=0.1), preserve=preserve, exact=True)
    ids = torch.randint(1, 128, (2, 10))
    assert_exact_step_equals_its_twin(model.train(), preserve, seeded, input_ids=ids, labels=ids)


@pytest.mark.parametrize("kind, preserve", [("MBart", None), ("TrOCR", "meft1")])
def test_bart_decoders_save_and_pickle(kind, preserve, seeded, tmp_path):
    """Save / load, a pickle and a fresh process's unpickling give the converted model back, a pre-norm
    one and a post-norm one whose loop reads tuples."""
    model = revify(bart_lm(kind, seeded, dropout=0.1), preserve=preserve, exact=True).train()
    ids = torch.randint(1, 128, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    assert_saves_and_pickles(model, ids, tmp_path)


def test_what_a_bart_decoder_cannot_convert_is_refused_by_name(seeded):
    """Encoder states at call time (the cross-attention), layerdrop, MVP's per-layer prompts, and a
    post-norm decoder under a conversion that couples each branch to a stream are refused, named."""
    model = revify(bart_lm("MBart", seeded))
    ids = torch.randint(1, 128, (2, 6))
    with pytest.raises(NotImplementedError, match="encoder_hidden_states"):
        model(input_ids=ids, encoder_hidden_states=torch.randn(2, 5, 64))
    with pytest.raises(NotImplementedError, match="decoder_layerdrop=0.1"):
        revify(bart_lm("Pegasus", seeded, decoder_layerdrop=0.1))
    with pytest.raises(NotImplementedError, match="use_prompt=True"):
        revify(bart_lm("Mvp", seeded, use_prompt=True, prompt_length=2, prompt_mid_dim=8), preserve="meft1")
    with pytest.raises(NotImplementedError, match="BartForCausalLM has post-norm.*'meft1' or 'meft2'"):
        revify(bart_lm("Bart", seeded))
