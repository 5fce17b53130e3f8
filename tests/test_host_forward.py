"""Revified decoders keep the library's own forward (issue 15).

LLaMA and the decoders with its layer conventions, GPT-2 and GPT-NeoX keep their base model's
forward: the library
embeds, builds its masks (padding, packed rows, sliding windows, custom 4-D masks), position ids,
rotary embeddings and cache, and its layer loop meets one stand-in per layer; the last one runs the
reversible stack once, with every layer's inputs as the halves' conditioning. Attention runs fused
where the kernels compute what the library does, else through the layer's own attention module.
"""
import copy
import pickle

import pytest
import torch

from revtriton import ReversibleStack
from revtriton.convert import revify
from revtriton.models import to_stored_activations

from fresh_process import run_python
from revified import (assert_exact_step_equals_twin, assert_greedy_tokens_are_the_librarys,
                      assert_loads_in_a_fresh_process, assert_round_trips)
from test_models import check_against_twin
from test_revify import DEPTH, hf_bigcode, hf_gptj, hf_llama, hf_qwen2, hf_vit

transformers = pytest.importorskip("transformers")


def assert_trains_saves_and_pickles(model, ids, tmp_path, seed=0):
    """A revified model's exact training step (labels = the ids) bitwise equals its stored-activation
    twin's (``seed``: the same dropout draws in both); then, in eval mode, save_pretrained ->
    revtriton.from_pretrained, a pickle and a fresh process's unpickling give its logits."""
    twin = to_stored_activations(copy.deepcopy(model))
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.manual_seed(seed)
    twin_loss = twin(input_ids=ids, labels=ids).loss
    twin_loss.backward()
    check_against_twin(model, twin, loss, twin_loss, exact=True)
    assert_saves_and_pickles(model, ids, tmp_path)


def assert_saves_and_pickles(model, inputs, tmp_path, input_name="input_ids"):
    """In eval mode: save_pretrained -> revtriton.from_pretrained, a pickle and a fresh process's
    unpickling give the model's logits on ``inputs`` (its ``input_name`` argument)."""
    assert_round_trips(model, {input_name: inputs}, tmp_path)


def _count_calls(module, counts, key, pre=True):
    def hook(*_):
        counts[key] = counts.get(key, 0) + 1
    return (module.register_forward_pre_hook if pre else module.register_forward_hook)(hook)


@pytest.mark.parametrize("hidden_states", [False, True])
def test_the_librarys_forward_runs_and_the_stack_runs_once(hidden_states, seeded):
    """The library's rotary embedding runs once per forward, the stack once (block by block with
    output_hidden_states), and the loop calls no layer module: a layer's forward pre-hooks fire once,
    from the stack (which runs a block's hooks), none from the library's loop."""
    model = revify(hf_llama(seeded), exact=False)
    counts = {}
    _count_calls(model.model.rotary_emb, counts, "rotary")
    _count_calls(model.model.layers, counts, "stack")
    for layer in model.model.layers:
        _count_calls(layer, counts, "layer")
    ids = torch.randint(0, 128, (2, 8))
    out = model(input_ids=ids, labels=ids, output_hidden_states=hidden_states)
    out.loss.backward()
    assert counts == {"rotary": 1, "layer": DEPTH, **({} if hidden_states else {"stack": 1})}
    assert (out.hidden_states is not None) == hidden_states


def test_the_library_masks_each_layer_by_its_attention_kind(seeded):
    """Qwen2 with sliding and full attention layers: the library builds one mask per kind and each
    layer's attention gets its own (a preserving conversion computes the unconverted model's logits
    and loss; the window of 4 is shorter than the 12-token rows), and trains as its stored-activation
    twin."""
    layer_types = ["sliding_attention", "full_attention"] * (DEPTH // 2) + ["sliding_attention"] * (DEPTH % 2)
    original = hf_qwen2(seeded, initializer_range=0.3, use_sliding_window=True, sliding_window=4,
                        layer_types=layer_types).eval()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in one row
    labels = ids.clone()
    labels[1, :4] = -100  # the loss reads padding queries' logits for the first real label: leave it out
    real = mask.bool()
    with torch.no_grad():
        theirs = original(input_ids=ids, attention_mask=mask, labels=labels)
        ours = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        one_kind = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
        one_kind.config.layer_types = ["full_attention"] * DEPTH  # the library's masks all full
        full = one_kind(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(ours.logits[real], theirs.logits[real], rtol=0, atol=2e-3)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=0, atol=2e-3)
    assert (full[real] - ours.logits[real]).abs().max() > 1e-2  # the window mattered

    exact = revify(copy.deepcopy(original), exact=True).train()  # both kinds of layers on the library path
    twin = to_stored_activations(copy.deepcopy(exact))
    loss = exact(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    twin_loss = twin(input_ids=ids, attention_mask=mask, labels=labels).loss
    twin_loss.backward()
    check_against_twin(exact, twin, loss, twin_loss, exact=True)


def test_stand_ins_refuse_a_loop_that_skips_or_changes_layers(seeded):
    from revtriton.convert.host import _HOST_CALL, _HostCall

    model = revify(hf_llama(seeded), exact=False).eval()

    other = revify(hf_llama(seeded + 1), exact=False).eval()
    token = _HOST_CALL.set(_HostCall(model.model.layers, None, True, False))
    try:
        # Another model's layers, iterated or sliced inside this model's forward (a hook), are its layers.
        assert all(isinstance(layer, torch.nn.Module) for layer in other.model.layers)
        assert isinstance(other.model.layers[:], type(other.model.layers)) and len(other.model.layers[:]) == DEPTH
        with pytest.raises(NotImplementedError, match="every layer in order"):
            model.model.layers[1:]
        calls = model.model.layers[:]
        calls[0](torch.randn(1, 6, 64), position_embeddings=(torch.ones(1, 6, 16), torch.zeros(1, 6, 16)))
        with pytest.raises(RuntimeError, match="unchanged"):
            calls[1](torch.randn(1, 6, 64))
    finally:
        _HOST_CALL.reset(token)
    assert len(model.model.layers[:2]) == 2  # outside a forward: a stack of those layers
    with pytest.raises(NotImplementedError, match="runs only inside the stack"):
        model.model.layers[0](torch.randn(1, 6, 64))


# -- decoders admitted by their layer conventions, not their class -------------------------------


def assert_keeps_the_librarys_function(original, model, ids, *inputs):
    """A preserving conversion's logits on each of ``inputs`` (the model's keyword inputs) within its
    term of the library's, and its cached greedy generation from ``ids[:, :4]`` the library's."""
    with torch.no_grad():
        for kwargs in inputs:
            theirs = original(**kwargs, use_cache=False).logits
            ours = model(**kwargs, use_cache=False).logits  # no cache: the fused kernels where chosen
            torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    prompt = ids[:, :4]
    ours = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert_greedy_tokens_are_the_librarys(original, ours, original.generate(prompt, max_new_tokens=6, do_sample=False,
                                                                            use_cache=True))


def _decoder(family, seed, **overrides):
    torch.manual_seed(seed)
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
                  initializer_range=0.3)  # large weights: every branch shows in the logits
    config_class = getattr(transformers, {"Gemma3": "Gemma3TextConfig", "Llama4": "Llama4TextConfig"}.get(
        family, f"{family}Config"))
    return getattr(transformers, f"{family}ForCausalLM")(config_class(**{**config, **overrides})).eval()


CONVENTION_FAMILIES = {
    # attention_multiplier as the attention's scaling: the library path; residual_multiplier on both branches
    # (granite-3's 0.22: before, the probe refused it)
    "Granite": dict(residual_multiplier=0.22),
    # MiniCPM3: DeepSeek-V2's latent attention (kv heads as many as the heads) and residual_scale on both branches
    "MiniCPM3": dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
                     v_head_dim=16),
    "Olmo": {},  # LayerNorm without weights
    "SmolLM3": dict(no_rope_layer_interval=2),  # layer 1 without RoPE: its attention keeps the library path
    "Helium": {},  # interleaved rotary: the library path
    "Starcoder2": {},  # LayerNorm with bias, a GELU MLP (c_fc / c_proj)
    "Llama": dict(mlp_bias=True),  # a known family with what the fused MLP lacks
    # LayerNorm with bias, partial rotary, per-head q / k LayerNorms, a loop over self.layers, a dropout
    # on the MLP branch: the library path
    "StableLm": dict(qk_layernorm=True),
}


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("family", sorted(CONVENTION_FAMILIES))
def test_decoders_with_llamas_layer_conventions_compute_the_librarys_function(family, seeded):
    """Decoders revify finds by their layers' parts (not their class name) keep their function under a
    preserving conversion, cached greedy generation included; each layer was probed at conversion and
    branches the fused kernels would compute differently keep the layer's own modules."""
    original = _decoder(family, seeded, **CONVENTION_FAMILIES[family])
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    ids = torch.randint(1, 128, (2, 10))
    assert_keeps_the_librarys_function(original, model, ids, dict(input_ids=ids))


# Decoders whose MLP is a mixture of experts (LLaMA's layer parts otherwise): the experts run on the
# layer's own modules, each layer as its parts say (DeepSeek-V3's first layer has a gated MLP).
MOE_FAMILIES = {
    "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # GPT-OSS: its experts return the router's scores too (the layer drops them); attention sinks and
    # YaRN RoPE on the layer's own attention module
    "GptOss": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48),
    "DeepseekV3": dict(first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       n_group=1, topk_group=1, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, head_dim=8,
                       qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),  # head_dim: the rotary part's
}


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_mixture_of_experts_decoders_compute_the_librarys_function(family, seeded):
    """A preserving conversion of a mixture-of-experts decoder keeps its logits and cached greedy
    generation; a layer with a gated MLP (DeepSeek-V3's dense first layers) runs it fused, the experts'
    layers their own modules (the spec is each layer's: it was layer 0's for every layer, and
    DeepSeek-V3 raised KeyError 'gate_proj')."""
    original = _decoder(family, seeded, **MOE_FAMILIES[family])
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    ids = torch.randint(1, 128, (2, 10))
    assert_keeps_the_librarys_function(original, model, ids, dict(input_ids=ids))
    dense = MOE_FAMILIES[family].get("first_k_dense_replace", 0)
    assert [layer._revtriton_spec.fused_mlp for layer in model.model.layers] == [i < dense for i in range(DEPTH)]


def test_a_layer_that_needs_more_than_its_conventions_inputs_is_refused_naming_why(seeded, monkeypatch):
    """Gemma 4 (unified) layers share key / value states through their loop: on the probe (the
    inputs its layers' conventions give) the layer's own forward fails, and revify says so. (Its
    config is per layer, which revify refuses first: that check is lifted here to reach the probe.)"""
    if not hasattr(transformers, "Gemma4UnifiedForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4 (unified)")
    config_class = transformers.Gemma4UnifiedForCausalLM.config_class
    model = transformers.Gemma4UnifiedForCausalLM(config_class(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0))
    with pytest.raises(NotImplementedError, match="configures its layers one by one"):
        revify(model)
    import revtriton.convert

    monkeypatch.setattr(revtriton.convert, "_refuse_per_layer_config", lambda model: None)
    with pytest.raises(NotImplementedError, match=r"layer 0 \(Gemma4UnifiedTextDecoderLayer\) fails on a probe"):
        revify(model)


def test_deepseek_v3_trains_saves_and_pickles(seeded, tmp_path):
    """DeepSeek-V3 (a dense first layer, then experts; multi-head latent attention on its own module):
    an exact training step bitwise equals its stored-activation twin, and it saves, loads and pickles."""
    model = revify(_decoder("DeepseekV3", seeded, **MOE_FAMILIES["DeepseekV3"]), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path)


def test_a_decoder_found_by_its_conventions_trains_saves_and_pickles(seeded, tmp_path):
    """Granite: an exact training step bitwise equals its stored-activation twin; save_pretrained ->
    revtriton.from_pretrained converts it again (equal logits); the swapped classes pickle, and a
    fresh process finds them in transformers' module for the family; a half called alone refuses
    (what it computes differently, Granite's score scaling, only the layer's module does)."""
    from revtriton.convert import _convention_class

    model = revify(_decoder("Granite", seeded, residual_multiplier=0.22), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path)
    with pytest.raises(RuntimeError, match="call the model"):  # Granite's score scaling: its own module only
        model.model.layers[0].coupling_halves()[0](torch.randn(1, 4, 64))
    path, name, _ = _convention_class("RevifiedHostGraniteDecoderLayer")
    assert (path, name) == ("transformers.models.granite.modeling_granite", "GraniteDecoderLayer")
    assert _convention_class("RevifiedHostSeedOssModel")[:2] == ("transformers.models.seed_oss.modeling_seed_oss",
                                                                  "SeedOssModel")
    assert _convention_class("RevifiedHostNoSuchDecoderLayer") is None


# Decoders whose layers normalise each branch's output (issue 48): the library path, probed per layer.
SANDWICH_FAMILIES = {
    "Gemma2": dict(sliding_window=4),  # norms before and after each branch; sliding layers shorter than the rows
    "Olmo2": {},  # norms after each branch only; q / k norms over the whole projection
    # Gemma 2's layers, sliding and full ones each with a RoPE of their own (local theta 1e4, global 1e6)
    "Gemma3": dict(sliding_window=4, layer_types=(["sliding_attention", "full_attention"] * DEPTH)[:DEPTH]),
    # GLM-4's names (post_self_attn_layernorm / post_mlp_layernorm after the branches, post_attention_layernorm
    # before the MLP), partial rotary, a fused gate_up_proj MLP
    "Glm4": {},
    # LLaMA's pre-norm layers, their norms named otherwise (Apertus: attention_layernorm / feedforward_layernorm
    # and an xIELU MLP; VaultGemma: input_layernorm / pre_feedforward_layernorm)
    "Apertus": {}, "VaultGemma": {},
    # LLaMA's layers with their branches named otherwise: GraniteMoE's block_sparse_moe with its
    # residual_multiplier (1 by default: here 0.5, so that leaving it out shows), JetMoE's self_attention
    "GraniteMoe": dict(residual_multiplier=0.5, num_local_experts=4, num_experts_per_tok=2), "JetMoe": {},
    # GraniteMoE-Shared: a shared MLP beside the experts
    "GraniteMoeShared": dict(residual_multiplier=0.5, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=48),
    # AFMoE: Gemma 2's sandwich under other names (pre_mlp_layernorm / post_mlp_layernorm around the MLP), a
    # dense first layer then experts with a shared one, sliding layers but every second
    "Afmoe": dict(num_dense_layers=1, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                  moe_intermediate_size=48, sliding_window=4, global_attn_every_n_layers=2, layer_types=None),
    # HyperCLOVA X: post_norm1 / post_norm2 after the branches, its residual_multiplier on both (0.5: shows)
    "HyperCLOVAX": dict(residual_multiplier=0.5),
    # Llama 4: LLaMA's layers, the MLP named feed_forward (experts with a shared one, every layer: their router's
    # scores and flattened rows dropped as the layer does); chunked attention (chunks of 4 tokens: the rows of 10
    # span three) on the RoPE layers, full attention without RoPE on every second
    "Llama4": dict(attention_chunk_size=4, no_rope_layer_interval=2, num_local_experts=4, intermediate_size_mlp=96,
                   intermediate_size=48),
}


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("family", sorted(SANDWICH_FAMILIES))
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_sandwich_norm_decoders_compute_the_librarys_function(family, preserve, seeded):
    """Gemma 2, Gemma 3, OLMo 2, GLM-4, AFMoE and HyperCLOVA X (``x + post_norm(attn(norm(x)))``, then the
    MLP's), Apertus and
    VaultGemma (no norm after a branch, the norms named otherwise than LLaMA's), GraniteMoE and JetMoE (the
    branches named otherwise): a preserving conversion computes their logits on whole and left-padded
    rows, and their cached greedy generation (Gemma 3: each attention kind with its own RoPE)."""
    assert_preserved_on_whole_and_padded_rows(_sandwich_decoder(family, seeded), preserve)


def _sandwich_decoder(family, seed):
    """:func:`_decoder` with its norms' weights off their init of ones, so that a norm taken for another
    (before or after a branch, the attention's or the MLP's) shows in the logits."""
    model = _decoder(family, seed, **SANDWICH_FAMILIES[family])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def assert_preserved_on_whole_and_padded_rows(original, preserve):
    """A preserving conversion of ``original`` keeps its logits on whole and left-padded rows and its
    cached greedy generation (:func:`assert_keeps_the_librarys_function`)."""
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    ids = torch.randint(1, 128, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    assert_keeps_the_librarys_function(original, model, ids, dict(input_ids=ids),
                                       dict(input_ids=ids, attention_mask=mask))


@pytest.mark.parametrize("family", sorted(SANDWICH_FAMILIES))
def test_a_sandwich_norm_decoder_trains_saves_and_pickles(family, seeded, tmp_path):
    """An exact training step bitwise equals its stored-activation twin; save / load and a fresh
    process's unpickling give the converted model back; a half called alone refuses (its RoPE is
    the model's)."""
    model = revify(_sandwich_decoder(family, seeded), exact=True).train()
    ids = torch.randint(1, 128, (2, 10))
    if family == "JetMoe":  # (the library's own save / load of JetMoE is not bitwise: its logits come back
        # about 3e-6 off, unconverted too; the exact step and a pickle are)
        assert_exact_step_equals_twin(model, lambda m: m(input_ids=ids, labels=ids).loss, seed=seeded)
        with torch.no_grad():
            model.eval()
            assert torch.equal(pickle.loads(pickle.dumps(model))(input_ids=ids).logits, model(input_ids=ids).logits)
    else:
        assert_trains_saves_and_pickles(model, ids, tmp_path, seed=seeded)
    with pytest.raises(RuntimeError, match="call the model"):
        model.model.layers[0].coupling_halves()[0](torch.randn(1, 4, 64))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve,parallel", [("meft3", False), ("meft1", True)], ids=["sequential", "parallel"])
def test_stablelm_drops_what_its_mlp_dropout_drops(preserve, parallel, seeded):
    """StableLM's one branch dropout sits on the MLP's output (not the attention's): at p = 1 the MLP
    branch is zero in training, so a preserving conversion computes the library's training-mode
    logits (no random draw decides them); one that dropped the dropout, or put it on the attention
    branch, would not."""
    build = _parallel_decoder if parallel else _decoder
    assert_training_logits_are_the_librarys(build("StableLm", seeded, hidden_dropout=1.0), preserve)


def assert_training_logits_are_the_librarys(original, preserve):
    """A preserving conversion of ``original`` computes its training-mode logits (its dropouts at
    p = 1: no random draw decides them)."""
    original.train()
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).train()
    ids = torch.randint(1, 128, (2, 10))
    with torch.no_grad():
        theirs = original(input_ids=ids, use_cache=False).logits
        ours = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


def test_stablelm_with_its_mlp_dropout_trains_saves_and_pickles(seeded, tmp_path):
    """StableLM (issue 48): its one branch dropout (``dropout``, on the MLP's output) is the MLP half's,
    replayed in the rebuild: an exact training step bitwise equals its stored-activation twin; save /
    load and a fresh process's unpickling give the converted model back."""
    model = revify(_decoder("StableLm", seeded, hidden_dropout=0.1), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path, seed=seeded)


class _WrappedGraniteModel(transformers.GraniteModel):
    """A base model whose own forward does not show its layer loop (a library class: revify admits
    only transformers' own models by their conventions)."""

    __module__ = "transformers.models.granite.modeling_granite"

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class _HalvedGraniteLayer(transformers.models.granite.modeling_granite.GraniteDecoderLayer):
    """LLaMA's layer parts, another function: its output halved."""

    __module__ = "transformers.models.granite.modeling_granite"

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * 0.5


def test_layers_that_are_not_llamas_raise_and_leave_the_model_as_it_was(seeded):
    """A layer with other parts (LLaMA's and a norm after the attention) is named; a layer whose parts
    match but whose function does not (its output halved) fails the probe; the model is unchanged."""
    extra = _decoder("Granite", seeded)  # admitted by its layers' parts, not its class
    for layer in extra.model.layers:
        layer.attention_out_norm = torch.nn.LayerNorm(64)
    with pytest.raises(NotImplementedError, match="has attention_out_norm besides LLaMA's"):
        revify(extra)
    wrapped = _decoder("Granite", seeded)
    wrapped.model.__class__ = _WrappedGraniteModel
    with pytest.raises(NotImplementedError, match=r"does not run its layers as one slice \(self.layers\[...\]\) or a"):
        revify(wrapped)
    original = _decoder("Granite", seeded)
    for layer in original.model.layers:
        layer.__class__ = _HalvedGraniteLayer
    model = copy.deepcopy(original)
    with pytest.raises(NotImplementedError, match="does not compute LLaMA's pre-norm layer"):
        revify(model)
    assert not any(hasattr(layer, "_revtriton_spec") for layer in model.model.layers)
    assert type(model.model.layers) is torch.nn.ModuleList and type(model) is type(original)
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits)


def _bigcode(seed, **overrides):  # weights off their small init, a padding id
    return hf_bigcode(seed, **{"initializer_range": 0.3, "pad_token_id": 0, **overrides}).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("multi_query", [True, False])
def test_decoders_with_gpt2s_layer_conventions_compute_the_librarys_function(multi_query, seeded):
    """GPTBigCode (StarCoder / SantaCoder), admitted by GPT-2's layer parts: a preserving conversion
    keeps its logits (padded rows included) and cached greedy generation; its attention (one shared
    key / value head, or q / k / v interleaved per head) runs its own module, its MLP (nn.Linear
    where GPT-2 has Conv1D) the fused kernels, as the probe found."""
    original = _bigcode(seeded, multi_query=multi_query)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    spec = model.transformer.h[0]._revtriton_spec
    assert not spec.fused_attention and spec.fused_mlp
    ids = torch.randint(1, 128, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        for inputs in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask)):
            theirs = original(**inputs).logits
            ours = model(**inputs, use_cache=False).logits
            torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())
    prompt = ids[:, :4]
    ours = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert_greedy_tokens_are_the_librarys(original, ours, original.generate(prompt, max_new_tokens=6, do_sample=False,
                                                                            use_cache=True))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_gpt2s_other_heads_take_the_convention_path_with_the_fused_halves(seeded):
    """GPT2ForSequenceClassification (not a named family): GPT-2's layers found by their parts, probed,
    and the fused halves kept (GPT-2's own projections); its logits under a preserving conversion."""
    torch.manual_seed(seeded)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=DEPTH, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, num_labels=3, pad_token_id=0,
                                     initializer_range=0.3)
    original = transformers.GPT2ForSequenceClassification(config).eval()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    spec = model.transformer.h[0]._revtriton_spec
    assert spec.fused_attention and spec.fused_mlp
    ids = torch.randint(1, 128, (2, 10))
    with torch.no_grad():
        theirs = original(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


def test_a_gpt2_style_decoder_trains_saves_and_pickles(seeded, tmp_path):
    """GPTBigCode: an exact training step bitwise equals its stored-activation twin; save_pretrained ->
    revtriton.from_pretrained converts it again; a fresh process unpickles its swapped classes."""
    from revtriton.convert import _convention_class

    model = revify(_bigcode(seeded), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path)
    module = "transformers.models.gpt_bigcode.modeling_gpt_bigcode"
    assert _convention_class("RevifiedHostGPT2StyleOrdinaryGPTBigCodeBlock")[:2] == (module, "GPTBigCodeBlock")
    assert _convention_class("RevifiedHostGPT2StyleGPTBigCodeModel")[:2] == (module, "GPTBigCodeModel")


class _HalvedBlock(transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeBlock):
    def forward(self, *args, **kwargs):
        return 0.5 * super().forward(*args, **kwargs)


def test_gpt2_style_layers_that_differ_raise_and_leave_the_model_as_it_was(seeded):
    """OpenAI GPT's post-norm blocks have GPT-2's part names, called otherwise: named by the probe,
    unchanged; a block whose parts match but whose function does not (its output scaled, as a residual
    multiplier would) fails the probe, unchanged; cross-attention is named."""
    gpt = transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(vocab_size=128, n_positions=64, n_embd=64,
                                                                          n_layer=2, n_head=4))
    with pytest.raises(NotImplementedError, match="OpenAIGPTLMHeadModel layer 0 .Block. does not compute GPT-2's"):
        revify(gpt)
    assert type(gpt.transformer.h) is torch.nn.ModuleList
    assert not any(hasattr(block, "_revtriton_spec") for block in gpt.transformer.h)
    original = _bigcode(seeded)
    for block in original.transformer.h:
        block.__class__ = _HalvedBlock
    model = copy.deepcopy(original)
    with pytest.raises(NotImplementedError, match="does not compute GPT-2's pre-norm layer"):
        revify(model)
    assert type(model.transformer.h) is torch.nn.ModuleList
    assert not any(hasattr(block, "_revtriton_spec") for block in model.transformer.h)
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits)
    with pytest.raises(NotImplementedError, match="ln_cross_attn"):
        revify(_bigcode(seeded, add_cross_attention=True, multi_query=False))


def test_a_base_model_converted_alone_loads_back_by_its_library_class(seeded, tmp_path):
    """save_pretrained writes the model's class name into its config's architectures: a base model
    converted alone (GPT2Model, as an embedding model's) writes the library's name, not the swapped
    class's, so revtriton.from_pretrained finds its class without model_class= (before: a ValueError);
    a pickle and a fresh process find the swapped class by its qualified name."""
    import json

    torch.manual_seed(seeded)
    model = revify(transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100)))
    loaded = assert_round_trips(model, dict(input_ids=torch.randint(0, 100, (2, 6))), tmp_path,
                                output="last_hidden_state")
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GPT2Model"]
    assert type(loaded).__qualname__ == type(model).__qualname__ == "RevifiedHostGPT2Model"


def _gpt_neo(seed, **overrides):
    """A tiny GPT-Neo: global and local layers (a window of 3, shorter than the test's rows), no scaling of
    its scores, a GELU MLP of nn.Linear; norms off their init (a norm taken for another would show)."""
    torch.manual_seed(seed)
    config = dict(vocab_size=128, hidden_size=64, num_layers=DEPTH, num_heads=4, window_size=3,
                  attention_types=[[["global", "local"], DEPTH // 2], [["global"], DEPTH % 2]],
                  max_position_embeddings=64, intermediate_size=96, embed_dropout=0.0, attention_dropout=0.0,
                  resid_dropout=0.0, pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.3)
    config["attention_types"] = [kinds for kinds in config["attention_types"] if kinds[1]]
    model = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(**{**config, **overrides})).eval()
    _norms_off_their_init(model)
    return model


def _image_gpt(seed, **overrides):
    """A tiny ImageGPT: GPT-2's layers with its own norm (no bias, no centring), a loop reading outputs[0]."""
    torch.manual_seed(seed)
    config = dict(vocab_size=129, n_positions=64, n_embd=64, n_layer=DEPTH, n_head=4, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3)
    model = transformers.ImageGPTForCausalImageModeling(transformers.ImageGPTConfig(**{**config, **overrides}))
    _norms_off_their_init(model.eval())
    return model


def _norms_off_their_init(model):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".ln_" in name:
                parameter.uniform_(0.5, 1.5) if name.endswith("weight") else parameter.normal_(0.0, 0.3)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_gpt_neo_keeps_the_librarys_function(preserve, seeded):
    """GPT-Neo, admitted by GPT-2's layer parts (its loop reads outputs[0]): its attention module (local
    layers' windows, unscaled scores, the model's cache while decoding) runs as it is, its MLP on the fused
    kernels (the probe found them equal); a preserving conversion computes the library's logits on whole
    and left-padded rows and its cached greedy generation."""
    original = _gpt_neo(seeded)
    assert_preserved_on_whole_and_padded_rows(original, preserve)
    spec = revify(copy.deepcopy(original), preserve=preserve).transformer.h[0]._revtriton_spec
    assert not spec.fused_attention and spec.fused_mlp


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_gpt_neo_drops_what_its_dropout_drops(seeded):
    """GPT-Neo's resid_dropout sits on each branch's output inside its modules: at p = 1 both branches are
    zero in training, so a preserving conversion computes the library's training-mode logits."""
    assert_training_logits_are_the_librarys(_gpt_neo(seeded, resid_dropout=1.0), "meft3")


@pytest.mark.parametrize("kind", ["GPTNeo", "ImageGPT"])
def test_gpt_neo_and_image_gpt_train_save_and_pickle(kind, seeded, tmp_path):
    """An exact training step with their dropouts bitwise equals its stored-activation twin; save / load
    and a fresh process's unpickling give the converted model back (their swapped classes found again by
    name); a half called alone refuses (the mask is the model's)."""
    from revtriton.convert import _convention_class

    make, block, base = ((_gpt_neo, "GPTNeoBlock", "GPTNeoModel") if kind == "GPTNeo" else
                         (_image_gpt, "ImageGPTBlock", "ImageGPTModel"))
    dropouts = (dict(embed_dropout=0.1, attention_dropout=0.1, resid_dropout=0.1) if kind == "GPTNeo" else
                dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    model = revify(make(seeded, **dropouts), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path, seed=seeded)
    module = f"transformers.models.{'gpt_neo' if kind == 'GPTNeo' else 'imagegpt'}.modeling_" \
             f"{'gpt_neo' if kind == 'GPTNeo' else 'imagegpt'}"
    assert _convention_class(f"RevifiedHostGPT2StyleOrdinary{block}")[:2] == (module, block)
    assert _convention_class(f"RevifiedHostGPT2Style{base}")[:2] == (module, base)
    with pytest.raises(RuntimeError, match="call the model"):
        model.transformer.h[0].coupling_halves()[0](torch.randn(1, 4, 64))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_image_gpt_keeps_the_librarys_function(seeded):
    """ImageGPT, admitted by GPT-2's layer parts: its norm is not LayerNorm, so both halves run its layer's
    own modules (the probe found the fused ones differ); a preserving conversion computes the library's
    logits and its cached greedy generation."""
    original = _image_gpt(seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    spec = model.transformer.h[0]._revtriton_spec
    assert not spec.fused_attention and not spec.fused_mlp
    ids = torch.randint(1, 128, (2, 10))
    assert_keeps_the_librarys_function(original, model, ids, dict(input_ids=ids))


def _parallel_decoder(family, seed, **overrides):  # one norm, attention and MLP in parallel
    common = dict(initializer_range=0.3, pad_token_id=0)
    if family in ("GPTJ", "CodeGen"):  # layers h: ln_1, attn, mlp; interleaved partial rotary
        return hf_gptj(seed, family, **{**common, **overrides}).eval()
    torch.manual_seed(seed)
    # Phi (partial rotary, resid_dropout on both branches), Cohere (interleaved rotary, logit scale)
    config = dict(common, vocab_size=128, bos_token_id=None, eos_token_id=None, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=DEPTH, num_attention_heads=4, max_position_embeddings=64)
    if family == "StableLm":  # its parallel form (dropout on the MLP branch only); its default is 32 kv heads
        config.update(use_parallel_residual=True, num_key_value_heads=2)
    if family == "FalconNew":  # Falcon's new decoder architecture: a norm per branch (ln_attn, ln_mlp), 2 kv
        family = "Falcon"      # heads, ALiBi (the model adds it to the mask) and biases
        config.update(new_decoder_architecture=True, num_kv_heads=2, alibi=True, bias=True)
    config_class = getattr(transformers, f"{family}Config")
    model = getattr(transformers, f"{family}ForCausalLM")(config_class(**{**config, **overrides})).eval()
    with torch.no_grad():  # norms off their init (ones, zeros): two norms of a layer then differ
        for norm in model.modules():
            if isinstance(norm, torch.nn.LayerNorm):
                norm.weight.normal_(1.0, 0.3)
                norm.bias.normal_(0.0, 0.3)
    return model


# Falcon (input_layernorm, self_attention, mlp; RoPE): its loop reads outputs[0] of layers returning a tuple
PARALLEL_FAMILIES = ["GPTJ", "CodeGen", "Phi", "Cohere", "StableLm", "Falcon", "FalconNew"]


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("family", PARALLEL_FAMILIES)
@pytest.mark.parametrize("preserve", ["meft1", "meft2"])
def test_decoders_with_parallel_layers_compute_the_librarys_function(family, preserve, seeded):
    """GPT-J, CodeGen, Phi, Cohere, StableLM (x + attn(norm(x)) + mlp(norm(x)), their own rotary): a preserving
    conversion that keeps each layer whole computes their logits on whole, padded and packed rows,
    and their cached greedy generation."""
    original = _parallel_decoder(family, seeded)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    ids = torch.randint(1, 128, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, with the positions generate would use
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = torch.cat([torch.arange(6), torch.arange(4)])[None].expand(2, 10)
    assert_keeps_the_librarys_function(original, model, ids, dict(input_ids=ids),
                                       dict(input_ids=ids, attention_mask=mask, position_ids=positions),
                                       dict(input_ids=ids, position_ids=packed))


@pytest.mark.parametrize("family", PARALLEL_FAMILIES)
def test_decoders_with_parallel_layers_refuse_meft3(family, seeded):
    """meft3 (sublayer after sublayer) cannot compose a parallel layer's two branches: refused."""
    with pytest.raises(NotImplementedError, match="meft3"):
        revify(_parallel_decoder(family, seeded), preserve="meft3")


@pytest.mark.parametrize("family", ["GPTJ", "Phi", "StableLm", "Falcon", "FalconSequential"])
def test_a_decoder_with_parallel_layers_trains_saves_and_pickles(family, seeded, tmp_path):
    """An exact training step (Phi: with its dropout on both branches; StableLM: on the MLP branch;
    Falcon: its hidden_dropout, a probability, on both; its sequential layers: attention_dropout on the
    attention branch too) bitwise equals its stored-activation twin; save / load and a fresh process's
    unpickling give the converted model back; a half called alone refuses (its RoPE is the model's)."""
    dropout = dict(Phi=dict(resid_pdrop=0.1), StableLm=dict(hidden_dropout=0.1), Falcon=dict(hidden_dropout=0.1),
                   FalconSequential=dict(parallel_attn=False, hidden_dropout=0.1, attention_dropout=0.1))
    builder = family.removesuffix("Sequential")
    model = revify(_parallel_decoder(builder, seeded, **dropout.get(family, {})), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path, seed=seeded)
    with pytest.raises(RuntimeError, match="call the model"):
        model.base_model.get_submodule("layers" if family in ("Phi", "StableLm") else "h")[0].coupling_halves()[0](
            torch.randn(1, 4, 64))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_falcons_sequential_layers_keep_the_librarys_function(preserve, seeded):
    """Falcon with parallel_attn=False (Falcon-RW: input_layernorm, self_attention, then
    post_attention_layernorm and mlp; ALiBi in the model's mask): a preserving conversion, meft3's
    sublayers included, computes the library's logits on whole and left-padded rows and its cached
    greedy generation."""
    assert_preserved_on_whole_and_padded_rows(_parallel_decoder("Falcon", seeded, parallel_attn=False, alibi=True),
                                              preserve)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("dropped", ["mlp", "attention"])
def test_falcons_sequential_layers_drop_what_their_dropouts_drop(dropped, seeded):
    """Falcon's sequential layer drops its attention's output with config.attention_dropout and its MLP's
    with hidden_dropout: with one of them at p = 1 (the other 0) that branch is zero in training, so
    meft3's sublayers compute the library's training-mode logits; a half that took the other
    probability would not. (Eager attention with biases: its own dropout of the probabilities at p = 1
    leaves the projection's bias, which only the branch dropout removes.)"""
    p = dict(mlp=dict(hidden_dropout=1.0, attention_dropout=0.0),
             attention=dict(hidden_dropout=0.0, attention_dropout=1.0, bias=True, attn_implementation="eager"))
    original = _parallel_decoder("Falcon", seeded, parallel_attn=False, **p[dropped])
    with torch.no_grad():
        for layer in original.transformer.h:
            if layer.self_attention.dense.bias is not None:  # (initialised to zeros)
                layer.self_attention.dense.bias.normal_(0.0, 0.3)
    assert_training_logits_are_the_librarys(original, "meft3")


def test_falcons_hidden_dropout_drops_each_branch(seeded):
    """Falcon's hidden_dropout (a probability its layer applies to the sum of both branches) drops each
    half's branch: at p = 1 a training-mode forward computes what the same conversion computes with
    both branches' output projections zeroed and no dropout (a half that kept its branch would not)."""
    original = _parallel_decoder("Falcon", seeded, hidden_dropout=1.0)
    dropped = revify(copy.deepcopy(original)).train()
    silent = revify(copy.deepcopy(original)).train()
    with torch.no_grad():
        for layer in silent.transformer.h:
            layer.hidden_dropout = 0.0
            for projection in (layer.self_attention.dense, layer.mlp.dense_4h_to_h):
                projection.weight.zero_()
        ids = torch.randint(1, 128, (2, 10))
        assert torch.equal(dropped(input_ids=ids).logits, silent(input_ids=ids).logits)
        assert not torch.equal(dropped.eval()(input_ids=ids).logits, silent.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("head", ["LlamaForSequenceClassification", "GPT2DoubleHeadsModel"])
def test_head_classes_warn_on_checkpointing_and_unpickle_in_a_fresh_process(head, seeded, tmp_path):
    """Any head around a converted base model (a classifier, GPT-2's double heads): a gradient-
    checkpointing request warns (it would be ignored: the stand-ins never call the layers one by one),
    and a fresh process finds the swapped head class by its name in transformers."""
    torch.manual_seed(seeded)
    if head.startswith("Llama"):
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=DEPTH, num_attention_heads=4, num_key_value_heads=2,
                                          num_labels=3, pad_token_id=0)
    else:
        config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=DEPTH, n_head=4)
    model = revify(getattr(transformers, head)(config)).eval()
    assert type(model).__name__ == head  # config.architectures stays the library's
    with pytest.warns(UserWarning, match="gradient checkpointing is not needed"):
        model.gradient_checkpointing_enable()
    ids = torch.randint(1, 128, (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits  # the classifier's, the double heads' LM logits
    assert_loads_in_a_fresh_process(model, {"input_ids": ids}, expected, tmp_path)


def test_an_unpickled_gpt2_runs_the_fused_halves_in_a_fresh_process(seeded, tmp_path):
    """GPT-2's projections are transformers' Conv1D: a process that converted nothing (it only
    unpickles a converted model) still takes them for the fused kernels, as the converting process
    did (it ran the layers' modules, other rounding, before: a saved model's logits changed on load)."""
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=DEPTH, n_head=4)
    model = revify(transformers.GPT2LMHeadModel(config)).eval()
    halves = [half for block in model.transformer.h for half in block.coupling_halves()]
    x = torch.randn(1, 4, 64)
    assert not any(half._use_modules(x) for half in halves)
    torch.save(model, tmp_path / "whole.pt")
    fresh = ("import sys, torch; model = torch.load(sys.argv[1], weights_only=False); "
             "halves = [half for block in model.transformer.h for half in block.coupling_halves()]; "
             "x = torch.randn(1, 4, 64); sys.exit(1 if any(half._use_modules(x) for half in halves) else 0)")
    run_python(fresh, tmp_path / "whole.pt", check=True)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def _opt(seed, **overrides):
    torch.manual_seed(seed)
    config = dict(hidden_size=64, ffn_dim=96, num_attention_heads=4, num_hidden_layers=DEPTH, vocab_size=128,
                  max_position_embeddings=64, word_embed_proj_dim=64, pad_token_id=0, init_std=0.3)
    config = transformers.OPTConfig(**{**config, **overrides})
    return transformers.OPTForCausalLM(config).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_opt_keeps_the_librarys_function(preserve, seeded):
    """OPT (issue 48): pre-norm layers with other names (self_attn_layer_norm, fc1 / fc2,
    final_layer_norm), learned positions: a preserving conversion computes the library's logits on
    whole and left-padded rows and its cached greedy generation."""
    assert_preserved_on_whole_and_padded_rows(_opt(seeded), preserve)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_opts_sequence_classifier_converts_its_base_model(seeded):
    """OPTForSequenceClassification: revify finds its OPTModel as a part and converts that model's decoder
    (the conformance sweep caught a crash when the family looked for layers on the OPTModel itself)."""
    torch.manual_seed(seeded)
    original = transformers.OPTForSequenceClassification(_opt(seeded).config).eval()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert type(model.model.decoder.layers).__name__ == "ReversibleStack"
    ids = torch.randint(1, 128, (2, 10))
    with torch.no_grad():
        theirs, ours = original(input_ids=ids).logits, model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")
def test_opt_drops_what_its_dropout_drops(seeded):
    """OPT's dropout sits on each branch's output: at p = 1 both branches are zero in training, so a
    preserving conversion computes the library's training-mode logits (no random draw decides them);
    one that left the dropout out would not."""
    assert_training_logits_are_the_librarys(_opt(seeded, dropout=1.0), "meft1")


def test_opt_with_its_dropout_trains_saves_and_pickles(seeded, tmp_path):
    """An exact training step with OPT's branch dropout bitwise equals its stored-activation twin;
    save / load and a fresh process's unpickling give the converted model back; a half called alone
    refuses (the mask is the model's); layerdrop is refused, named, and post-norm OPT (350M) but under
    meft1 / meft2 (tests/test_postnorm.py)."""
    model = revify(_opt(seeded, dropout=0.1), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path, seed=seeded)
    with pytest.raises(RuntimeError, match="call the model"):
        model.model.decoder.layers[0].coupling_halves()[0](torch.randn(1, 4, 64))
    with pytest.raises(NotImplementedError, match="do_layer_norm_before=False has post-norm.*'meft1' or 'meft2'"):
        revify(_opt(seeded, do_layer_norm_before=False))
    with pytest.raises(NotImplementedError, match="layerdrop=0.1"):
        revify(_opt(seeded, layerdrop=0.1))


def _opt_like(kind, seed, **overrides):
    """A tiny XGLM or BioGPT causal LM: OPT's pre-norm layers (sinusoidal / learned positions before
    the loop), a dropout after the activation too."""
    torch.manual_seed(seed)
    if kind == "XGLM":
        config = transformers.XGLMConfig(vocab_size=128, d_model=64, ffn_dim=96, num_layers=DEPTH, attention_heads=4,
                                         max_position_embeddings=64, pad_token_id=0, init_std=0.3, **overrides)
        return transformers.XGLMForCausalLM(config).eval()
    config = transformers.BioGptConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH,
                                       num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                                       initializer_range=0.3, **overrides)
    return transformers.BioGptForCausalLM(config).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", ["XGLM", "BioGpt"])
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_models_with_opts_layers_keep_the_librarys_function(kind, preserve, seeded):
    """XGLM and BioGPT have OPT's pre-norm layers: a preserving conversion computes their logits on whole
    and left-padded rows and their cached greedy generation; their dropout after the activation is
    kept (at p = 1 the MLP branch is zero in training: the library's training-mode logits)."""
    assert_preserved_on_whole_and_padded_rows(_opt_like(kind, seeded), preserve)
    no_other_dropout = (dict(dropout=0.0, attention_dropout=0.0) if kind == "XGLM" else
                        dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    assert_training_logits_are_the_librarys(_opt_like(kind, seeded, activation_dropout=1.0, **no_other_dropout),
                                            preserve)


@pytest.mark.parametrize("kind", ["XGLM", "BioGpt"])
def test_models_with_opts_layers_train_save_and_pickle(kind, seeded, tmp_path):
    """An exact training step with their dropouts bitwise equals its stored-activation twin; save / load
    and a fresh process's unpickling give the converted model back; XGLM's cross-attention is refused."""
    model = revify(_opt_like(kind, seeded, dropout=0.1, activation_dropout=0.1), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path, seed=seeded)
    if kind == "XGLM":
        with pytest.raises(NotImplementedError, match="cross-attention layers are not supported"):
            revify(_opt_like(kind, seeded, add_cross_attention=True))


def _mpt(seed, dropout=0.0):
    """A tiny MPT causal LM (ALiBi, LayerNorms without bias, an MLP that adds its residual itself);
    ``dropout``: its attention's, residual's and MLP's (attn_pdrop, which transformers 5.25's config
    types as an int: set on the modules)."""
    torch.manual_seed(seed)
    config = transformers.MptConfig(d_model=64, n_heads=4, n_layers=DEPTH, expansion_ratio=2, max_seq_len=64,
                                    vocab_size=128, pad_token_id=0, initializer_range=0.3)
    model = transformers.MptForCausalLM(config).eval()
    for block in model.transformer.blocks:
        block.attn.attn_dropout_p, block.resid_attn_dropout.p, block.ffn.hidden_dropout = dropout, dropout, dropout
    return model


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_mpt_keeps_the_librarys_function(preserve, seeded):
    """MPT: pre-norm blocks with ALiBi (the model's biases, handed to every block as position_bias, in the
    conditioning) and an MLP that adds its residual itself (the half passes zero): a preserving conversion
    computes the library's logits on whole and left-padded rows and its cached greedy generation."""
    assert_preserved_on_whole_and_padded_rows(_mpt(seeded), preserve)


def test_mpt_with_its_dropout_trains_saves_and_pickles(seeded, tmp_path):
    """An exact training step with MPT's dropouts bitwise equals its stored-activation twin; save / load
    and a fresh process's unpickling give the converted model back; a half called alone refuses (the
    mask and ALiBi are the model's)."""
    model = revify(_mpt(seeded, dropout=0.1), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path, seed=seeded)
    with pytest.raises(RuntimeError, match="call the model"):
        model.transformer.blocks[0].coupling_halves()[0](torch.randn(1, 4, 64))


def _bloom(seed, head="BloomForCausalLM", **overrides):
    torch.manual_seed(seed)
    config = dict(vocab_size=128, hidden_size=64, n_layer=DEPTH, n_head=4, pad_token_id=0, bos_token_id=None,
                  eos_token_id=None, initializer_range=0.3, num_labels=3)
    model = getattr(transformers, head)(transformers.BloomConfig(**{**config, **overrides})).eval()
    with torch.no_grad():  # norms off their init (ones, zeros), where a norm left out would change nothing
        for norm in model.modules():
            if isinstance(norm, torch.nn.LayerNorm):
                norm.weight.normal_(1.0, 0.3)
                norm.bias.normal_(0.0, 0.3)
    return model


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_bloom_keeps_the_librarys_function(preserve, seeded):
    """BLOOM (issue 48): pre-norm layers whose attention and MLP add the residual themselves, ALiBi
    built from the mask and handed to every layer, a loop reading outputs[0]: a preserving conversion
    computes the library's logits on whole and left-padded rows (ALiBi follows the padding) and its
    cached greedy generation."""
    assert_preserved_on_whole_and_padded_rows(_bloom(seeded), preserve)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")
def test_bloom_drops_what_its_dropout_drops(seeded):
    """BLOOM's hidden_dropout sits on each branch's output (inside its modules, before their residual add):
    at p = 1 both branches are zero in training, so a preserving conversion computes the library's
    training-mode logits; a half that added a residual of its own, or kept a branch, would not."""
    assert_training_logits_are_the_librarys(_bloom(seeded, hidden_dropout=1.0), "meft3")


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # the classifier: inference
def test_bloom_with_its_dropout_trains_saves_and_pickles(seeded, tmp_path):
    """An exact training step with BLOOM's dropout bitwise equals its stored-activation twin; save / load
    and a fresh process's unpickling give the converted model back; a half called alone refuses (the mask
    and ALiBi are the model's); a classification head converts and keeps its logits (meft1); layers that
    add the norm's output back (apply_residual_connection_post_layernorm) are refused, named."""
    model = revify(_bloom(seeded, hidden_dropout=0.1), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path, seed=seeded)
    with pytest.raises(RuntimeError, match="call the model"):
        model.transformer.h[0].coupling_halves()[0](torch.randn(1, 4, 64))
    original = _bloom(seeded, head="BloomForSequenceClassification")
    classifier = revify(copy.deepcopy(original), preserve="meft1", scale_bits=16, exact=False).eval()
    ids = torch.randint(1, 128, (2, 10))
    with torch.no_grad():
        theirs = original(input_ids=ids).logits
        torch.testing.assert_close(classifier(input_ids=ids).logits, theirs, rtol=0,
                                   atol=2e-3 * theirs.abs().max().item())
    refused = _bloom(seeded, apply_residual_connection_post_layernorm=True)
    with pytest.raises(NotImplementedError, match="apply_residual_connection_post_layernorm=True has layers that add "
                                                  "each norm's output back.*preserve='meft1' or 'meft2' converts it"):
        revify(refused)
    assert type(refused.transformer.h) is torch.nn.ModuleList


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_bloom_adding_its_norms_output_back_converts_whole_under_meft1(seeded):
    """BLOOM with apply_residual_connection_post_layernorm (each sublayer adds its norm's output back, not
    its input): meft1 keeps the whole layer as one half (as for post-norm layers), computing the library's
    logits on whole and left-padded rows and its cached greedy generation."""
    assert_preserved_on_whole_and_padded_rows(_bloom(seeded, apply_residual_connection_post_layernorm=True), "meft1")


# The decoders issue 48 added, as revify(model) converts them (the function changed, exact streams).
NEW_DECODERS = {"Falcon": lambda seed: _parallel_decoder("Falcon", seed),
                "FalconNew": lambda seed: _parallel_decoder("FalconNew", seed),
                "FalconSequential": lambda seed: _parallel_decoder("Falcon", seed, parallel_attn=False, alibi=True),
                "Bloom": _bloom, "Gemma2": lambda seed: _decoder("Gemma2", seed, **SANDWICH_FAMILIES["Gemma2"]),
                "Gemma3": lambda seed: _decoder("Gemma3", seed, **SANDWICH_FAMILIES["Gemma3"]),
                "Olmo2": lambda seed: _decoder("Olmo2", seed), "StableLm": lambda seed: _decoder("StableLm", seed),
                "StableLmParallel": lambda seed: _parallel_decoder("StableLm", seed), "OPT": _opt}


@pytest.mark.parametrize("family", sorted(NEW_DECODERS))
def test_converted_decoders_generate_the_same_with_and_without_their_cache(family, seeded):
    """revify(model) of the decoders issue 48 added (Falcon: parallel, new architecture, sequential; BLOOM,
    Gemma 2 and 3, OLMo 2, StableLM sequential and parallel, OPT): greedy decoding with the library's cache
    (its modules, the conditioning of each step) gives the tokens decoding without it gives (the whole
    sequence through the reversible stack at every step)."""
    model = revify(NEW_DECODERS[family](seeded)).eval()
    prompt = torch.randint(1, 128, (2, 4))
    cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False))


def _modernbert(seed, **overrides):
    """A tiny ModernBertForMaskedLM: layers 0 and 2 global attention (RoPE theta 160000), layer 1 local
    (a 4-token window, theta 10000)."""
    torch.manual_seed(seed)
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH, num_attention_heads=4,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                  global_attn_every_n_layers=2, local_attention=4, initializer_range=0.3)
    model = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**{**config, **overrides})).eval()
    with torch.no_grad():  # norms off their init (ones), where a norm taken for another would change nothing
        for norm in model.modules():
            if isinstance(norm, torch.nn.LayerNorm):
                norm.weight.normal_(1.0, 0.3)
    return model


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_modernbert_keeps_the_librarys_function(preserve, seeded):
    """ModernBERT (issue 48): pre-norm layers (attn_norm, attn, mlp_norm, mlp; the first layer's attn_norm the
    identity) whose global and local attention layers each take their kind's mask and RoPE, and a loop that
    reads each layer's attention_type: a preserving conversion computes the library's logits and hidden
    states on whole rows and its logits on right-padded ones."""
    original = _modernbert(seeded)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    ids = torch.randint(3, 128, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():  # (hidden states: the stack runs block by block, a layer's inputs its own)
        for kwargs in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=mask),
                       dict(input_ids=ids, output_hidden_states=True)):
            theirs, ours = original(**kwargs), model(**kwargs)
            assert len(ours.hidden_states or ()) == len(theirs.hidden_states or ())
            for mine, library in zip((ours.logits, *(ours.hidden_states or ())),
                                     (theirs.logits, *(theirs.hidden_states or ()))):
                torch.testing.assert_close(mine, library, rtol=0, atol=2e-3 * library.abs().max().item())


def test_modernbert_with_its_dropouts_trains_saves_and_pickles(seeded, tmp_path):
    """An exact training step with ModernBERT's attention and MLP dropouts bitwise equals its stored-activation
    twin; save / load and a fresh process's unpickling give the converted model back; a half called alone
    refuses (the masks and RoPE are the model's)."""
    model = revify(_modernbert(seeded, attention_dropout=0.1, mlp_dropout=0.1), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(3, 128, (2, 10)), tmp_path, seed=seeded)
    with pytest.raises(RuntimeError, match="call the model"):
        model.model.layers[1].coupling_halves()[0](torch.randn(1, 4, 64))


def _modernbert_decoder(seed, **overrides):
    """A tiny ModernBertDecoderForCausalLM: layers 0 and 2 global attention, layer 1 local (a 4-token
    window), each kind with its RoPE."""
    torch.manual_seed(seed)
    config = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH, num_attention_heads=4,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                  global_attn_every_n_layers=2, local_attention=4, initializer_range=0.3)
    return transformers.ModernBertDecoderForCausalLM(transformers.ModernBertDecoderConfig(**{**config, **overrides}))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_modernbert_decoder_keeps_the_librarys_function(preserve, seeded):
    """ModernBERT's decoder: ModernBERT's layers, causal, global and local attention each with its mask
    and RoPE: a preserving conversion computes the library's logits on whole and left-padded rows and
    its cached greedy generation."""
    assert_preserved_on_whole_and_padded_rows(_modernbert_decoder(seeded).eval(), preserve)


def test_modernbert_decoder_with_its_dropouts_trains_saves_and_pickles(seeded, tmp_path):
    model = revify(_modernbert_decoder(seeded, attention_dropout=0.1, mlp_dropout=0.1), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(3, 128, (2, 10)), tmp_path, seed=seeded)


def _dinov2(seed, registers=False, **overrides):
    torch.manual_seed(seed)
    prefix = "Dinov2WithRegisters" if registers else "Dinov2"
    extra = dict(num_register_tokens=2) if registers else {}
    config = getattr(transformers, f"{prefix}Config")(hidden_size=64, num_hidden_layers=DEPTH, num_attention_heads=4,
                                                      mlp_ratio=2, image_size=32, patch_size=8, num_labels=3,
                                                      layerscale_value=0.5, **extra, **overrides)
    return getattr(transformers, f"{prefix}ForImageClassification")(config).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("registers", [False, True], ids=["plain", "registers"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["mlp", "swiglu"])
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_dinov2_keeps_the_librarys_function(preserve, swiglu, registers, seeded):
    """DINOv2 (issue 48), with registers too: ``x + drop_path(layer_scale(attention(norm1(x))))``, then
    the MLP's (or its SwiGLU MLP's): a preserving conversion computes the library's logits."""
    original = _dinov2(seeded, registers, use_swiglu_ffn=swiglu)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        theirs, ours = original(pixel_values=x).logits, model(pixel_values=x).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


@pytest.mark.parametrize("registers", [False, True], ids=["plain", "registers"])
def test_dinov2_with_drop_path_trains_saves_and_pickles(registers, seeded, tmp_path):
    """An exact training step with drop-path bitwise equals its stored-activation twin (the same draws,
    replayed in the rebuild); the one parameter without a gradient is the library's own (the mask
    token, used only with bool_masked_pos); save / load, a pickle and a fresh process's unpickling
    give the converted model back."""
    model = revify(_dinov2(seeded, registers, drop_path_rate=0.2), exact=True).train()
    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    assert_exact_step_equals_twin(model, lambda m: m(pixel_values=x, labels=labels).loss, seed=seeded)
    base = "dinov2_with_registers" if registers else "dinov2"
    assert [name for name, p in model.named_parameters() if p.grad is None] == [f"{base}.embeddings.mask_token"]
    assert_saves_and_pickles(model, x, tmp_path, input_name="pixel_values")


def _beit(seed, head="ForImageClassification", shared=False, per_layer=True, kind="Beit", **overrides):
    """A tiny BEiT (or Data2Vec-vision, ``kind``): layer scale, relative position biases (the model's shared
    one and / or each layer's), their tables off their zero init so that a bias taken for another, or at
    another size, shows."""
    torch.manual_seed(seed)
    config = getattr(transformers, f"{kind}Config")(
        hidden_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, intermediate_size=96, image_size=32,
        patch_size=8, num_labels=3, layer_scale_init_value=0.5, use_relative_position_bias=per_layer,
        use_shared_relative_position_bias=shared, use_mask_token=True, initializer_range=0.3, **overrides)
    model = getattr(transformers, f"{kind}{head}")(config).eval()
    with torch.no_grad():
        for name, table in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                table.normal_(0.0, 0.5)
    return model


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", ["Beit", "Data2VecVision"])
@pytest.mark.parametrize("bias", ["per-layer", "shared", "both", "none"])
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_beit_keeps_the_librarys_function(preserve, bias, kind, seeded):
    """BEiT: ``x + drop_path(lambda_1 * attention(layernorm_before(x)))`` with the relative position
    biases added to the attention's mask (the shared one by the model, each layer's own by the layer, at
    the image's resolution): a preserving conversion computes the library's logits and hidden states,
    at the size it was built for and at another (interpolate_pos_encoding: each layer's bias made at
    the resolution the loop passes)."""
    original = _beit(seeded, shared=bias in ("shared", "both"), per_layer=bias in ("per-layer", "both"), kind=kind)
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    for size, interpolate in (((32, 32), False), ((48, 40), True)):
        kwargs = dict(pixel_values=torch.randn(2, 3, *size), interpolate_pos_encoding=interpolate)
        with torch.no_grad():
            theirs, ours = original(**kwargs, output_hidden_states=True), model(**kwargs, output_hidden_states=True)
            logits = model(**kwargs).logits  # (the whole stack at once)
        for mine, library in zip((logits, ours.logits, *ours.hidden_states), (theirs.logits, theirs.logits,
                                                                              *theirs.hidden_states)):
            torch.testing.assert_close(mine, library, rtol=0, atol=2e-3 * library.abs().max().item())


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_beits_masked_image_modeling_keeps_the_librarys_function(seeded):
    """BeitForMaskedImageModeling: its mask token replaces masked patches before the layers, its head
    reads every token; converted, it computes the library's logits."""
    original = _beit(seeded, "ForMaskedImageModeling", shared=True)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    x, masked = torch.randn(2, 3, 32, 32), torch.rand(2, 16) < 0.4
    with torch.no_grad():
        theirs = original(pixel_values=x, bool_masked_pos=masked).logits
        ours = model(pixel_values=x, bool_masked_pos=masked).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


@pytest.mark.parametrize("kind", ["Beit", "Data2VecVision"])
def test_beit_with_drop_path_trains_saves_and_pickles(kind, seeded, tmp_path):
    """An exact training step with drop-path and dropout, on images of another size than it was built
    for, bitwise equals its stored-activation twin (the rebuild makes each layer's relative position
    bias again, at the resolution in the conditioning, with the forward's attention kernel);
    every bias table gets a gradient; a half called alone runs at the size the layer was built for;
    save / load, a pickle and a fresh process's unpickling give the converted model back."""
    model = revify(_beit(seeded, shared=True, drop_path_rate=0.2, hidden_dropout_prob=0.1, kind=kind),
                   exact=True).train()
    x, labels = torch.randn(2, 3, 48, 40), torch.tensor([0, 2])  # (not the size it was built for)
    assert_exact_step_equals_twin(
        model, lambda m: m(pixel_values=x, labels=labels, interpolate_pos_encoding=True).loss, seed=seeded)
    base = "beit" if kind == "Beit" else "data2vec_vision"
    assert [name for name, p in model.named_parameters() if p.grad is None] == [f"{base}.embeddings.mask_token"]
    tables = [p for name, p in model.named_parameters() if name.endswith("relative_position_bias_table")]
    # (each table's gradient is the twin's, bitwise; a layer whose attention branch drop-path dropped for
    # both samples gives its own table a zero one)
    assert len(tables) == DEPTH + 1 and all(p.grad is not None for p in tables)
    attention = (model.beit.layers if kind == "Beit" else model.data2vec_vision.encoder.layer)[0].coupling_halves()[0]
    assert attention(torch.randn(2, 17, 64)).shape == (2, 17, 64)
    assert_saves_and_pickles(model.eval(), x[..., :32, :32], tmp_path, input_name="pixel_values")


def _vit_like(kind, seed):
    """DeiT with its distillation token and teacher head, or ViT-MAE's pretraining model (a masking
    encoder of ViT's layers, a small decoder): tiny, weights off their small init."""
    torch.manual_seed(seed)
    config = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH, num_attention_heads=4, image_size=32,
                  patch_size=8, initializer_range=0.3)
    if kind == "DeiT":
        return transformers.DeiTForImageClassificationWithTeacher(transformers.DeiTConfig(**config, num_labels=3))
    if kind in ("IJepa", "ViTMSN"):
        return getattr(transformers, f"{kind}ForImageClassification")(getattr(transformers, f"{kind}Config")(
            **config, num_labels=3))
    return transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(
        **config, mask_ratio=0.5, decoder_num_hidden_layers=1, decoder_hidden_size=32, decoder_intermediate_size=48,
        decoder_num_attention_heads=4))


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("kind", ["DeiT", "ViTMAE", "IJepa", "ViTMSN"])
def test_models_with_vits_layers_convert_as_vit(kind, seeded, tmp_path):
    """DeiT, ViT-MAE (its encoder; the decoder's layers stay ordinary), I-JEPA and ViT-MSN have ViT's
    layers: a preserving conversion keeps their logits (MAE: the same masking noise); an exact training
    step's loss and gradients are bitwise the stored-activation twin's; DeiT and I-JEPA save, load and
    pickle."""
    original = _vit_like(kind, seeded).eval()
    pixels = torch.randn(2, 3, 32, 32)
    inputs = dict(pixel_values=pixels) if kind != "ViTMAE" else dict(pixel_values=pixels, noise=torch.rand(2, 16))
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    with torch.no_grad():
        theirs, ours = original(**inputs).logits, model(**inputs).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())

    model = revify(copy.deepcopy(original), exact=True).train()
    encoder = getattr(model, {"DeiT": "deit", "IJepa": "ijepa"}.get(kind, "vit"))
    assert isinstance(encoder.layers, ReversibleStack)
    # (a DeiT with its teacher head returns no loss; MAE's pooler takes no part)
    assert_exact_step_equals_twin(model, lambda m: m(**inputs).loss if kind == "ViTMAE" else
                                  m(**inputs).logits.square().mean())
    assert all(p.grad is not None for name, p in encoder.named_parameters() if ".layers." in name)
    if kind in ("DeiT", "IJepa"):
        assert_saves_and_pickles(model, pixels, tmp_path, input_name="pixel_values")


def test_hf_vit_takes_the_librarys_patch_mask(seeded, monkeypatch):
    """HF ViT runs its own forward too: an attention_mask over the patches (the library builds its
    bidirectional mask) reaches its attention modules, so a preserving conversion computes the
    unconverted model's logits; without a mask the fused halves run, with one the library's modules."""
    original = hf_vit(seeded, initializer_range=0.3).eval()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    pixels = torch.randn(2, 3, 32, 32)
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[1, 5:] = 0  # the second image attends to its first 4 patches (and the class token) only
    import revtriton.convert.hf_vit

    fused_calls = []  # the attention halves' fused path (their couples may run bound: ops.dispatch.run_bound)
    half = revtriton.convert.hf_vit._HFViTAttentionHalf
    real = half._fused
    monkeypatch.setattr(half, "_fused", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    with torch.no_grad():
        theirs = original(pixel_values=pixels, attention_mask=mask).logits
        ours = model(pixel_values=pixels, attention_mask=mask).logits
        assert not fused_calls  # the mask: the library's attention modules
        unmasked = model(pixel_values=pixels).logits
        assert len(fused_calls) == DEPTH  # no mask: the fused attention half in every block
        torch.testing.assert_close(unmasked, original(pixel_values=pixels).logits, rtol=0, atol=2e-3)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)
    # The unmasked image: the library's modules and the fused halves round differently in fp32 (up
    # to 1.5e-5 over 40 seeds at this init), so the same 2e-3 as above; the mask moves the other by > 1.
    torch.testing.assert_close(ours[0], unmasked[0], rtol=0, atol=2e-3)
    assert (ours[1] - unmasked[1]).abs().max() > 0.1

