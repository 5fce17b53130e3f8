"""Post-norm layers (BERT, RoBERTa, ELECTRA encoders and OPT-350M's decoder: a LayerNorm after each
residual add) under the preserving couplings whose one half is the whole pretrained layer, meft1 and
meft2 (issue 48): MEFT's own setting. The other conversions refuse them, naming the modes that work.
"""
import copy

import pytest
import torch

from revtriton import ReversibleStack, revify, to_stored_activations
from revtriton.profiling import peak_memory

from revified import assert_greedy_tokens_are_the_librarys, assert_round_trips, assert_seq2seq_step_equals_its_twin
from test_host_forward import _opt, assert_saves_and_pickles
from test_models import check_against_twin

transformers = pytest.importorskip("transformers")
SCALE_BITS = 6  # revify's default
# The function checks convert with 10 scale bits: the difference to the unconverted model is s = 2**-10
# times the earlier layers' streams, through the later layers' gains (up to 2.4 s relative on the
# logits over 12 seeds of these random weights, OPT's at init_std 0.3 the largest); 8 s is allowed. A
# conversion that computed another function would be off by O(1), whatever s.
FUNCTION_BITS, FUNCTION_BOUND = 10, 8 * 2**-10


# DeBERTa-v3's attention: relative positions in buckets, both disentangled terms, the relative embeddings
# normalised (a parameter outside the layers, handed to each with the relative positions by the encoder's loop).
DEBERTA = dict(relative_attention=True, position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"],
               norm_rel_ebd="layer_norm", share_att_key=True)
DEBERTA_V1 = dict(relative_attention=True, max_relative_positions=16, pos_att_type=["p2c", "c2p"])  # its own LayerNorm


def hf_encoder(kind="Bert", head="ForSequenceClassification", seed=0, layers=3, **overrides):
    torch.manual_seed(seed)
    options = dict(vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                   intermediate_size=96, max_position_embeddings=64, num_labels=2,
                   **(DEBERTA if kind == "DebertaV2" else DEBERTA_V1 if kind == "Deberta" else {}))
    config = getattr(transformers, f"{kind}Config")(**{**options, **overrides})
    return getattr(transformers, f"{kind}{head}")(config)


def padded_batch(rows=2, tokens=12):
    ids = torch.randint(1, 128, (rows, tokens))
    mask = torch.ones(rows, tokens, dtype=torch.long)
    mask[1:, tokens - 4:] = 0  # right padding: the model's mask reaches each whole-layer half
    return ids, mask


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kind", ["Bert", "Roberta", "Electra", "Deberta", "DebertaV2"])
@pytest.mark.parametrize("mode", ["meft1", "meft2"])
def test_post_norm_encoders_convert_keeping_the_function_and_train(kind, mode, seeded):
    """Right after conversion the logits are the unconverted model's up to the coupling's term (see
    FUNCTION_BOUND); a training step (dropout on) gives a finite loss and a finite gradient to every
    trainable parameter, the adapters' up projections (zero at conversion) a nonzero one."""
    model = hf_encoder(kind, seed=seeded).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    revify(model, preserve=mode, scale_bits=FUNCTION_BITS)
    assert type(model.base_model.encoder.layer).__name__ == "ReversibleStack"
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    assert relative(after, before) <= FUNCTION_BOUND
    with torch.no_grad():  # the padded row is its real tokens alone: the mask reached every layer
        alone = model(input_ids=ids[1:, :-4]).logits
    assert relative(after[1:], alone) <= 1e-4  # (exact streams: a 2**-16 grid; unmasked: about 1e-2)
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1])).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    ups = [p.grad for n, p in model.named_parameters() if ".revtriton_adapters." in n and n.endswith("up.weight")]
    assert ups and any(g.abs().sum() > 0 for g in ups)


@pytest.mark.parametrize("mode, kind", [("meft1", "Bert"), ("meft2", "Bert"), ("meft2", "DebertaV2"),
                                        ("meft1", "Deberta")])
def test_an_exact_step_equals_its_stored_twin_and_the_model_saves_and_pickles(mode, kind, seeded, tmp_path):
    """(DeBERTa-v2: its relative embeddings, a parameter of the encoder that every layer reads, get the
    gradient each layer's rebuild gives them, summed: bitwise the twin's.)"""
    model = revify(hf_encoder(kind, seed=seeded, hidden_dropout_prob=0.1), preserve=mode, exact=True).train()
    ids, mask = padded_batch()
    assert_exact_step_equals_its_twin(model, mode, seeded, input_ids=ids, attention_mask=mask,
                                      labels=torch.tensor([1, 0]))
    assert_saves_and_pickles(model, ids, tmp_path)


def assert_exact_step_equals_its_twin(model, mode, seed, **inputs):
    """A training step's loss and gradients (dropout under ``seed``) bitwise its stored-activation twin's."""
    twin = to_stored_activations(copy.deepcopy(model))
    losses = []
    for m in (model, twin):
        torch.manual_seed(seed)  # the same dropout masks
        loss = m(**inputs).loss
        loss.backward()
        losses.append(loss)
    # meft1's top G adapter feeds the stream no one reads: the twin's autograd gives it no gradient,
    # the reversible backward a zero one.
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if q.grad is None and p.grad is None:  # outside the loss in both (LayoutLM's pooler under a masked LM)
            p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
            continue
        if q.grad is None:
            assert mode == "meft1" and ".revtriton_adapters.g." in name and not p.grad.any(), name
            q.grad = torch.zeros_like(p.grad)
    check_against_twin(model, twin, *losses, exact=True)


@pytest.mark.parametrize("kind", ["RemBert", "Yoso", "Nystromformer", "Tapas", "LayoutLM"])
def test_more_bert_style_encoders_keep_their_masked_lm_logits_and_train(kind, seeded):
    """Found by ``tools/conformance.py --kind masked-lm``: RemBERT's, YOSO's, Nystromformer's and TAPAS's
    encoder loops (MRA's too) read each layer's output as ``layer_outputs[0]`` (converted, they crashed
    at the first forward: the stand-ins now return a tuple there), and LayoutLM's masked-LM head hands
    ``bbox`` to its base model by position (refused at the first forward). Converted with meft1, the
    masked-LM logits of a padded batch's real tokens are the unconverted model's (FUNCTION_BOUND), and an
    exact training step equals its stored-activation twin bitwise. (MRA without its CUDA kernel returns
    a fresh leaf that requires grad as its attention: the engine refuses that in training, by name.)"""
    model = hf_encoder(kind, "ForMaskedLM", seed=seeded).eval()
    ids, mask = padded_batch()
    real = mask.bool()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    revify(model, preserve="meft1", scale_bits=FUNCTION_BITS)
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    assert relative(after[real], before[real]) <= FUNCTION_BOUND
    model = revify(hf_encoder(kind, "ForMaskedLM", seed=seeded, hidden_dropout_prob=0.1), preserve="meft1",
                   exact=True).train()
    assert_exact_step_equals_its_twin(model, "meft1", seeded, input_ids=ids, attention_mask=mask,
                                      labels=ids.masked_fill(~real, -100))


def _distilbert(seed, head="ForSequenceClassification", **overrides):
    torch.manual_seed(seed)
    config = transformers.DistilBertConfig(vocab_size=128, dim=64, hidden_dim=96, n_layers=3, n_heads=4,
                                           max_position_embeddings=64, pad_token_id=0, num_labels=2, **overrides)
    return getattr(transformers, f"DistilBert{head}")(config)


@pytest.mark.parametrize("mode", ["meft1", "meft2"])
def test_distilbert_keeps_its_function_and_trains_bitwise_its_twin(mode, seeded, tmp_path):
    """DistilBERT (its own layer parts: attention, sa_layer_norm, ffn, output_layer_norm; its layers under
    ``transformer``): the whole layer one half keeps the logits within the coupling's term, the model's
    mask reaches every layer, an exact step with dropout equals its stored-activation twin bitwise, and
    the model saves and pickles; the conversions coupling each branch refuse, naming the modes that work."""
    model = _distilbert(seeded).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    revify(model, preserve=mode, scale_bits=FUNCTION_BITS)
    assert type(model.distilbert.transformer.layer).__name__ == "ReversibleStack"
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
        alone = model(input_ids=ids[1:, :-4]).logits
    assert relative(after, before) <= FUNCTION_BOUND
    assert relative(after[1:], alone) <= 1e-4
    model = revify(_distilbert(seeded, dropout=0.1), preserve=mode, exact=True).train()
    assert_exact_step_equals_its_twin(model, mode, seeded, input_ids=ids, attention_mask=mask,
                                      labels=torch.tensor([1, 0]))
    assert_saves_and_pickles(model, ids, tmp_path)
    with pytest.raises(NotImplementedError, match="preserve='meft1' or 'meft2' converts it"):
        revify(_distilbert(seeded))


@pytest.mark.parametrize("kind", ["NomicBert", "Gte", "MPNet"])
@pytest.mark.parametrize("mode", ["meft1", "meft2"])
def test_more_post_norm_encoders_keep_their_function_and_train_bitwise_their_twin(kind, mode, seeded, tmp_path):
    """NomicBERT and GTE (post-norm layers with rotary positions: the model's rotary embedding handed to
    each whole-layer half, in the rebuild too) and MPNet (the encoder's relative position bias handed to
    every layer as position_bias, its gradient reaching relative_attention_bias): the logits within the
    coupling's term, the mask reaching every layer, an exact step with dropout bitwise its stored-activation
    twin (every parameter's gradient, the bias's included), save / load / pickle."""
    def build(**overrides):
        model = hf_encoder(kind, seed=seeded, **overrides)
        if kind == "MPNet":  # a relative bias that shows in the logits (at its init, 0.02, it hardly does)
            with torch.no_grad():
                model.mpnet.encoder.relative_attention_bias.weight.normal_(0.0, 2.0)
        return model

    model = build().eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    revify(model, preserve=mode, scale_bits=FUNCTION_BITS)
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
        alone = model(input_ids=ids[1:, :-4]).logits
    assert relative(after, before) <= FUNCTION_BOUND
    assert relative(after[1:], alone) <= 1e-4
    model = revify(build(hidden_dropout_prob=0.1), preserve=mode, exact=True).train()
    assert_exact_step_equals_its_twin(model, mode, seeded, input_ids=ids, attention_mask=mask,
                                      labels=torch.tensor([1, 0]))
    assert_saves_and_pickles(model, ids, tmp_path)


@pytest.mark.parametrize("options, asked", [({}, "revify\\(model\\)"), (dict(preserve="meft3"), "preserve='meft3'")])
@pytest.mark.parametrize("kind", ["Bert", "MPNet"])
def test_the_other_conversions_refuse_naming_the_modes_that_work(kind, options, asked):
    model = hf_encoder(kind)
    with pytest.raises(NotImplementedError, match=rf"post-norm layers.*{asked}.*preserve='meft1' or 'meft2'"):
        revify(model, **options)
    assert type(model.base_model.encoder.layer).__name__ == "ModuleList"  # unchanged


def _git(seed, **text):
    """GIT's captioner (GitForCausalLM): a CLIP vision tower whose projected patches come first in the
    sequence of BERT's post-norm layers, which decode with a cache while the config is no decoder's;
    the text causal, the patches seeing each other both ways (the mask the model builds)."""
    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = transformers.GitConfig(vision_config=vision, vocab_size=100, hidden_size=32, num_hidden_layers=3,
                                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3, **text)
    return transformers.GitForCausalLM(config).eval()


def _git_inputs():
    ids = torch.randint(3, 100, (2, 6))
    ids[:, 0] = 1
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # a right-padded caption
    return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(2, 3, 32, 32))


@pytest.mark.skipif(not hasattr(transformers, "GitForCausalLM"), reason="this transformers has no GIT")
@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("mode", ["meft1", "meft2"])
def test_git_converts_its_vision_tower_and_its_text_layers_and_keeps_captioning(mode, seeded):
    """GIT under meft1 / meft2: its CLIP vision tower (the clip family's halves) and its post-norm text
    layers (a whole layer a half, the self-attention's cache layer kept while decoding) are each a
    stack. The logits on an image and a padded caption, and greedy captions with the cache (from the
    image alone and after a prompt) are the library's. (Before: refused, its first cached call failed.)"""
    original = _git(seeded)
    model = revify(copy.deepcopy(original), preserve=mode, scale_bits=16, exact=False).eval()
    stacks = [m for m in model.modules() if isinstance(m, ReversibleStack)]
    assert stacks == [model.git.image_encoder.vision_model.encoder.layers, model.git.encoder.layer]
    inputs = _git_inputs()
    with torch.no_grad():
        theirs, ours = original(**inputs).logits, model(**inputs).logits
    real = torch.cat((torch.ones(2, theirs.shape[1] - 6, dtype=torch.bool), inputs["attention_mask"].bool()), 1)
    torch.testing.assert_close(ours[real], theirs[real], rtol=0, atol=2e-3 * theirs.abs().max().item())
    pixels = dict(pixel_values=inputs["pixel_values"])
    prompt_ids = inputs["input_ids"][:, :3]
    prompted = dict(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids))
    for prompt in ({}, dict(input_ids=prompt_ids), prompted):
        generate = dict(**pixels, **prompt, max_new_tokens=5, do_sample=False)
        assert_greedy_tokens_are_the_librarys(original, model.generate(**generate), original.generate(**generate),
                                              beside=pixels)
    with torch.no_grad():  # a cache filled by decoding, then a call with grad: refused (it would be ignored)
        cache = model(**pixels, input_ids=prompt_ids, use_cache=True).cache
    assert cache.get_seq_length() > prompt_ids.shape[1]  # (the image's tokens first)
    with pytest.raises(NotImplementedError, match="keeps no KV cache with grad enabled"):
        model(input_ids=inputs["input_ids"][:, 3:4], cache=cache)


@pytest.mark.skipif(not hasattr(transformers, "GitForCausalLM"), reason="this transformers has no GIT")
@pytest.mark.parametrize("mode", ["meft1", "meft2"])
def test_git_trains_bitwise_its_twin_save_and_pickle(mode, seeded, tmp_path):
    """An exact training step with dropout (the caption's tokens as labels): loss and gradients of
    both stacks bitwise the stored-activation twin's; then save / load / pickle / a fresh process."""
    model = revify(_git(seeded, hidden_dropout_prob=0.1), preserve=mode, exact=True).train()
    inputs = _git_inputs()
    # The fused loss (issue 36) scores the text after the image's tokens, as the library's loss does
    shifted = inputs["input_ids"].roll(-1, 1).masked_fill(inputs["attention_mask"].roll(-1, 1) == 0, -100)
    shifted[:, -1] = -100
    for labels in (dict(labels=inputs["input_ids"]), dict(labels=inputs["input_ids"], shift_labels=shifted)):
        losses = []
        for library in (False, True):
            torch.manual_seed(seeded)
            out = model(**inputs, **labels, return_logits=library)
            assert (out.logits is None) != library
            losses.append(out.loss)
        torch.testing.assert_close(*losses, rtol=1e-5, atol=0)
    assert_exact_step_equals_its_twin(model, mode, seeded, **inputs, labels=inputs["input_ids"])
    assert all(p.grad is not None for name, p in model.named_parameters() if ".layers." in name or ".layer." in name)
    assert_round_trips(model, inputs, tmp_path)


def test_post_norm_layers_taking_other_inputs_from_the_loop_are_refused_naming_them():
    """A layer whose forward takes an input the whole-layer half does not hand it (here RoFormer's
    sinusoidal_pos) is refused at conversion, naming the input, rather than run without it."""
    model = hf_encoder()
    layer_class = type(model.bert.encoder.layer[0])

    class LayerWithSinusoidalPositions(layer_class):
        def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, **kwargs):
            return super().forward(hidden_states, attention_mask, **kwargs)

    for layer in model.bert.encoder.layer:
        layer.__class__ = LayerWithSinusoidalPositions
    with pytest.raises(NotImplementedError, match="take sinusoidal_pos from the encoder's loop"):
        revify(model, preserve="meft1")


def test_deberta_v2s_convolution_after_the_first_layer_is_refused_clearly():
    model = hf_encoder("DebertaV2", conv_kernel_size=3)
    with pytest.raises(NotImplementedError, match="convolution of its input.*conv_kernel_size=3.*not supported"):
        revify(model, preserve="meft1")
    assert type(model.deberta.encoder.layer).__name__ == "ModuleList"  # unchanged


def test_bert_fine_tunes_on_a_toy_task_from_its_own_loss_with_memory_flat_in_depth(seeded):
    """meft1 on a toy classification (the label: whether the first token is even): the first loss is
    the unconverted model's within the coupling's term, 20 AdamW steps bring it down, and a step's
    peak memory past its parameter gradients does not grow with depth (4 against 8 layers), where the
    unconverted model's does."""
    g = torch.Generator().manual_seed(seeded)
    ids = torch.randint(1, 128, (16, 24), generator=g)
    labels = ids[:, 0] % 2
    model = hf_encoder(seed=seeded, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    with torch.no_grad():
        plain_loss = model(input_ids=ids, labels=labels).loss
    revify(model, preserve="meft1")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - plain_loss.item()) <= 2**-SCALE_BITS * plain_loss.item()  # (0.015 of it seen in 12 seeds)
    assert losses[-1] < 0.8 * losses[0], losses

    def step_peak(layers, convert):
        net = hf_encoder(seed=seeded, layers=layers, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        net = revify(net, preserve="meft1") if convert else net
        net.train()
        batch = torch.randint(1, 128, (8, 48), generator=g)
        net(input_ids=batch, labels=batch[:, 0] % 2).loss.backward()  # the .grad buffers exist from here on
        return peak_memory(lambda: net(input_ids=batch, labels=batch[:, 0] % 2).loss.backward())

    assert step_peak(8, True) <= 1.25 * step_peak(4, True)
    assert step_peak(8, False) >= 1.5 * step_peak(4, False)  # what the reversible stack removes


@pytest.mark.parametrize("mode", ["meft1", "meft2"])
def test_post_norm_opt_converts_decodes_with_its_cache_trains_and_pickles(mode, seeded, tmp_path):
    """OPT with do_layer_norm_before=False (OPT-350M): the logits within the coupling's term, greedy
    generate with the library's cache equal to it without, a training step (branch dropout on) with
    finite gradients everywhere, save / load / pickle / a fresh process."""
    model = _opt(seeded, do_layer_norm_before=False)
    ids = torch.randint(4, 128, (2, 10))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    revify(model, preserve=mode, scale_bits=FUNCTION_BITS)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert relative(after, before) <= FUNCTION_BOUND
    prompt = ids[:1, :6]
    cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False))
    model.config.dropout = 0.1
    for layer in model.model.decoder.layers:
        layer.dropout = 0.1
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert_saves_and_pickles(model, ids, tmp_path)


def _bert_decoder(seed, **overrides):
    """A tiny BertLMHeadModel configured as a decoder with cross-attention (an EncoderDecoderModel's)."""
    return hf_encoder("Bert", "LMHeadModel", seed=seed, is_decoder=True, add_cross_attention=True,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("mode", ["meft1", "meft2"])
def test_bert_style_decoders_keep_their_function_with_and_without_an_encoder(mode, seeded):
    """BERT's layers as a decoder (is_decoder=True, with cross-attention): the whole layer one half, its
    causal self-attention's cache while decoding, an encoder's states through the conditioning. The
    logits with and without encoder states within the coupling's term of the library's, greedy
    decoding with the cache (the library's own generate with encoder states fails on its cache, so
    without)."""
    original = _bert_decoder(seeded)
    model = revify(copy.deepcopy(original), preserve=mode, scale_bits=16, exact=False).eval()
    ids, states = torch.randint(1, 128, (2, 9)), torch.randn(2, 5, 64)
    with torch.no_grad():
        for extra in ({}, {"encoder_hidden_states": states}):
            theirs, ours = original(input_ids=ids, **extra).logits, model(input_ids=ids, **extra).logits
            assert relative(ours, theirs) <= 2e-3
    assert_greedy_tokens_are_the_librarys(original, model.generate(ids[:, :4], max_new_tokens=5, do_sample=False),
                                          original.generate(ids[:, :4], max_new_tokens=5, do_sample=False))


def _bert2bert(seed, dropout=0.0):
    torch.manual_seed(seed)
    encoder = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=dropout,
                                      attention_probs_dropout_prob=0.0)
    decoder = transformers.BertConfig(**{**encoder.to_dict(), "is_decoder": True, "add_cross_attention": True})
    model = transformers.EncoderDecoderModel(
        transformers.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder))
    model.config.decoder_start_token_id = model.generation_config.decoder_start_token_id = 1
    model.config.pad_token_id = model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_bert2bert_converts_both_stacks_trains_against_its_twin_and_pickles(seeded, tmp_path):
    """An EncoderDecoderModel of two BERTs under meft1: both stacks (the decoder's cross-attention
    reading the encoder's states), the logits within the coupling's term and greedy generation with the
    library's cache; an exact training step against its twin (the decoder's gradients bitwise, the
    encoder's within float rounding); save / load, a pickle, a fresh process."""
    original = _bert2bert(seeded)
    model = revify(copy.deepcopy(original), preserve="meft1", scale_bits=16, exact=False).eval()
    assert [n for n, m in model.named_modules() if type(m).__name__ == "ReversibleStack"] == [
        "encoder.encoder.layer", "decoder.bert.encoder.layer"]
    ids, decoder_ids = torch.randint(2, 128, (2, 10)), torch.randint(2, 128, (2, 6))
    with torch.no_grad():
        theirs = original(input_ids=ids, decoder_input_ids=decoder_ids).logits
        assert relative(model(input_ids=ids, decoder_input_ids=decoder_ids).logits, theirs) <= 2e-3
    assert_greedy_tokens_are_the_librarys(original, model.generate(ids, max_new_tokens=5, do_sample=False),
                                          original.generate(ids, max_new_tokens=5, do_sample=False),
                                          source=dict(input_ids=ids))
    model = revify(_bert2bert(seeded, dropout=0.1), preserve="meft1").train()
    inputs = dict(input_ids=ids, decoder_input_ids=decoder_ids)
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(**inputs, labels=decoder_ids).loss, seed=seeded,
                                        preserve="meft1", encoder_side=("encoder.",))
    assert_round_trips(model, inputs, tmp_path)
