"""The RevGPT presets as Hugging Face models (issue 15): ``rev_causal_lm`` gives a revified
``GPT2LMHeadModel`` / ``LlamaForCausalLM`` with the preset's sizes: RevGPT's parameter count,
cached generation equal to greedy decoding, the save / load round trip, training equal to its
stored-activation twin."""
import copy

import pytest
import torch

from revtriton import ReversibleStack, from_pretrained, rev_causal_lm, rev_gpt
from revtriton.models import count_parameters, to_stored_activations

transformers = pytest.importorskip("transformers")

SMALL = dict(depth=2, dim=64, heads=4, vocab_size=97, block_size=64)
PRESETS = ["gpt2-tiny", "llama-tiny"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def preset_model(preset, seed, **options):
    """The preset with weights spread (std 0.3, as the library's initializer_range would) so greedy
    decoding has no near-ties between tokens."""
    torch.manual_seed(seed)
    model = rev_causal_lm(preset, **SMALL, **options)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_is_the_library_model_with_revgpts_sizes(preset):
    model = rev_causal_lm(preset, **SMALL)
    expected = transformers.GPT2LMHeadModel if preset.startswith("gpt2") else transformers.LlamaForCausalLM
    assert isinstance(model, expected) and isinstance(model, transformers.GenerationMixin)
    stacks = [m for m in model.modules() if isinstance(m, ReversibleStack)]
    assert len(stacks) == 1 and len(stacks[0]) == SMALL["depth"]
    assert count_parameters(model) == count_parameters(rev_gpt(preset, **SMALL))
    assert model.config.vocab_size == SMALL["vocab_size"] and model.config.revtriton["exact"] is True


def revgpt_state_as_hf(preset, state, depth):
    """RevGPT's state dict under the library model's names (GPT-2's Conv1D weights are [in, out])."""
    if preset.startswith("gpt2"):
        names = {"tok_embed": "transformer.wte", "pos_embed": "transformer.wpe", "norm": "transformer.ln_f",
                 "lm_head": "lm_head"}
        parts = {"f.norm": "ln_1", "f.qkv": "attn.c_attn", "f.proj": "attn.c_proj", "g.norm": "ln_2",
                 "g.fc1": "mlp.c_fc", "g.fc2": "mlp.c_proj"}
        for i in range(depth):
            names.update({f"blocks.{i}.{ours}": f"transformer.h.{i}.{theirs}" for ours, theirs in parts.items()})
        conv1d = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
        out = {}
        for key, value in state.items():
            module, leaf = key.rsplit(".", 1)
            name = f"{names[module]}.{leaf}"
            out[name] = value.t() if leaf == "weight" and name.rsplit(".", 1)[0].endswith(conv1d) else value
        return out
    names = {"tok_embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
    out = {}
    for key, value in state.items():
        module, leaf = key.rsplit(".", 1)
        if not module.startswith("blocks."):
            out[f"{names[module]}.{leaf}"] = value
            continue
        _, i, half, part = module.split(".")
        layer = f"model.layers.{i}"
        if (half, part) == ("f", "qkv"):
            q, k, v = value.split([SMALL["dim"], SMALL["dim"] // 2, SMALL["dim"] // 2])  # kv_heads 2 of 4
            out.update({f"{layer}.self_attn.q_proj.weight": q, f"{layer}.self_attn.k_proj.weight": k,
                        f"{layer}.self_attn.v_proj.weight": v})
            continue
        theirs = {("f", "norm"): "input_layernorm", ("f", "proj"): "self_attn.o_proj",
                  ("g", "norm"): "post_attention_layernorm", ("g", "gate"): "mlp.gate_proj", ("g", "up"): "mlp.up_proj",
                  ("g", "down"): "mlp.down_proj"}[half, part]
        out[f"{layer}.{theirs}.{leaf}"] = value
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_computes_revgpts_function_with_its_weights(preset, seeded):
    """The same architecture, not only the same sizes: RevGPT's weights in the library model give
    RevGPT's logits (float streams)."""
    extra = dict(rope_theta=500.0) if preset.startswith("llama") else {}  # not the library's default base
    torch.manual_seed(seeded)
    revgpt = rev_gpt(preset, **SMALL, **extra, exact=False).eval()
    with torch.no_grad():  # weights spread, so that activations reach where GELU variants differ
        for p in revgpt.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model = rev_causal_lm(preset, **SMALL, **extra, exact=False).eval()
    state = revgpt_state_as_hf(preset, revgpt.state_dict(), SMALL["depth"])
    assert sorted(state) == sorted(model.state_dict())
    model.load_state_dict(state)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 11))
    with torch.no_grad():
        expected, _ = revgpt(ids)
        got = model(input_ids=ids).logits
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("exact", [False, True])
def test_cached_generate_equals_greedy_decoding_without_a_cache(preset, exact, seeded):
    model = preset_model(preset, seeded, exact=exact).eval()
    ids = torch.randint(0, SMALL["vocab_size"] - 1, (2, 5))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         use_cache=True, pad_token_id=0, eos_token_id=None)
    expected = ids
    with torch.no_grad():
        for _ in range(6):
            expected = torch.cat([expected, model(input_ids=expected).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("preset", PRESETS)
def test_save_pretrained_then_from_pretrained_round_trip(preset, seeded, tmp_path):
    model = preset_model(preset, seeded, exact=False).eval()
    model.config.use_cache = True
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model) and loaded.config.use_cache is True
    assert loaded.config.revtriton == model.config.revtriton
    ids = torch.randint(0, SMALL["vocab_size"], (2, 7))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


@pytest.mark.parametrize("preset", PRESETS)
def test_training_step_equals_the_stored_activation_twin_bitwise(preset, seeded):
    model = preset_model(preset, seeded).train()
    twin = to_stored_activations(copy.deepcopy(model))
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    twin(input_ids=ids, labels=ids).loss.backward()
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters())]
    assert all(a is not None and torch.isfinite(a).all() for a, _ in pairs)
    assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("preset", PRESETS)
def test_token_chunk_runs_the_mlp_halves_by_rows_with_the_same_training_step(preset, seeded, tmp_path):
    """``token_chunk``: the converted MLP half (GPT-2's, LLaMA's) by chunks of 5 of the 27 token rows, the
    attention half a sample at a time with its samples' mask and positions (the first sample left-padded);
    the loss and gradients those of the whole model (float32: the chunked GEMMs and the chunk-by-chunk
    sums of the weight gradients move the last bits, 1e-5 relative is 100 ulps); cached generation (the
    attention whole while the library's cache takes the batch) the same tokens; save / load keeps it."""
    whole = preset_model(preset, seeded).train()
    chunked = preset_model(preset, seeded, token_chunk=5).train()
    stack = chunked.get_decoder().layers if preset.startswith("llama") else chunked.transformer.h
    assert isinstance(stack, ReversibleStack) and stack.token_chunk == 5
    attention, mlp = stack[0].coupling_halves()
    assert mlp.rows_independent and not attention.rows_independent and attention.samples_independent
    ids = torch.randint(0, SMALL["vocab_size"], (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    losses = [m(input_ids=ids, attention_mask=mask, labels=labels).loss for m in (whole, chunked)]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) <= 1e-5 * abs(losses[0].item())
    for p, q in zip(whole.parameters(), chunked.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * p.grad.abs().max()
    with torch.no_grad():
        tokens = [m.eval().generate(ids[1:], max_new_tokens=3, do_sample=False) for m in (whole, chunked)]
    assert torch.equal(tokens[0], tokens[1])
    chunked.save_pretrained(tmp_path)
    assert from_pretrained(tmp_path).config.revtriton["token_chunk"] == 5


def test_bad_presets_and_options_raise_clearly():
    with pytest.raises(ValueError, match="unknown RevGPT preset 'gpt3'"):
        rev_causal_lm("gpt3")
    with pytest.raises(TypeError, match=r"unexpected arguments \['layers'\]"):
        rev_causal_lm("gpt2-tiny", layers=2)
    with pytest.raises(ValueError, match="drop_path_rate has no Hugging Face equivalent"):
        rev_causal_lm("gpt2-tiny", drop_path_rate=0.1)
    with pytest.raises(ValueError, match="no dropout after the embeddings"):
        rev_causal_lm("llama-tiny", dropout=0.1)
    with pytest.raises(ValueError, match="grouped-query attention"):
        rev_causal_lm("gpt2-tiny", kv_heads=2)
    with pytest.raises(ValueError, match="token_chunk"):
        rev_causal_lm("gpt2-tiny", token_chunk=0)
