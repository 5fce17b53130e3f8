"""NLLB-MoE under revify (revtriton/convert/nllb_moe.py): both stacks reversible under the library's own
forward, the experts' router reading the layer's mask through the conditioning, the decoder's
cross-attention reading the encoder's states; the routers' logits only without grad."""
import copy

import pytest
import torch

from revtriton.convert import revify

from revified import (assert_round_trips, assert_seq2seq_keeps_the_librarys_function,
                      assert_seq2seq_step_equals_its_twin, seq2seq_batch)

transformers = pytest.importorskip("transformers")

DEPTH = 4  # experts in every second layer of each stack


def nllb_moe(seed=0, **overrides):
    """A tiny NLLB-MoE (4 experts, top-2, capacity 8 tokens), weights off their small init (every branch
    shows in the outputs), no layerdrop (refused) and no dropout unless asked."""
    torch.manual_seed(seed)
    config = dict(vocab_size=128, d_model=64, encoder_layers=DEPTH, decoder_layers=DEPTH, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, num_experts=4,
                  expert_capacity=8, encoder_sparse_step=2, decoder_sparse_step=2, encoder_layerdrop=0.0,
                  decoder_layerdrop=0.0, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                  moe_token_dropout=0.0, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
                  decoder_start_token_id=2, init_std=0.2)
    model = transformers.NllbMoeForConditionalGeneration(transformers.NllbMoeConfig(**{**config, **overrides}))
    return model.eval()


def stacks(model) -> list:
    return [name for name, module in model.named_modules() if type(module).__name__ == "ReversibleStack"]


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_nllb_moe_converts_both_stacks_keeping_the_librarys_function(preserve, seeded):
    """Both stacks convert: the logits, both stacks' hidden states and cached greedy generation within the
    coupling's term of the library's, the source's padding kept from the experts; the routers' logits
    without grad the library's, refused with grad (their losses would not reach the routers)."""
    original = nllb_moe(seeded)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    assert stacks(model) == ["model.encoder.layers", "model.decoder.layers"]
    inputs = seq2seq_batch()
    assert_seq2seq_keeps_the_librarys_function(original, model, inputs, DEPTH)
    with torch.no_grad():
        theirs, ours = (m(**inputs, output_router_logits=True) for m in (original, model))
    for name in ("encoder_router_logits", "decoder_router_logits"):
        got, expected = getattr(ours, name), getattr(theirs, name)  # (one a sparse layer)
        assert got is not None and len(got) == len(expected) == DEPTH // 2, name
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-3 * b.abs().max().item())
    with pytest.raises(NotImplementedError, match="output_router_logits=True with grad enabled"):
        model(**inputs, output_router_logits=True)


def test_nllb_moe_trains_bitwise_its_twin_saves_and_pickles(seeded, tmp_path):
    """An exact training step with dropout (the experts' token dropout too): the loss and the decoder's
    gradients bitwise the twin's, the encoder's within float rounding; the routers get gradients; save /
    load, a pickle and a fresh process give the model back."""
    model = revify(nllb_moe(seeded, dropout=0.1, moe_token_dropout=0.2), exact=True).train()
    inputs = seq2seq_batch()
    labels = torch.randint(3, 128, (2, 6))
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=labels).loss, seed=seeded,
                                        encoder_side=("model.encoder.", "model.shared."))
    routers = [p for name, p in model.named_parameters() if ".router." in name]
    assert routers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)
    assert_round_trips(model, inputs, tmp_path)


def test_layerdrop_is_refused_naming_it(seeded):
    model = nllb_moe(seeded, encoder_layerdrop=0.05, decoder_layerdrop=0.05)
    with pytest.raises(NotImplementedError, match="encoder_layerdrop=0.05 skips layers at random"):
        revify(model)
    assert not stacks(model)
