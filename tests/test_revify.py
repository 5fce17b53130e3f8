"""revify(): timm ViT, Hugging Face GPT-2 and LLaMA converted in place (random init, no downloads).

The timm model is ViT-S (width 384, 6 heads) with 3 blocks instead of 12 and 32 px images
(4 patches) instead of 224 px, to keep the CPU tests short.
"""
import copy
import pickle
import re

import pytest
import torch
import torch.nn.functional as F

from revtriton.convert import revify
from revtriton.convert.core import _parallel_residual
from revtriton.engine import ReversibleStack
from revtriton.models import to_stored_activations

from revified import assert_greedy_tokens_are_the_librarys
from test_models import check_against_twin, max_relative_grad_error

DEPTH = 3


def timm_vit(seed=0, **overrides):
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    kwargs = dict(pretrained=False, img_size=32, depth=DEPTH, num_classes=10, drop_path_rate=0.2, init_values=0.5)
    return timm.create_model("vit_small_patch16_224", **{**kwargs, **overrides})


def hf_gpt2(seed=0, **overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = dict(vocab_size=128, n_positions=64, n_embd=64, n_layer=DEPTH, n_head=4, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))


def hf_llama(seed=0, **overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **overrides}))


def hf_decoder(prefix, seed=0, **overrides):
    """A tiny ``<prefix>ForCausalLM`` of a decoder with LLaMA's layer conventions."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config_class = getattr(transformers, f"{prefix}Config")
    return getattr(transformers, f"{prefix}ForCausalLM")(config_class(**{**config, **overrides}))


def hf_mistral(seed=0, **overrides):  # a window shorter than the test rows (24 tokens): it matters
    return hf_decoder("Mistral", seed, **{"sliding_window": 16, **overrides})


def hf_qwen2(seed=0, **overrides):  # q/k/v biases
    return hf_decoder("Qwen2", seed, **overrides)


def hf_qwen3(seed=0, **overrides):  # qk-norm, and head_dim * heads (128) wider than the model (64)
    return hf_decoder("Qwen3", seed, **{"head_dim": 32, **overrides})


def hf_gemma(seed=0, **overrides):  # RMSNorm by 1 + weight, GeGLU (tanh), scaled embeddings
    return hf_decoder("Gemma", seed, **{"head_dim": 16, **overrides})


def hf_phi3(seed=0, **overrides):  # one qkv and one gate/up projection (the fused path splits them)
    return hf_decoder("Phi3", seed, **{"resid_pdrop": 0.0, "embd_pdrop": 0.0, "pad_token_id": 0, **overrides})


def hf_neox(seed=0, **overrides):  # Pythia's layers: parallel residual, rotary on a quarter of each head, biases
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH, num_attention_heads=4,
                  max_position_embeddings=64, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**{**config, **overrides}))


def hf_neox_sequential(seed=0, **overrides):  # the sequential residual and full rotary: the fused path's layers
    return hf_neox(seed, **{"use_parallel_residual": False, "rotary_pct": 1.0, **overrides})


def hf_vit(seed=0, **overrides):  # the library's own ViT (pre-norm encoder), 32 px images, 16 patches
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=DEPTH, num_attention_heads=4,
                  intermediate_size=96, num_labels=10)
    return transformers.ViTForImageClassification(transformers.ViTConfig(**{**config, **overrides}))


def hf_encoder(prefix, seed=0, **overrides):
    """A tiny ``<prefix>ForMaskedLM`` of a pre-norm encoder with BERT's layer parts (absolute positions)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = dict(vocab_size=128, hidden_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, intermediate_size=96,
                  max_position_embeddings=64, pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config_class = getattr(transformers, f"{prefix}Config")
    model = getattr(transformers, f"{prefix}ForMaskedLM")(config_class(**{**config, **overrides}))
    with torch.no_grad():  # LayerNorms off their init (ones, zeros), where normalising twice would be the identity
        for norm in model.modules():
            if isinstance(norm, torch.nn.LayerNorm):
                norm.weight.normal_(1.0, 0.3)
                norm.bias.normal_(0.0, 0.3)
    return model


def hf_roberta_pre(seed=0, **overrides):  # LayerNorms inside attention and intermediate, a final one in the model
    return hf_encoder("RobertaPreLayerNorm", seed, **overrides)


def hf_xlmr_xl(seed=0, **overrides):  # LayerNorms in attention and in the layer, a final one in the encoder
    return hf_encoder("XLMRobertaXL", seed, **overrides)


def hf_megatron(seed=0, **overrides):  # Megatron-BERT: attention.ln and the layer's ln, a loop reading outputs[0]
    return hf_encoder("MegatronBert", seed, **overrides)


def hf_bigcode(seed=0, **overrides):  # GPT-2's layer parts, multi-query attention (found by its conventions)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = dict(vocab_size=128, n_positions=64, n_embd=64, n_layer=DEPTH, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(**{**config, **overrides}))


def hf_gptj(seed=0, family="GPTJ", **overrides):
    """Parallel layers of one norm, interleaved partial rotary (found by its conventions): GPT-J, or
    CodeGen (``family``), which has its config's names."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = dict(vocab_size=128, n_positions=64, n_embd=64, n_layer=DEPTH, n_head=4, rotary_dim=8, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    config_class = getattr(transformers, f"{family}Config")
    return getattr(transformers, f"{family}ForCausalLM")(config_class(**{**config, **overrides}))


BUILDERS = {"timm_vit": timm_vit, "gpt2": hf_gpt2, "llama": hf_llama, "mistral": hf_mistral, "qwen2": hf_qwen2,
            "qwen3": hf_qwen3, "gemma": hf_gemma, "phi3": hf_phi3, "neox": hf_neox, "neox_sequential": hf_neox_sequential,
            "hf_vit": hf_vit, "roberta_pre": hf_roberta_pre, "xlmr_xl": hf_xlmr_xl, "bigcode": hf_bigcode,
            "gptj": hf_gptj}
DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"]  # LLaMA's layer conventions: model.model.layers
# Float streams' twin bound: Gemma scales its embeddings by sqrt(width) (8 here), so its streams and the float
# rounding of their rebuild are larger (5.9e-6 worst of 30 seeds against 1e-5).
FLOAT_TWIN_BOUND = {"gemma": 1e-4}
NEOX = ["neox", "neox_sequential"]  # GPT-NeoX's layers: model.gpt_neox.layers
ENCODERS = ["roberta_pre", "xlmr_xl"]  # pre-norm encoders with BERT's layer parts: model.base_model.encoder.layer
CONVENTIONS = ["bigcode", "gptj"]  # found by their layer parts, not their class: model.transformer.h
FAMILIES = [pytest.param("timm_vit", marks=pytest.mark.timm), "gpt2", *DECODERS, *NEOX, "hf_vit", *ENCODERS,
            *CONVENTIONS]
IMAGES = ("timm_vit", "hf_vit")


def make_batch(family):
    if family in IMAGES:
        return torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    ids = torch.randint(0, 128, (2, 24))
    return ids, ids


def loss_of(family, model, batch):
    inputs, labels = batch
    if family == "timm_vit":
        return F.cross_entropy(model(inputs), labels)
    if family == "hf_vit":
        return model(pixel_values=inputs, labels=labels).loss
    return model(input_ids=inputs, labels=labels).loss  # the library's own loss


def block_list(family, model):
    if family in DECODERS:
        return model.model.layers
    if family in NEOX:
        return model.gpt_neox.layers
    if family == "hf_vit":
        return model.vit.layers
    if family in ENCODERS:
        return model.base_model.encoder.layer
    if family in CONVENTIONS:
        return model.transformer.h
    return {"timm_vit": lambda: model.blocks, "gpt2": lambda: model.transformer.h}[family]()


# -- gradients and a training step --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("exact", [False, True])
def test_revified_training_step_matches_stored_activation_twin(family, exact, seeded):
    model = revify(BUILDERS[family](seed=seeded), exact=exact).train()
    assert isinstance(block_list(family, model), ReversibleStack)
    twin = to_stored_activations(copy.deepcopy(model))
    batch = make_batch(family)
    torch.manual_seed(seeded)  # same drop-path draws in both runs
    loss = loss_of(family, model, batch)
    loss.backward()
    torch.manual_seed(seeded)
    twin_loss = loss_of(family, twin, batch)
    twin_loss.backward()
    assert torch.isfinite(loss)
    check_against_twin(model, twin, loss, twin_loss, exact, FLOAT_TWIN_BOUND.get(family, 1e-5))
    before = [p.detach().clone() for p in model.parameters()]
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    # Drop-path can drop a half for the whole (2-sample) batch: its zero-initialised biases then get a
    # zero grad and stay put (measured in ~8% of seeds). Every parameter that got a gradient must move.
    moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
    assert all(m for m, p in zip(moved, model.parameters()) if p.grad is not None and p.grad.abs().max() > 0)
    assert sum(moved) >= 0.8 * len(moved)
    assert torch.isfinite(loss_of(family, model, batch))


@pytest.mark.parametrize("family", FAMILIES)
def test_token_chunk_keeps_the_gradients_of_the_whole_halves(family, seeded):
    """``revify(token_chunk=7)`` on 2 x 24 tokens: the halves that declare it (the LLaMA-style, GPT-2 and
    GPT-NeoX families') run their MLP by 7 rows and their attention a sample at a time (with its mask,
    window and positions), the others whole. Float streams, eval mode (no draws): the loss and gradients
    of the unchunked model up to float rounding (float32 GEMMs on other row counts, the weight gradients
    summed chunk by chunk: the twin bounds)."""
    whole = revify(BUILDERS[family](seed=seeded), exact=False).eval()
    chunked = revify(BUILDERS[family](seed=seeded), exact=False, token_chunk=7).eval()
    batch = make_batch(family)
    losses = [loss_of(family, model, batch) for model in (whole, chunked)]
    for loss in losses:
        loss.backward()
    check_against_twin(chunked, whole, losses[1], losses[0], False, FLOAT_TWIN_BOUND.get(family, 1e-5))


@pytest.mark.parametrize("family,groups", [("gpt2", 4), ("llama", 2), ("qwen2", 2), ("mistral", None),
                                           ("neox", None)])
def test_token_chunk_runs_a_long_samples_attention_in_head_groups(family, groups, seeded, monkeypatch):
    """``revify(token_chunk=16)`` on 2 x 64 tokens, 64 wide: a sample longer than a chunk and than its width
    runs its attention in head groups through the fused path's ops (GPT-2's 4 heads: 4 groups; LLaMA's and
    Qwen2's 2 kv heads: 2, Qwen2's q / k / v biases cut with them); on the library's modules, whole
    (Mistral's 16-token window, GPT-NeoX's partial rotary). Float streams,
    eval mode: the unchunked model's loss and gradients up to float rounding (the twin bounds)."""
    from revtriton.convert.host import _HostAttention

    parts = []
    real = _HostAttention.part_output
    monkeypatch.setattr(_HostAttention, "part_output",
                        lambda self, part, count, *args, **kwargs: parts.append(count) or real(self, part, count, *args,
                                                                                             **kwargs))
    whole = revify(BUILDERS[family](seed=seeded), exact=False).eval()
    chunked = revify(BUILDERS[family](seed=seeded), exact=False, token_chunk=16).eval()
    ids = torch.randint(0, 128, (2, 64))
    losses = [model(input_ids=ids, labels=ids).loss for model in (whole, chunked)]
    for loss in losses:
        loss.backward()
    # forward and rebuild of each of the DEPTH attention halves, a sample at a time, every group
    assert parts == ([] if groups is None else [groups] * (2 * DEPTH * 2 * groups))
    check_against_twin(chunked, whole, losses[1], losses[0], False, FLOAT_TWIN_BOUND.get(family, 1e-5))


def test_a_converted_base_model_names_positional_arguments_as_its_library_does(seeded):
    """A head may hand its base model more than the ids by position (LayoutLM's ``bbox``): they are named
    as the library's forward names them; one also given by keyword, or more than the forward takes, is
    refused by name rather than dropped."""
    model = revify(hf_llama(seeded), exact=False).eval()
    ids = torch.randint(0, 128, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        by_keyword = model.model(ids, attention_mask=mask).last_hidden_state
        by_position = model.model(ids, mask).last_hidden_state
    assert torch.equal(by_position, by_keyword)
    assert not torch.equal(by_position, model.model(ids).last_hidden_state.detach())  # the mask was used
    with pytest.raises(TypeError, match="pass arguments other than input_ids by keyword"):
        model.model(ids, mask, attention_mask=mask)
    with pytest.raises(TypeError, match="pass arguments other than input_ids by keyword"):
        model.model(ids, *([None] * 40))


def test_a_model_configured_layer_by_layer_is_refused_by_name(seeded):
    """transformers' heterogeneous configs (``is_heterogeneous``: NeoMME's per-layer windows, Gemma 4's)
    raise on a global read of a per-layer setting, which every family makes: revify refuses such a model
    by name (the conformance sweep found NeoMME's crash) and leaves it as it was."""
    model = hf_llama(seeded)
    before = [type(layer) for layer in model.model.layers]
    heterogeneous = type("HeterogeneousLlamaConfig", (type(model.config),), {"is_heterogeneous": True})
    model.config.__class__ = heterogeneous  # (transformers' own is a property of the config's class)
    with pytest.raises(NotImplementedError, match="revify: LlamaForCausalLM configures its layers one by one"):
        revify(model)
    assert [type(layer) for layer in model.model.layers] == before


@pytest.mark.parametrize("family", [pytest.param("timm_vit", marks=pytest.mark.timm), "gpt2"])
def test_dropout_path_matches_twin(family, seeded):
    """Attention / projection dropout (the unfused path) replays exactly in the recompute."""
    if family == "timm_vit":
        model = timm_vit(seeded, drop_path_rate=0.0, init_values=None, proj_drop_rate=0.1, attn_drop_rate=0.1)
    else:
        model = hf_gpt2(seeded, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)
    model = revify(model, exact=False).train()
    twin = to_stored_activations(copy.deepcopy(model))
    batch = make_batch(family)
    torch.manual_seed(seeded)
    loss_of(family, model, batch).backward()
    torch.manual_seed(seeded)
    loss_of(family, twin, batch).backward()
    assert max_relative_grad_error(model, twin) <= 1e-5


# -- the halves are the original blocks' own math ---------------------------------------------


def _capture_blocks(blocks):
    """Record each block's input and output during one forward of the unconverted model."""
    records, handles = [], []
    for block in blocks:
        record = {}
        records.append(record)

        def pre(module, args, kwargs, record=record):
            record["x"] = args[0] if args else kwargs["hidden_states"]

        def post(module, args, kwargs, out, record=record):
            record["y"] = out[0] if isinstance(out, tuple) else out

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    return records, handles


# The conventions' attention halves refuse a call outside the model (only their modules compute the layer,
# with the model's RoPE / masks): revify's probe checks their layers instead (tests/test_host_forward.py).
@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in CONVENTIONS])
def test_halves_compute_the_original_blocks(family, seeded):
    """With F and G from revify, x + F(x) + G(x + F(x)) is each original block's output (x + F(x) + G(x):
    GPT-NeoX's parallel residual)."""
    _check_halves_compute_the_original_blocks(family, BUILDERS[family](seed=seeded))


def test_qwen2_sliding_window_layers_keep_their_windows(seeded):
    """Qwen2 with use_sliding_window: the layers past max_window_layers slide (window 8 < 24 tokens)."""
    model = hf_qwen2(seeded, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    _check_halves_compute_the_original_blocks("qwen2", model)
    assert [block._revtriton_spec.window for block in model.model.layers] == [None, 8, 8]


def _check_halves_compute_the_original_blocks(family, model):
    model.eval()
    records, handles = _capture_blocks(block_list(family, model))
    inputs, _ = make_batch(family)

    def output():
        with torch.no_grad():
            if family == "timm_vit":
                return model(inputs)
            return model(pixel_values=inputs).logits if family == "hf_vit" else model(input_ids=inputs).logits

    before = output()
    for handle in handles:
        handle.remove()
    revify(model)
    with torch.no_grad():
        for record, block in zip(records, block_list(family, model)):
            f, g = block.coupling_halves()
            x = record["x"]
            h = x + f(x)
            expected = record["y"]
            got = h + g(x) if _parallel_residual(block) else h + g(h)
            err = (got - expected).abs().max() / expected.abs().max()
            assert err < 1e-5, err
    # ... and the converted model is a different function (fine-tune after converting).
    after = output()
    assert after.shape == before.shape and not torch.allclose(after, before, rtol=1e-3, atol=1e-3)


# -- state_dict, keys, errors -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_keys_unchanged_and_round_trip(family, seeded):
    original_keys = list(BUILDERS[family](seed=seeded).state_dict())
    model = revify(BUILDERS[family](seed=seeded))
    assert list(model.state_dict()) == original_keys
    batch = make_batch(family)
    loss_of(family, model, batch).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    fresh = revify(BUILDERS[family](seed=seeded + 1))
    fresh.load_state_dict(model.state_dict())  # strict
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(loss_of(family, model, batch), loss_of(family, fresh, batch))
    clone = pickle.loads(pickle.dumps(model))  # swapped classes pickle by name
    with torch.no_grad():
        assert torch.equal(loss_of(family, clone, batch), loss_of(family, model, batch))


def test_unsupported_architecture_names_the_class():
    with pytest.raises(TypeError, match=r"torch\.nn\.modules\.linear\.Linear"):
        revify(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="nn.Module"):
        revify("gpt2")


def test_hf_cache_masks_and_per_block_calls(seeded):
    model = revify(hf_gpt2(seeded))
    assert model.config.use_cache is True  # the user's setting, saved with the model (issue 15)
    assert model.generation_config.use_cache is True  # generate uses the library's cache (test_generation.py)
    ids = torch.randint(0, 128, (2, 12))
    model.train()
    out = model(input_ids=ids, labels=ids, use_cache=True)  # training: no cache, loss works
    assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    with pytest.raises(NotImplementedError, match="attention_mask must be a 2-D padding mask"):
        model(input_ids=ids, attention_mask=torch.ones(2, 11))  # padding masks: test_token_layouts.py
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model.transformer(input_ids=ids, output_attentions=True)
    with pytest.raises(NotImplementedError, match="runs only inside"):
        model.transformer.h[0](torch.randn(1, 4, 64))
    with pytest.raises(ValueError, match="already a ReversibleStack"):
        revify(model)


def test_llama_generate(seeded):
    # no EOS (a random draw of the default id 2 stopped generate early in one run), spread weights (no
    # near-tie argmax), the mask given (no token taken for padding)
    model = revify(hf_llama(seeded, initializer_range=0.3, eos_token_id=None, pad_token_id=0)).eval()
    ids = torch.randint(0, 128, (1, 6))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        step = model(input_ids=out[:, :-1]).logits[:, -1].argmax(-1)
    assert out.shape == (1, 9) and torch.equal(step, out[:, -1])


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("rope", ["dynamic", "partial"])
def test_rope_the_kernels_lack_is_the_models_own(rope, seeded):
    """Dynamic NTK scaling (frequencies change with the sequence length: 24 tokens past an original
    context of 16) and partial rotary (Phi-3, half of each head rotated): the library's own forward builds
    the rotary embedding and its attention modules apply it, so a preserving conversion computes the
    unconverted model's logits (meft3, 2**-16), cached greedy generation included."""
    config = (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0),
                   max_position_embeddings=16) if rope == "dynamic" else dict(partial_rotary_factor=0.5))
    builder = hf_llama if rope == "dynamic" else hf_phi3  # Phi-3 rotates the first rotary_ndims of each head
    original = builder(seeded, initializer_range=0.3, eos_token_id=None, pad_token_id=0, **config).eval()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=2e-3)
    prompt = ids[:, :5]
    ours = model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=True)
    assert_greedy_tokens_are_the_librarys(original, ours, original.generate(prompt, max_new_tokens=20, do_sample=False,
                                                                            use_cache=True))
    with pytest.raises(RuntimeError, match="call the model"):  # a half alone has no rotary embedding to read
        model.model.layers[0].coupling_halves()[0].branch(torch.randn(1, 4, 64))


# Original contexts of 16 < the tests' 24 tokens: the scaled frequencies matter.
SCALED_ROPE = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16, rope_theta=10000.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=10000.0),
    "linear": dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
}


@pytest.mark.parametrize("rope", sorted(SCALED_ROPE))
def test_scaled_rope_is_the_models_own(rope, seeded):
    """Llama 3, YaRN (attention scaling of cos / sin) and linear RoPE: the halves read the model's own
    rotary frequencies, so they still compute the library's blocks; a cached step matches too."""
    model = hf_llama(seeded, rope_parameters=SCALED_ROPE[rope])
    _check_halves_compute_the_original_blocks("llama", model)
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        prefix = model(input_ids=ids[:, :20], use_cache=True)
        step = model(input_ids=ids[:, 20:], cache=prefix.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step, whole[:, 20:], rtol=0, atol=5e-4)


def test_bf16_model_trains_in_exact_mode(seeded):
    model = revify(hf_llama(seeded).to(torch.bfloat16)).train()
    ids = torch.randint(0, 128, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_post_norm_encoders_raise_naming_the_feature_and_the_modes_that_work():
    """BERT-style encoders put LayerNorm after the residual add: no coupling of each branch keeps that;
    the whole layer as one half does (meft1 / meft2: tests/test_postnorm.py)."""
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    for model_class, config_class in [(transformers.BertForMaskedLM, transformers.BertConfig),
                                      (transformers.RobertaModel, transformers.RobertaConfig)]:
        with pytest.raises(NotImplementedError, match=r"post-norm layers \(a LayerNorm after each residual add\).*"
                                                      r"preserve='meft1' or 'meft2' converts it"):
            revify(model_class(config_class(**small)))


def test_a_model_no_family_takes_is_refused_naming_its_layers_and_what_to_do(seeded):
    """A model no family converts (issue 48): the error names its class, its layer list (path, count, layer
    class and parts) or that it has none, and the hand conversion (ReversibleBlock)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seeded)
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=3))
    with pytest.raises(TypeError, match=r"MambaForCausalLM: its layers \(backbone\.layers: 3 x MambaBlock, with parts "
                                        r"norm, mixer\).*ReversibleBlock\(F, G\).*supported: "):
        revify(mamba)
    with pytest.raises(TypeError, match=r"Linear: it has no list of repeated layers"):
        revify(torch.nn.Linear(3, 3))


@pytest.mark.timm
def test_timm_unsupported_models_raise_naming_the_class(seeded):
    timm = pytest.importorskip("timm")
    for name, options, cls in [("resnet18", {}, "ResNet"),  # EVA-02: tests/test_timm_eva.py
                               ("swin_tiny_patch4_window7_224", dict(img_size=32, window_size=2), "SwinTransformer"),
                               ("beit_base_patch16_224", dict(img_size=32, depth=2), "beit.Beit")]:
        with pytest.raises(TypeError, match=rf"revify does not support timm\.models\..*{cls}"):
            revify(timm.create_model(name, pretrained=False, **options))
    model = revify(timm_vit(seeded))
    with pytest.raises(NotImplementedError, match="runs only inside"):
        model.forward_features(torch.randn(1, 3, 32, 32), is_causal=True)


@pytest.mark.timm
def test_timm_qk_norm_runs_the_blocks_own_modules(seeded):
    model = timm_vit(seeded, qk_norm=True)
    _check_halves_compute_the_original_blocks("timm_vit", model)
    assert not model.blocks[0]._revtriton_fused[0] and model.blocks[0]._revtriton_fused[1]
    model.train()
    twin = to_stored_activations(copy.deepcopy(model))
    batch = make_batch("timm_vit")
    torch.manual_seed(seeded)
    loss = loss_of("timm_vit", model, batch)
    loss.backward()
    torch.manual_seed(seeded)
    twin_loss = loss_of("timm_vit", twin, batch)
    twin_loss.backward()
    check_against_twin(model, twin, loss, twin_loss, exact=True)


@pytest.mark.timm
def test_timm_fused_halves_apply_drop_path_and_layer_scale_as_the_blocks_modules(seeded):
    """In training, a fused timm half scales its rows by the stochastic-depth draw and folds LayerScale
    into its output projection: with the same draws of the halves' generators, the loss and every
    gradient equal those of the same blocks run through their own modules (float64: only the order of
    the sums differs). A fused path that dropped no rows, or forgot LayerScale, differs by its factor
    (1 / keep, gamma) whatever was drawn."""
    model = revify(timm_vit(seeded, drop_path_rate=0.5, init_values=0.5), exact=False).double().train()
    assert all(b.drop_path2.drop_prob > 0 for b in model.blocks[1:])  # timm: 0 at block 0, then rising
    inputs, labels = make_batch("timm_vit")
    inputs = inputs.double()

    def step(fused):
        for block in model.blocks:
            block._revtriton_fused = (fused, fused)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seeded)  # the halves' generators fork from it: the same draws each time
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    loss, grads = step(fused=True)
    module_loss, module_grads = step(fused=False)
    assert torch.allclose(loss, module_loss, rtol=1e-10, atol=0)
    assert grads.keys() == module_grads.keys() and len(grads) > 0.8 * len(list(model.parameters()))
    for name, grad in grads.items():
        assert torch.allclose(grad, module_grads[name], rtol=1e-9, atol=1e-12 * module_grads[name].abs().max()), name


def _pruned_features(model, k, x):
    """forward_features of the model pruned to blocks 0..k, without the final norm and prefix tokens (the
    pruned stack is a slice: the same blocks, so gradients reach the model's own parameters)."""
    blocks, norm = model.blocks, model.norm
    try:
        assert model.prune_intermediate_layers(indices=[k], prune_norm=True, prune_head=False) == [k]
        assert isinstance(model.blocks, ReversibleStack) and len(model.blocks) == k + 1
        return model.forward_features(x)[:, model.num_prefix_tokens:]
    finally:
        model.blocks, model.norm = blocks, norm


@pytest.mark.timm
@pytest.mark.parametrize("exact", [False, True])
def test_timm_forward_intermediates_are_the_pruned_models_features(exact, seeded):
    """Each intermediate is what the model pruned after that block computes (bitwise: exact streams stay
    int32 between the blocks), the final output is forward_features, and features_only models work."""
    timm = pytest.importorskip("timm")
    model = revify(timm_vit(seeded), exact=exact).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x, indices=DEPTH, output_fmt="NLC")
        assert torch.equal(final, model.forward_features(x))
        for k, got in enumerate(intermediates):
            assert torch.equal(got, _pruned_features(model, k, x)), k
    assert isinstance(model.blocks, ReversibleStack)  # the stand-in is gone
    torch.manual_seed(seeded)
    features = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, depth=DEPTH,
                                 features_only=True, out_indices=(1, 2))
    revify(features, exact=exact).eval()
    with torch.no_grad():
        out = features(x)
        # Each feature map is the pruned model's patch tokens as NCHW (2 x 2 patches here).
        expected = [_pruned_features(features.model, k, x) for k in (1, 2)]
    assert isinstance(features.model.blocks, ReversibleStack) and len(out) == 2
    for got, tokens in zip(out, expected):
        assert torch.equal(got, tokens.reshape(2, 2, 2, -1).permute(0, 3, 1, 2))


@pytest.mark.timm
def test_timm_forward_intermediates_gradients(seeded):
    """With grad, a loss on intermediates trains as the same loss on separately computed features."""
    model = revify(timm_vit(seeded, drop_path_rate=0.0), exact=False).double().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    final, intermediates = model.forward_intermediates(x, indices=DEPTH, output_fmt="NLC")
    (final.square().mean() + intermediates[1].square().mean()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}  # the head's stay None
    model.zero_grad(set_to_none=True)
    (model.forward_features(x).square().mean() + _pruned_features(model, 1, x).square().mean()).backward()
    assert sum(g is not None for g in grads.values()) > 0.8 * len(grads)
    for name, p in model.named_parameters():
        assert (grads[name] is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")


class LoraLinear(torch.nn.Module):
    """A PEFT-style wrapper: base Linear plus a low-rank update (not a plain nn.Linear)."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    @property
    def weight(self):  # what a weight-reading path would (wrongly) use: the base weight only
        return self.base.weight

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def test_wrapped_projections_are_called_not_bypassed(seeded):
    """A LoRA-wrapped projection added after revify is used (module path), and trains."""
    model = revify(hf_llama(seeded), exact=False).train()
    attn = model.model.layers[1].self_attn
    lora = LoraLinear(attn.q_proj)
    attn.q_proj = lora
    merged = torch.nn.Linear(lora.base.in_features, lora.base.out_features, bias=False)
    with torch.no_grad():
        merged.weight.copy_(lora.base.weight + lora.lora_b @ lora.lora_a)
    x = torch.randn(2, 10, 64)
    f = model.model.layers[1].coupling_halves()[0]
    with torch.no_grad():
        with_lora = f(x)
        attn.q_proj = merged
        expected = f(x)
        attn.q_proj = lora
    assert torch.allclose(with_lora, expected, rtol=1e-5, atol=1e-6)
    twin = to_stored_activations(copy.deepcopy(model))
    batch = make_batch("llama")
    loss_of("llama", model, batch).backward()
    loss_of("llama", twin, batch).backward()
    assert lora.lora_a.grad is not None and lora.lora_a.grad.abs().sum() > 0
    assert max_relative_grad_error(model, twin) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_requests_warn_and_training_still_runs(family, seeded):
    # TrainingArguments(gradient_checkpointing=True) calls gradient_checkpointing_enable(); timm users
    # call set_grad_checkpointing(): reversible blocks need neither, and neither may break the model.
    model = revify(BUILDERS[family](seed=seeded))
    with pytest.warns(UserWarning, match="gradient checkpointing is not needed"):
        if family == "timm_vit":
            model.set_grad_checkpointing(True)
        else:
            model.gradient_checkpointing_enable()
    if family == "timm_vit":
        assert model.grad_checkpointing is False and type(model).__name__ == "VisionTransformer"
    loss_of(family, model, make_batch(family)).backward()


@pytest.mark.parametrize("preserve", [None, "meft1"])
def test_peft_lora_in_either_order_gives_the_same_model(seeded, preserve):
    # revify(get_peft_model(model)) converts the PEFT model's base model; revify then LoRA was fine already.
    peft = pytest.importorskip("peft")
    from revtriton import ADAPTER_MODULES

    # (modules_to_save: revify of a PEFT model adds the adapters there itself; PEFT applied after it needs them named)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                             modules_to_save=[*ADAPTER_MODULES])

    def lora(model):
        torch.manual_seed(seeded + 1)  # the same LoRA weights in both orders
        return peft.get_peft_model(model, config)

    lora_first = revify(lora(hf_llama(seed=seeded)), preserve=preserve)
    revify_first = lora(revify(hf_llama(seed=seeded), preserve=preserve))
    assert isinstance(lora_first, peft.PeftModel)
    batch = make_batch("llama")
    losses, grads = [], []
    for model in (lora_first, revify_first):
        loss = loss_of("llama", model, batch)
        loss.backward()
        losses.append(loss)
        grads.append({n: p.grad for n, p in model.named_parameters() if "lora_" in n})
    assert torch.equal(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert g is not None and g.abs().sum() > 0 and torch.equal(g, grads[1][name]), name
    # Either way the preserving adapters train as PEFT's modules to save (a trained copy beside the original).
    for model in (lora_first, revify_first):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
        assert all(".revtriton_adapters.f.modules_to_save." in n or ".revtriton_adapters.g.modules_to_save." in n
                   for n in trainable) and bool(trainable) == (preserve is not None)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "neox", "roberta_pre"])
@pytest.mark.parametrize("options", [{}, dict(preserve="meft3", ordinary_top=1, scale_bits=4, exact=False)])
def test_save_pretrained_then_revtriton_from_pretrained_gives_the_converted_model_back(family, options, seeded,
                                                                                        tmp_path):
    from revtriton import from_pretrained

    if family in NEOX and options.get("preserve") == "meft3":  # a parallel residual: not sublayer by sublayer
        options = dict(options, preserve="meft1")
    model = revify(BUILDERS[family](seed=seeded), **options)
    with torch.no_grad():  # trained adapters (zero at conversion) must survive the round trip
        for name, p in model.named_parameters():
            if "revtriton_adapters" in name:
                p.normal_(0.0, 0.1)
    model.config.use_cache = True  # the user's setting is saved as it is
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    assert type(loaded) is type(model) and loaded.config.use_cache is True
    assert loaded.config.revtriton == model.config.revtriton
    assert list(loaded.state_dict()) == list(model.state_dict())
    batch = make_batch(family)
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loss_of(family, model, batch), loss_of(family, loaded, batch))


def test_loading_converting_and_a_preset_step_print_no_stray_line(seeded, tmp_path, capfd):
    """Issue 38: revtriton.from_pretrained of a preserving conversion (the plain class does not know the
    adapters' weights), revify and a rev_causal_lm training step write nothing to stdout / stderr
    but the library's own progress bars (tqdm). from_pretrained used to raise the library logger's
    level, which made it check a tensor-parallel plan and warn "layers were not sharded"."""
    from revtriton import from_pretrained, rev_causal_lm

    model = revify(hf_llama(seed=seeded), preserve="meft1")
    model.save_pretrained(tmp_path)
    gpt2 = hf_gpt2(seed=seeded)  # (its tiny config warns of its token ids: the test's, not revtriton's)
    capfd.readouterr()
    loaded = from_pretrained(tmp_path)
    revify(gpt2)
    lm = rev_causal_lm("gpt2", depth=1).train()
    ids = torch.randint(0, 100, (1, 8))
    lm(input_ids=ids, labels=ids).loss.backward()
    out, err = capfd.readouterr()
    progress_bar = re.compile(r"\d+%\|.*\|")
    stray = [line for line in (out + err).replace("\r", "\n").splitlines()
             if line.strip() and not progress_bar.search(line)]
    assert not stray, stray
    assert any("revtriton_adapters" in n for n, _ in loaded.named_parameters())


def test_from_pretrained_refuses_a_model_that_was_not_revified(seeded, tmp_path):
    from revtriton import from_pretrained

    hf_gpt2(seed=seeded).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not saved from a revified model"):
        from_pretrained(tmp_path)


# -- output_hidden_states -------------------------------------------------------------------------


def _base_and_names(family, model):
    if family in NEOX:
        return model.gpt_neox, "layers", "final_layer_norm"
    return (model.transformer, "h", "ln_f") if family == "gpt2" else (model.model, "layers", "norm")


def _pruned_last_hidden(family, model, k, ids):
    """The base model's output with only blocks 0..k-1 and no final norm (a slice: the same blocks)."""
    base, blocks_name, norm_name = _base_and_names(family, model)
    blocks, norm = getattr(base, blocks_name), getattr(base, norm_name)
    try:
        setattr(base, blocks_name, blocks[:k])
        setattr(base, norm_name, torch.nn.Identity())
        return base(input_ids=ids).last_hidden_state
    finally:
        setattr(base, blocks_name, blocks)
        setattr(base, norm_name, norm)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "neox"])
@pytest.mark.parametrize("exact", [False, True])
def test_output_hidden_states_are_each_blocks_readout(family, exact, seeded):
    """The library's layout (the stack's input, each block's output, the last one normed); each state is
    what the model cut after that block computes, and the logits are those of the plain forward."""
    model = revify(BUILDERS[family](seeded), exact=exact).eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        assert torch.equal(out.logits, model(input_ids=ids).logits)
        states = out.hidden_states
        assert len(states) == DEPTH + 1
        base = _base_and_names(family, model)[0]
        embedded = (base.wte(ids) + base.wpe(torch.arange(12)) if family == "gpt2" else
                    base.embed_in(ids) if family in NEOX else base.embed_tokens(ids))
        assert torch.equal(states[0], embedded)
        for k in range(1, DEPTH):
            assert torch.equal(states[k], _pruned_last_hidden(family, model, k, ids)), k
        assert torch.equal(states[-1], base(input_ids=ids).last_hidden_state)
        picked = model(input_ids=ids, output_hidden_states=[1, -1]).hidden_states
    assert picked[0] is None and torch.equal(picked[1], states[1]) and torch.equal(picked[-1], states[-1])


def test_output_hidden_states_gradients(seeded):
    """With grad, a loss on a hidden state trains as the same loss on the cut model's output."""
    model = revify(hf_llama(seeded).double(), exact=False).train()
    ids = torch.randint(0, 128, (2, 12))
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    (out.loss + out.hidden_states[2].square().mean()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (model(input_ids=ids, labels=ids).loss + _pruned_last_hidden("llama", model, 2, ids).square().mean()).backward()
    for name, p in model.named_parameters():
        assert (grads[name] is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_a_model_built_on_the_meta_device_keeps_the_fused_halves(seeded):
    """revify before the weights exist (meta device, then to_empty + load_state_dict, as FSDP2 set-ups
    do): the norms are probed at the first call, so the halves still take the fused path."""
    transformers = pytest.importorskip("transformers")
    reference = revify(hf_llama(seeded)).eval()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(reference.config)
    revify(model)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    model.model.rotary_emb.inv_freq.copy_(reference.model.rotary_emb.inv_freq)  # a non-persistent buffer
    model.eval()
    attention, mlp = model.model.layers[0].coupling_halves()
    x = torch.randn(1, 4, 64)
    assert not attention._beyond_fused(x) and not mlp._beyond_fused(x)
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, reference(input_ids=ids, use_cache=False).logits)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_hf_vit_keeps_the_library_function_and_hidden_state_layout(seeded):
    """The library's ViT (transformers 5: pre-norm layers): a preserving conversion (meft3 at 2**-16)
    computes its logits and its hidden states (the last one before the final layernorm, as ViT's)."""
    original = hf_vit(seeded).eval()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        theirs = original(pixel_values=x, output_hidden_states=True)
        ours = model(pixel_values=x, output_hidden_states=True)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=0, atol=1e-4)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == DEPTH + 1
    for a, b in zip(ours.hidden_states, theirs.hidden_states):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)


# -- GPT-NeoX: the parallel residual ------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft2"])
@pytest.mark.parametrize("parallel", [True, False])
def test_neox_preserving_conversion_keeps_the_library_function(preserve, parallel, seeded):
    """meft1 / meft2 keep the layer whole as one half, ``x + A(x) + M(x)`` for the parallel residual
    (``x + A(x) + M(x + A(x))`` else): logits and cached generation are the library model's."""
    original = hf_neox(seeded, use_parallel_residual=parallel, initializer_range=0.3).eval()
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    ids = torch.randint(1, 128, (2, 10))
    with torch.no_grad():
        theirs, ours = original(input_ids=ids).logits, model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3 * theirs.abs().max().item())
    # the plain coupling is another function: what the preserving one is for
    plain = revify(copy.deepcopy(original), exact=False).eval()
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - theirs).abs().max() > 100 * (ours - theirs).abs().max()


def test_neox_parallel_residual_refuses_meft3(seeded):
    with pytest.raises(NotImplementedError, match="use_parallel_residual=True cannot be converted with "
                                                  "preserve='meft3'"):
        revify(hf_neox(seeded), preserve="meft3")
    revify(hf_neox(seeded, use_parallel_residual=False), preserve="meft3")  # sequential sublayers: fine


def test_neox_fused_path_reads_the_interleaved_qkv_rows(seeded):
    """Full rotary and default RoPE: the attention half runs the fused op with q / k / v rows regrouped
    from GPT-NeoX's per-head interleaving; its output is the module path's (partial rotary never fuses)."""
    model = revify(hf_neox_sequential(seeded), exact=False).eval()
    attention, mlp = model.gpt_neox.layers[0].coupling_halves()
    x = torch.randn(2, 9, 64)
    assert not attention._use_modules(x) and not mlp._use_modules(x)
    with torch.no_grad():
        torch.testing.assert_close(attention(x), attention._modules(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mlp(x), mlp._modules(x), rtol=1e-5, atol=1e-6)
    partial = revify(hf_neox(seeded)).gpt_neox.layers[0].coupling_halves()[0]
    assert partial._use_modules(x)
