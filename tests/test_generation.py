"""KV-cache generation with revified Hugging Face decoders (issue 15).

Without grad a reversible stack needs no inverse, so its attention halves can run with the
library's own cache: each step feeds only the new tokens. The tokens must equal greedy decoding
without a cache (the whole prefix every step), for every conversion and stream format, and a
padded batch must decode each prompt as if alone. Decoders whose own forward revify keeps
(LLaMA and its kin on transformers 5) decode with the library's own cache, sliding windows included.
"""
import warnings

import pytest
import torch

from revtriton.convert import revify

from test_revify import hf_gemma, hf_gpt2, hf_llama, hf_mistral, hf_neox, hf_phi3, hf_qwen3

BUILDERS = {"gpt2": hf_gpt2, "llama": hf_llama, "qwen3": hf_qwen3, "gemma": hf_gemma, "phi3": hf_phi3, "neox": hf_neox}
CONVERSIONS = [pytest.param({}, id="plain"), pytest.param(dict(preserve="meft3", ordinary_top=1), id="meft3-top1")]
TOKENS = dict(bos_token_id=0, eos_token_id=None, pad_token_id=0)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def greedy_without_cache(model, ids, steps):
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_cached_generate_equals_greedy_decoding_without_a_cache(family, exact, conversion, seeded):
    if family == "neox" and conversion.get("preserve") == "meft3":  # a parallel residual: the layer stays whole
        conversion = dict(conversion, preserve="meft2")
    model = revify(BUILDERS[family](seeded, initializer_range=0.3, **TOKENS), exact=exact, **conversion).eval()
    ids = torch.randint(1, 128, (2, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "keeps no KV cache" warning: the cache is used
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             use_cache=True)
    assert torch.equal(out, greedy_without_cache(model, ids, 8))


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("exact", [False, True])
def test_a_step_with_the_cache_is_the_last_position_of_the_whole_run(family, exact, seeded):
    model = revify(BUILDERS[family](seeded), exact=exact).eval()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        prefix = model(input_ids=ids[:, :7], use_cache=True)
        cache = prefix.past_key_values
        assert cache is not None and cache.get_seq_length() == 7
        step = model(input_ids=ids[:, 7:], cache=cache, use_cache=True)
        assert cache.get_seq_length() == 9
    atol = 5e-4 if exact else 1e-5  # exact: a float difference can flip one rounding to 2**-16
    torch.testing.assert_close(prefix.logits, whole[:, :7], rtol=0, atol=atol)
    torch.testing.assert_close(step.logits, whole[:, 7:], rtol=0, atol=atol)


def test_left_padded_batch_decodes_each_prompt_as_if_alone(seeded):
    model = revify(hf_llama(seeded, initializer_range=0.3, **TOKENS)).eval()
    prompts = [torch.randint(1, 128, (n,)) for n in (7, 3)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, 7 - len(prompt):], mask[row, 7 - len(prompt):] = prompt, 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True)
    for row, prompt in zip(out, prompts):
        alone = model.generate(prompt[None], max_new_tokens=5, do_sample=False, use_cache=True)[0]
        assert torch.equal(row[7:], alone[len(prompt):])


def test_sliding_window_models_decode_with_the_librarys_cache(seeded):
    """The library's own forward and attention run, so its sliding-window cache (which drops keys
    past the window) decodes: the tokens are greedy decoding's without a cache, past the window."""
    model = revify(hf_mistral(seeded, initializer_range=0.3, sliding_window=8, **TOKENS)).eval()
    ids = torch.randint(1, 128, (1, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "keeps no KV cache" warning: the cache is used
        out = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=True)
    assert torch.equal(out, greedy_without_cache(model, ids, 10))  # 16 tokens: past the window of 8


def test_a_cache_while_training_raises(seeded):
    transformers = pytest.importorskip("transformers")
    model = revify(hf_llama(seeded)).train()
    ids = torch.randint(0, 128, (1, 6))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="KV cache"):
        model(input_ids=ids, cache=cache, labels=ids)


def test_the_default_use_cache_returns_a_cache_to_continue_from(seeded):
    """As the library's models: without grad, config.use_cache (True) keeps a cache, so a hand-written
    decoding loop feeding only the new tokens is right; with grad none is kept, and an explicit
    use_cache=True says so."""
    model = revify(hf_llama(seeded)).eval()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        prefix = model(input_ids=ids[:, :7])
        step = model(input_ids=ids[:, 7:], past_key_values=prefix.past_key_values).logits
    torch.testing.assert_close(step, whole[:, 7:], rtol=0, atol=5e-4)
    assert model(input_ids=ids).past_key_values is None  # with grad
    import revtriton.convert.host

    revtriton.convert.host._warned_grad_cache.clear()
    with warnings.catch_warnings():  # in training, as a seq2seq model hands its decoder config.use_cache: silent
        warnings.simplefilter("error")
        model.train()(input_ids=ids, use_cache=True)
    with pytest.warns(UserWarning, match="returns no KV cache with grad enabled"):
        model.eval()(input_ids=ids, use_cache=True)


def test_two_threads_decode_with_one_model(seeded):
    """The decoding state is per thread: two threads generating with one model do not mix caches."""
    import threading

    model = revify(hf_llama(seeded)).eval()
    ids = [torch.randint(0, 128, (1, n)) for n in (5, 9)]
    with torch.no_grad():
        expected = [model(input_ids=i).logits for i in ids]
    results, errors = {}, []

    def run(k):
        try:
            with torch.no_grad():
                for _ in range(10):
                    results[k] = model(input_ids=ids[k], use_cache=True)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for k in range(2):
        assert results[k].past_key_values.get_seq_length() == ids[k].shape[1]
        torch.testing.assert_close(results[k].logits, expected[k], rtol=0, atol=5e-4)


def test_another_model_inside_a_cached_forward_keeps_its_own_cache(seeded, monkeypatch):
    """A model run inside another's cached forward (a reward or draft model called from a hook) gets
    none of the outer model's decoding state."""
    outer, inner = revify(hf_llama(seeded)).eval(), revify(hf_llama(seeded + 1)).eval()
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        expected = inner(input_ids=ids, use_cache=False).logits
    seen = []
    hook = outer.model.layers[1].self_attn.q_proj.register_forward_hook(  # called on the cache path
        lambda *_: seen.append(inner(input_ids=ids, use_cache=False).logits))
    try:
        with torch.no_grad():
            out = outer(input_ids=ids, use_cache=True)
    finally:
        hook.remove()
    assert seen and all(torch.equal(logits, expected) for logits in seen)
    assert out.past_key_values.get_seq_length() == 6


def test_a_failed_cached_forward_leaves_the_cache_as_it_was(seeded):
    """An exact stream that overflows raises; the overflow report re-runs the halves. The cache keeps
    what it held before the call, not the failed step twice (also a cache that had no layers yet)."""
    transformers = pytest.importorskip("transformers")
    model = revify(hf_llama(seeded), frac_bits=28).eval()
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        cache = model(input_ids=ids).past_key_values
        assert cache.get_seq_length() == 5
        with pytest.raises(OverflowError):
            model(inputs_embeds=torch.full((1, 3, 64), 300.0), past_key_values=cache)
        empty = transformers.DynamicCache()  # no config: it creates its layers as they are first updated
        with pytest.raises(OverflowError):
            model(inputs_embeds=torch.full((1, 3, 64), 300.0), past_key_values=empty)
    assert cache.get_seq_length() == 5
    assert empty.get_seq_length() == 0 and not len(empty.layers)


def test_bad_caches_and_positions_raise_clearly(seeded):
    model = revify(hf_llama(seeded)).eval()
    ids = torch.randint(0, 128, (1, 4))
    with torch.no_grad():
        legacy = ((torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)),) * 3
        with pytest.raises(TypeError, match="legacy tuple caches"):
            model(input_ids=ids, past_key_values=legacy)
        with pytest.raises(ValueError, match="position_ids must be"):
            model(input_ids=ids, use_cache=True, position_ids=torch.arange(3)[None])
