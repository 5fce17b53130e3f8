"""T5, mT5, UMT5, Pop2Piano (revtriton/convert/t5.py) and T5Gemma, T5Gemma 2 (revtriton/convert/t5gemma.py) under
revify: both stacks reversible under the library's own forward, T5's relative position bias (the first
block makes it) shared through the conditioning (its gradient reaching the table), UMT5's made by each
block, the decoder's cross-attention reading the encoder's states."""
import copy

import pytest
import torch

from revtriton.convert import revify

from revified import (assert_round_trips, assert_seq2seq_keeps_the_librarys_function,
                      assert_seq2seq_memory_flat_in_depth, assert_seq2seq_step_equals_its_twin, seq2seq_batch)
from test_revify import DEPTH

transformers = pytest.importorskip("transformers")


def t5(kind="T5", head="ForConditionalGeneration", seed=0, **overrides):
    """A tiny T5-family model at T5's own initialisation (every branch shows in the outputs; three times
    larger weights amplify the couplings' 2**-16 term past the tests' bound) but for its relative
    position tables, no dropout unless asked."""
    torch.manual_seed(seed)
    config = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=96, num_layers=DEPTH, num_decoder_layers=DEPTH,
                  num_heads=4, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, dropout_rate=0.0,
                  relative_attention_num_buckets=8, relative_attention_max_distance=16)
    config = getattr(transformers, f"{kind}Config")(**{**config, **overrides})
    model = getattr(transformers, f"{kind}{head}")(config)
    with torch.no_grad():  # relative position biases that matter (at T5's init they barely move a logit)
        for name, table in model.named_parameters():
            if name.endswith("relative_attention_bias.weight"):
                table.normal_(0.0, 2.0)
    return model.eval()


def stacks(model) -> list:
    return [name for name, module in model.named_modules() if type(module).__name__ == "ReversibleStack"]


# LongT5's encoders: each token sees 2 tokens each way (blocks of 3), and transient-global also each 4-token block's
# mean (a source row of 10 tokens: several blocks)
LONGT5_LOCAL = {"local_radius": 2}
LONGT5_GLOBAL = {"local_radius": 2, "encoder_attention_type": "transient-global", "global_block_size": 4}


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind, overrides", [("T5", {}), ("MT5", {}), ("UMT5", {}),
                                             ("T5", {"feed_forward_proj": "gated-gelu"}), ("LongT5", LONGT5_LOCAL),
                                             ("LongT5", LONGT5_GLOBAL)])
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_t5_converts_both_stacks_keeping_the_librarys_function(kind, overrides, preserve, seeded):
    """Both stacks convert (T5, mT5, UMT5 with a bias table in every block, Flan-T5's gated-GELU
    feed-forward, LongT5 with local and transient-global encoders): the logits and both stacks' hidden
    states on padded source rows within the coupling's term of the library's, and its greedy generation
    with the library's cache (the decoder's bias for the queries past the cached tokens): its tokens,
    and each step's logits while the tokens agree."""
    original = t5(kind, seed=seeded, **overrides)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    assert stacks(model) == ["encoder.block", "decoder.block"]
    assert_seq2seq_keeps_the_librarys_function(original, model, seq2seq_batch(), DEPTH)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")
def test_pop2pianos_stacks_are_t5s(seeded):
    """Pop2Piano (T5's stacks under its own names): both convert, the logits within the coupling's term,
    an exact training step against its twin."""
    original = t5("Pop2Piano", seed=seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert stacks(model) == ["encoder.block", "decoder.block"]
    inputs = seq2seq_batch()
    with torch.no_grad():
        theirs, ours = original(**inputs).logits, model(**inputs).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    model = revify(t5("Pop2Piano", seed=seeded, dropout_rate=0.1), exact=True).train()
    labels = torch.randint(3, 128, (2, 6))
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=labels).loss, seed=seeded,
                                        encoder_side=("encoder.", "shared."))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind, overrides", [("T5", {}), ("LongT5", LONGT5_LOCAL), ("LongT5", LONGT5_GLOBAL)])
def test_t5s_encoder_model_converts_its_stack(kind, overrides, seeded):
    """T5EncoderModel (a text encoder; LongT5's, local and transient-global): its one stack, its last hidden
    state the library's."""
    original = t5(kind, head="EncoderModel", seed=seeded, **overrides)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert stacks(model) == ["encoder.block"]
    inputs = seq2seq_batch()
    del inputs["decoder_input_ids"]
    with torch.no_grad():
        theirs, ours = original(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


@pytest.mark.parametrize("kind, preserve, overrides", [
    ("T5", None, {}), ("MT5", "meft1", {}), ("UMT5", None, {}), ("LongT5", None, LONGT5_LOCAL),
    ("LongT5", "meft1", LONGT5_GLOBAL)])
def test_t5_trains_bitwise_its_twin_saves_and_pickles(kind, preserve, overrides, seeded, tmp_path):
    """An exact training step with dropout on: the loss and the decoder's gradients bitwise the
    stored-activation twin's, the encoder's within float rounding (the cross-attention's gradients
    reach the encoder's states summed in another order); the relative position tables get their
    gradients through the shared bias; save / load, a pickle and a fresh process give the model back."""
    model = revify(t5(kind, seed=seeded, dropout_rate=0.1, **overrides), preserve=preserve, exact=True).train()
    inputs = seq2seq_batch()
    labels = torch.randint(3, 128, (2, 6))
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=labels).loss, seed=seeded,
                                        preserve=preserve, encoder_side=("encoder.", "shared."))
    for stack in (model.encoder, model.decoder):
        for block in stack.block[:DEPTH if kind == "UMT5" else 1]:  # (UMT5: a table a block)
            for name, table in block.layer[0].named_parameters():  # (LongT5's transient-global: two tables)
                if "relative_attention_bias" in name:
                    assert table.grad is not None and table.grad.abs().sum() > 0, name
    assert_round_trips(model, inputs, tmp_path)


# Switch Transformers: 4 experts in every other block (the second and fourth of 4), each token to one expert, at most 8
# a sequence an expert (a row of 10 source tokens overflows some)
SWITCH = dict(num_layers=4, num_decoder_layers=4, num_experts=4, expert_capacity=8, encoder_sparse_step=2,
              decoder_sparse_step=2)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_switch_transformers_convert_both_stacks_keeping_the_librarys_function(preserve, seeded):
    """Switch Transformers (T5's stacks with experts' feed-forward in every other block): both stacks
    convert, the logits, hidden states and cached greedy generation within the coupling's term of the
    library's; the routers' logits recorded without grad the library's, and refused with grad (the
    router losses made of them would get no gradient)."""
    original = t5("SwitchTransformers", seed=seeded, **SWITCH)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    assert stacks(model) == ["encoder.block", "decoder.block"]
    inputs = seq2seq_batch()
    assert_seq2seq_keeps_the_librarys_function(original, model, inputs, SWITCH["num_layers"])
    # (asked of the stacks: the library's own model fails to unpack them in transformers 5.25)
    source = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], output_router_logits=True)
    logits = []
    with torch.no_grad():
        for m in (model, original):
            encoded = m.encoder(**source)
            decoded = m.decoder(input_ids=inputs["decoder_input_ids"], encoder_hidden_states=encoded.last_hidden_state,
                                encoder_attention_mask=inputs["attention_mask"], output_router_logits=True)
            logits.append((*encoded.router_logits, *decoded.router_logits))
    assert len(logits[0]) == len(logits[1]) == 4  # (the sparse blocks': two a stack)
    for a, b in zip(*logits):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3 * b.abs().max().item())
    with pytest.raises(NotImplementedError, match="output_router_logits=True with grad enabled"):
        model.encoder(**source)


def test_switch_transformers_train_bitwise_their_twin_save_and_pickle(seeded, tmp_path):
    """An exact training step with dropout and the routers' jitter noise (both drawn again in the
    rebuild): the loss and the decoder's gradients bitwise the twin's, the encoder's within float
    rounding; every expert a token reached has its gradient; save / load, a pickle and a fresh process."""
    model = revify(t5("SwitchTransformers", seed=seeded, dropout_rate=0.1, router_jitter_noise=0.1, **SWITCH),
                   exact=True).train()
    inputs = seq2seq_batch()
    labels = torch.randint(3, 128, (2, 6))
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=labels).loss, seed=seeded,
                                        encoder_side=("encoder.", "shared."))
    routers = [name for name, p in model.named_parameters() if ".router." in name]
    assert routers and all(p.grad is not None and p.grad.abs().sum() > 0
                           for name, p in model.named_parameters() if name in routers)
    assert_round_trips(model, inputs, tmp_path)


def test_a_t5_step_keeps_memory_flat_in_both_stacks_depth(seeded):
    """A T5 training step's peak memory past its parameter gradients does not grow with the depth of
    its stacks (4 against 8 blocks each), where the unconverted model's nearly doubles."""
    assert_seq2seq_memory_flat_in_depth(lambda depth: t5(seed=seeded, num_layers=depth, num_decoder_layers=depth,
                                                         d_ff=256))


def test_a_block_with_a_relative_bias_of_its_own_is_refused(seeded):
    """Only the first block may make the bias the loop shares: a later block with a table of its own
    (UMT5's layout) is refused, naming the block, and nothing is converted."""
    model = t5(head="EncoderModel", seed=seeded)
    model.encoder.block[1].layer[0].SelfAttention.has_relative_attention_bias = True
    with pytest.raises(NotImplementedError, match="block 1: only the first block's self-attention"):
        revify(model)
    assert not stacks(model)


def t5gemma(head="ForConditionalGeneration", seed=0, **overrides):
    """A tiny T5Gemma: Gemma 2's sandwich layers, a sliding window of 4 on every other layer, softcapped
    attention; weights off their small init (every branch shows in the outputs)."""
    torch.manual_seed(seed)
    stack = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=4, dropout_rate=0.0, attention_dropout=0.0,
                 query_pre_attn_scalar=16)
    stack.update(overrides)
    config = transformers.T5GemmaConfig(encoder=dict(stack), decoder=dict(stack), vocab_size=128, pad_token_id=0,
                                        eos_token_id=2, bos_token_id=1, decoder_start_token_id=1)
    model = getattr(transformers, f"T5Gemma{head}")(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model.eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_t5gemma_converts_both_stacks_keeping_the_librarys_function(preserve, seeded):
    """T5Gemma (revtriton/convert/t5gemma.py): both stacks, the logits and both stacks' hidden states on
    padded source rows within the coupling's term (sliding-window and full layers each with the
    library's mask of their kind), greedy generation with the library's cache (its self-attention and
    cross-attention parts): tokens, and each step's logits while they agree."""
    original = t5gemma(seed=seeded)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    assert stacks(model) == ["model.encoder.layers", "model.decoder.layers"]
    assert [block._revtriton_spec.window for block in model.model.encoder.layers] == [4, None, 4][:DEPTH]
    assert_seq2seq_keeps_the_librarys_function(original, model, seq2seq_batch(), DEPTH)


def t5gemma2(head="ForConditionalGeneration", seed=0, **overrides):
    """A tiny T5Gemma 2: T5Gemma's sandwich layers, sliding-window (4) and full attention layers, the decoder's
    self- and cross-attention merged; a one-layer SigLIP vision tower beside the text encoder."""
    torch.manual_seed(seed)
    kinds = ["sliding_attention", "full_attention", "sliding_attention"][:DEPTH]
    stack = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=4, layer_types=kinds, dropout_rate=0.0,
                 attention_dropout=0.0, query_pre_attn_scalar=16)
    stack.update(overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.T5Gemma2Config(encoder=dict(text_config=dict(stack), vision_config=vision),
                                         decoder=dict(stack), vocab_size=128, pad_token_id=0, eos_token_id=2,
                                         bos_token_id=1, decoder_start_token_id=1)
    model = getattr(transformers, f"T5Gemma2{head}")(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model.eval()


T5GEMMA2_STACKS = ["model.encoder.text_model.layers", "model.encoder.vision_tower.encoder.layers",
                   "model.decoder.layers"]


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_t5gemma2_converts_its_text_encoder_and_decoder_keeping_the_librarys_function(preserve, seeded):
    """T5Gemma 2: its text encoder, its decoder (each layer's merged self- and cross-attention on the
    encoder's states, under the merged mask of its attention kind) and its vision tower (the clip
    family's) convert; the logits and both text stacks' hidden states on padded source rows within the
    coupling's term of the library's, and greedy generation with the library's cache: tokens, and each
    step's logits while they agree."""
    original = t5gemma2(seed=seeded)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    assert stacks(model) == T5GEMMA2_STACKS
    assert [block._revtriton_spec.window for block in model.model.decoder.layers] == [4, None, 4][:DEPTH]
    assert_seq2seq_keeps_the_librarys_function(original, model, seq2seq_batch(), DEPTH)


def test_t5gemma2_trains_against_its_twin_saves_and_pickles(seeded, tmp_path):
    """An exact training step with dropout on against the stored-activation twin (the decoder's merged
    attention reads the encoder's states from the conditioning: their gradient reaches the encoder);
    save / load, a pickle, a fresh process."""
    model = revify(t5gemma2(seed=seeded, dropout_rate=0.1), exact=True).train()
    inputs = seq2seq_batch()
    labels = torch.randint(3, 128, (2, 6))
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=labels).loss, seed=seeded)
    assert_round_trips(model, inputs, tmp_path)


def test_t5gemma_trains_against_its_twin_saves_and_pickles(seeded, tmp_path):
    """An exact training step with dropout on against the stored-activation twin (the decoder's
    gradients bitwise, the encoder's within float rounding); save / load, a pickle, a fresh process."""
    model = revify(t5gemma(seed=seeded, dropout_rate=0.1), exact=True).train()
    inputs = seq2seq_batch()
    labels = torch.randint(3, 128, (2, 6))
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=labels).loss, seed=seeded)
    assert_round_trips(model, inputs, tmp_path)
