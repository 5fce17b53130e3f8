"""Moonshine under revify: its encoder (LLaMA's layer conventions) and its decoder
(revtriton/convert/moonshine.py: self-attention with RoPE, a cross-attention reading the encoder's states
through the conditioning, a gated MLP; its cache while decoding) reversible stacks run through the
library's own forward; Moonshine Streaming's decoder the same (its encoder, with other layers, stays)."""
import copy

import pytest
import torch

from revtriton import ReversibleStack
from revtriton.convert import revify

from revified import assert_greedy_tokens_are_the_librarys, assert_round_trips, assert_seq2seq_step_equals_its_twin

transformers = pytest.importorskip("transformers")

SAMPLES = 1600  # audio samples: the encoder's convolutions leave a few frames


KINDS = ["moonshine", "streaming"]


def _moonshine(seed, kind="moonshine"):
    torch.manual_seed(seed)
    tokens = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=0)
    if kind == "streaming":
        encoder = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4)
        config = transformers.MoonshineStreamingConfig(encoder_config=encoder, vocab_size=64, hidden_size=32,
                                                       intermediate_size=48, num_hidden_layers=3,
                                                       num_attention_heads=4, num_key_value_heads=4, **tokens)
        model = transformers.MoonshineStreamingForConditionalGeneration(config)
    else:
        config = transformers.MoonshineConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                              encoder_num_hidden_layers=3, decoder_num_hidden_layers=3,
                                              encoder_num_attention_heads=4, decoder_num_attention_heads=4, **tokens)
        model = transformers.MoonshineForConditionalGeneration(config)
    with torch.no_grad():  # weights off their small init (norms off ones): every branch shows in the outputs
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
            elif "layernorm" in name or "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return dict(input_values=torch.randn(2, SAMPLES, generator=generator),
                decoder_input_ids=torch.randint(3, 64, (2, 5), generator=generator))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.filterwarnings("ignore:revtriton. revify left MoonshineStreaming")  # (its encoder)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_a_preserving_conversion_keeps_moonshines_function(preserve, kind, seeded):
    """Both stacks convert (Moonshine Streaming's decoder) and keep the logits and every decoder hidden
    state; greedy generation (the library's cache, the cross-attention's keys and values computed once)
    is the library's."""
    original = _moonshine(seeded, kind)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    stacks = [model.model.decoder.layers] if kind == "streaming" else [model.model.encoder.layers,
                                                                        model.model.decoder.layers]
    assert [m for m in model.modules() if isinstance(m, ReversibleStack)] == stacks
    inputs = _inputs(seeded)
    with torch.no_grad():
        theirs = original(**inputs, output_hidden_states=True)
        ours = model(**inputs, output_hidden_states=True)
    for got, expected in zip([ours.logits, *ours.decoder_hidden_states],
                             [theirs.logits, *theirs.decoder_hidden_states]):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-3 * expected.abs().max().item())
    assert len(ours.decoder_hidden_states) == 4
    values = inputs["input_values"]
    assert_greedy_tokens_are_the_librarys(original, model.generate(values, max_new_tokens=4),
                                          original.generate(values, max_new_tokens=4),
                                          source=dict(input_values=values))


@pytest.mark.filterwarnings("ignore:revtriton. revify left MoonshineStreaming")  # (its encoder)
@pytest.mark.parametrize("kind", KINDS)
def test_moonshine_trains_bitwise_its_twin_saves_and_pickles(kind, seeded, tmp_path):
    """The library's loss on the transcript: an exact training step's loss and the decoder's gradients
    bitwise the stored-activation twin's, the encoder's within float rounding (the cross-attention's
    contributions to the encoder's states summed in another order), every encoder layer's reached;
    save_pretrained -> revtriton.from_pretrained, a pickle and a fresh process give the logits; a decoder
    half alone refuses (the masks and the encoder's states are the model's)."""
    model = revify(_moonshine(seeded, kind), exact=True).train()
    inputs = _inputs(seeded)
    labels = inputs.pop("decoder_input_ids")
    # (Streaming's decoder adds its positions to the encoder's states, then projects them: encoder side)
    encoder_side = ("model.encoder.", "model.decoder.pos_emb.", "model.decoder.proj.")
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=labels).loss, encoder_side=encoder_side)
    assert all(p.grad is not None for name, p in model.named_parameters() if "encoder.layers." in name)
    assert_round_trips(model, _inputs(seeded), tmp_path)
    with pytest.raises(RuntimeError, match="call the model"):
        model.model.decoder.layers[0].coupling_halves()[0](torch.randn(1, 4, 32))


def test_a_decoder_layer_missing_a_part_is_refused_naming_it(seeded):
    model = _moonshine(seeded)
    del model.model.decoder.layers[1].final_layernorm
    with pytest.warns(UserWarning, match="final_layernorm"):
        revify(model)
    assert not isinstance(model.model.decoder.layers, ReversibleStack)
