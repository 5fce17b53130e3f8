"""The BART lineage under revify (convert/bart.py): its decoders as causal LMs (given an encoder's
states or not) and both stacks of its seq2seq models. OPT's layer parts, and a decoder's cross-attention
(run when the model is given an encoder's states). Pre-norm layers (MBart, Pegasus, Blenderbot,
BigBird-Pegasus, M2M100, Whisper's decoder) run OPT's halves, a decoder's F its self- then its
cross-attention; post-norm ones (BART, Marian, Blenderbot-Small, TrOCR, MVP, PLBart) convert under
meft1 / meft2, the whole layer one half."""
import copy

import pytest
import torch

from revtriton.convert import revify
from revtriton.models import to_stored_activations

from revified import (assert_greedy_tokens_are_the_librarys, assert_round_trips,
                      assert_seq2seq_keeps_the_librarys_function, assert_seq2seq_memory_flat_in_depth,
                      assert_seq2seq_step_equals_its_twin, seq2seq_batch)
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
    """Layerdrop, MVP's per-layer prompts, and a post-norm decoder under a conversion that couples each
    branch to a stream are refused, named."""
    with pytest.raises(NotImplementedError, match="decoder_layerdrop=0.1"):
        revify(bart_lm("Pegasus", seeded, decoder_layerdrop=0.1))
    with pytest.raises(NotImplementedError, match="use_prompt=True"):
        revify(bart_lm("Mvp", seeded, use_prompt=True, prompt_length=2, prompt_mid_dim=8), preserve="meft1")
    with pytest.raises(NotImplementedError, match="BartForCausalLM has post-norm.*'meft1' or 'meft2'"):
        revify(bart_lm("Bart", seeded))


# (kind, the seq2seq model class's suffix, whether the layers are pre-norm)
SEQ2SEQ = [("Bart", "ForConditionalGeneration", False), ("MBart", "ForConditionalGeneration", True),
           ("Pegasus", "ForConditionalGeneration", True), ("Marian", "MTModel", False),
           ("Blenderbot", "ForConditionalGeneration", True), ("BlenderbotSmall", "ForConditionalGeneration", False),
           ("PLBart", "ForConditionalGeneration", False), ("M2M100", "ForConditionalGeneration", True)]


def seq2seq(kind, head, seed, **overrides):
    """A tiny seq2seq model of the BART lineage, large weights, no dropout or layerdrop unless asked."""
    torch.manual_seed(seed)
    config = dict(vocab_size=128, d_model=64, encoder_layers=DEPTH, decoder_layers=DEPTH, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, init_std=0.3,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                  decoder_layerdrop=0.0)
    config = getattr(transformers, f"{kind}Config")(**{**config, **overrides})
    return getattr(transformers, f"{kind}{head}")(config).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind, head, pre_norm", SEQ2SEQ)
def test_seq2seq_models_convert_both_stacks_keeping_the_librarys_function(kind, head, pre_norm, seeded):
    """revify converts the encoder and the decoder of a seq2seq model (meft3 for pre-norm layers, meft1
    for post-norm ones; the decoder's cross-attention reads the encoder's states through the
    conditioning): the logits and both stacks' hidden states on padded rows within the coupling's
    term of the library's, and its greedy generation with the library's cache (the cross-attention's
    keys and values computed once): its tokens, and each step's logits while they agree."""
    original = seq2seq(kind, head, seeded)
    model = revify(copy.deepcopy(original), preserve="meft3" if pre_norm else "meft1", scale_bits=16,
                   exact=False).eval()
    assert type(model.get_encoder().layers).__name__ == type(model.get_decoder().layers).__name__ == "ReversibleStack"
    assert_seq2seq_keeps_the_librarys_function(original, model, seq2seq_batch(), DEPTH)


@pytest.mark.parametrize("kind, preserve", [("MBart", None), ("Bart", "meft1"), ("M2M100", None)])
def test_seq2seq_models_train_bitwise_their_twins_save_and_pickle(kind, preserve, seeded, tmp_path):
    """An exact training step of a seq2seq model with both stacks converted (dropouts on: each stack's
    replayed in its rebuild) against its stored-activation twin (see
    :func:`assert_seq2seq_step_equals_its_twin`); save / load, a pickle and a fresh process give the
    converted model back."""
    model = revify(seq2seq(kind, "ForConditionalGeneration", seeded, dropout=0.1, activation_dropout=0.1),
                   preserve=preserve, exact=True)
    batch = seq2seq_batch()
    assert_seq2seq_step_equals_its_twin(model.train(), lambda m: m(**batch, labels=torch.randint(3, 128, (2, 6))).loss,
                                        seed=seeded, preserve=preserve)
    assert_round_trips(model, batch, tmp_path)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # (the function check)
@pytest.mark.parametrize("kind, preserve", [("MBart", "meft3"), ("Bart", "meft1"), ("TrOCR", "meft2")])
def test_a_causal_lm_given_an_encoders_states_attends_to_them(kind, preserve, seeded):
    """A causal LM of the lineage given ``encoder_hidden_states`` (a vision encoder-decoder's TrOCR): the
    library's logits within the coupling's term; in an exact training step the gradient the encoder's
    states get is the stored-activation twin's within float rounding (the layers' contributions summed
    in another order), the layers' gradients bitwise."""
    original = bart_lm(kind, seeded)
    ids = torch.randint(1, 128, (2, 7))
    states = torch.randn(2, 5, 64)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False)
    with torch.no_grad():
        theirs = original(input_ids=ids, encoder_hidden_states=states, use_cache=False).logits
        ours = model(input_ids=ids, encoder_hidden_states=states, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    model = revify(copy.deepcopy(original), preserve=preserve, exact=True).train()
    twin = to_stored_activations(copy.deepcopy(model))
    grads = []
    for m in (model, twin):
        given = states.clone().requires_grad_()
        m(input_ids=ids, encoder_hidden_states=given, labels=ids).loss.backward()
        grads.append(given.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-5 * grads[1].abs().max().item())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None) or (preserve == "meft1" and ".revtriton_adapters.g." in name)
        assert p.grad is None or q.grad is None or torch.equal(p.grad, q.grad), name


def test_a_seq2seq_step_keeps_memory_flat_in_both_stacks_depth(seeded):
    """An mBART training step's peak memory past its parameter gradients does not grow with the depth
    of its stacks (4 against 8 layers each; the encoder's states, kept once for every decoder layer's
    cross-attention, do not grow either), where the unconverted model's nearly doubles."""
    assert_seq2seq_memory_flat_in_depth(lambda depth: seq2seq(
        "MBart", "ForConditionalGeneration", seeded, encoder_layers=depth, decoder_layers=depth, encoder_ffn_dim=256,
        decoder_ffn_dim=256, max_position_embeddings=256, init_std=0.02))


def test_what_a_seq2seq_model_cannot_convert_is_refused_by_name(seeded):
    """Layerdrop (M2M100's default 0.05 in both stacks) is refused, naming the setting: in one stack, that
    stack stays as it is with a warning and the other converts; in both, revify raises."""
    with pytest.warns(UserWarning, match=r"left M2M100ForConditionalGeneration\.model\.encoder as it is.*"
                                         r"encoder_layerdrop=0\.05"):
        model = revify(seq2seq("M2M100", "ForConditionalGeneration", seeded, encoder_layerdrop=0.05))
    assert type(model.get_encoder().layers).__name__ == "ModuleList"
    assert type(model.get_decoder().layers).__name__ == "ReversibleStack"
    with pytest.raises(NotImplementedError, match="layerdrop=0.05"):
        revify(seq2seq("M2M100", "ForConditionalGeneration", seeded, encoder_layerdrop=0.05, decoder_layerdrop=0.05))


# Seq2seq models whose encoder another family's attention runs (PEGASUS-X's block-local attention with
# global tokens, LED's Longformer attention: their decoders convert) or reads audio features (Speech2Text:
# both stacks): (kind, config, stacks converted, preserve).
MORE_SEQ2SEQ = {
    "PegasusX": (dict(max_position_embeddings=64, block_size=8, num_global_tokens=4), ["model.decoder.layers"],
                 "meft3"),
    "LED": (dict(max_encoder_position_embeddings=64, max_decoder_position_embeddings=64, attention_window=[8] * DEPTH),
            ["led.decoder.layers"], "meft1"),
    "Speech2Text": (dict(max_source_positions=64, max_target_positions=64, input_feat_per_channel=8,
                         num_conv_layers=2, conv_channels=16, input_channels=1),
                    ["model.encoder.layers", "model.decoder.layers"], "meft3"),
}


def more_seq2seq(kind, seed, **overrides):
    config, _, _ = MORE_SEQ2SEQ[kind]
    return seq2seq(kind, "ForConditionalGeneration", seed, **{**config, **overrides})


def more_seq2seq_source(kind):
    """Speech2Text's: audio features (32 frames of 8); the others': 16 tokens, the second row's last four padding."""
    if kind == "Speech2Text":
        return dict(input_features=torch.randn(2, 32, 8))
    ids = torch.randint(3, 128, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    return dict(input_ids=ids, attention_mask=mask)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", sorted(MORE_SEQ2SEQ))
def test_the_decoders_of_other_seq2seq_models_convert_keeping_the_librarys_function(kind, seeded):
    """PEGASUS-X's and LED's decoders (their encoders stay as they are) and Speech2Text's two stacks:
    the logits within the coupling's term of the library's, greedy generation with the cache."""
    _, converted, preserve = MORE_SEQ2SEQ[kind]
    original = more_seq2seq(kind, seeded)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    assert [name for name, m in model.named_modules() if type(m).__name__ == "ReversibleStack"] == converted
    source = more_seq2seq_source(kind)
    decoder_ids = torch.randint(3, 128, (2, 6))
    with torch.no_grad():
        theirs = original(**source, decoder_input_ids=decoder_ids).logits
        ours = model(**source, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    assert_greedy_tokens_are_the_librarys(original, model.generate(**source, max_new_tokens=5, do_sample=False),
                                          original.generate(**source, max_new_tokens=5, do_sample=False),
                                          source=source)


@pytest.mark.parametrize("kind, preserve", [("Speech2Text", None), ("LED", "meft1")])
def test_other_seq2seq_models_train_against_their_twins_save_and_pickle(kind, preserve, seeded, tmp_path):
    """An exact training step (dropout on) against the stored-activation twin (the decoder's gradients
    bitwise, the encoder's within float rounding); save / load, a pickle and a fresh process."""
    model = revify(more_seq2seq(kind, seeded, dropout=0.1), preserve=preserve, exact=True).train()
    inputs = {**more_seq2seq_source(kind), "decoder_input_ids": torch.randint(3, 128, (2, 6))}
    labels = torch.randint(3, 128, (2, 6))
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=labels).loss, seed=seeded,
                                        preserve=preserve, encoder_side=("model.encoder.", "model.shared.",
                                                                         "led.encoder.", "led.shared."))
    assert_round_trips(model, inputs, tmp_path)


@pytest.mark.parametrize("seq2seq_model", [False, True])
def test_a_generated_token_the_library_ranks_clearly_lower_fails_the_greedy_check(seq2seq_model, seeded):
    """The greedy comparison forgives only near ties: the library's generation with one token replaced
    by the one its logits rank last there fails it (both a causal LM's and a seq2seq model's)."""
    if seq2seq_model:
        model, batch = seq2seq("Bart", "ForConditionalGeneration", seeded), seq2seq_batch()
        source = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        theirs = model.generate(**source, max_new_tokens=5, do_sample=False)
    else:
        model, source = bart_lm("MBart", seeded), None
        theirs = model.generate(torch.randint(1, 128, (2, 4)), max_new_tokens=5, do_sample=False)
    assert_greedy_tokens_are_the_librarys(model, theirs, theirs, source=source)
    at = theirs.shape[1] - 3
    inputs = (dict(input_ids=theirs[1:, :at]) if source is None else
              dict(input_ids=source["input_ids"][1:], attention_mask=source["attention_mask"][1:],
                   decoder_input_ids=theirs[1:, :at]))
    with torch.no_grad():
        worst = model(**inputs, use_cache=False).logits[0, -1].argmin()
    ours = theirs.clone()
    ours[1, at] = worst
    with pytest.raises(AssertionError, match=f"row 1: token {int(worst)} at position {at}"):
        assert_greedy_tokens_are_the_librarys(model, ours, theirs, source=source)
