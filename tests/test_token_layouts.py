"""Padding masks and packed sequences in revified Hugging Face decoders (issue 15).

A revified GPT-2 / LLaMA takes a 2-D ``attention_mask`` (right or left padding, with the
position_ids generate makes) and packed rows (``position_ids`` restarting per sequence, no mask:
DataCollatorWithFlattening's format), as the library's own models do. Each real token then gets
the logits and the gradients it gets when its sequence runs alone; training goes through the
engine (the layout is conditioning of every attention half and of ``ordinary_top`` blocks), so the
stored-activation twin must agree as everywhere else (bitwise in exact mode).
"""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from revtriton.convert import revify
from revtriton.models import to_stored_activations
from revtriton.ops import dispatch
from revtriton.ops.attention import packed_segments, sequence_mask

from revified import assert_greedy_tokens_are_the_librarys
from test_models import check_against_twin, max_relative_grad_error
from test_revify import (FLOAT_TWIN_BOUND, hf_gemma, hf_gpt2, hf_llama, hf_mistral, hf_neox, hf_neox_sequential,
                         hf_phi3, hf_qwen2, hf_qwen3)

BUILDERS = {"gpt2": hf_gpt2, "llama": hf_llama, "mistral": functools.partial(hf_mistral, sliding_window=4),
            "qwen2": hf_qwen2, "qwen3": hf_qwen3, "gemma": hf_gemma, "phi3": hf_phi3,  # Mistral: a window < sequences
            "neox": hf_neox, "neox_sequential": hf_neox_sequential}
# meft3 with an ordinary top block: the layout reaches whole-layer halves with adapters and a stage
# transition (meft1's top G adapter feeds the stream nobody reads: no gradient to compare).
CONVERSIONS = [pytest.param({}, id="plain"), pytest.param(dict(preserve="meft3", ordinary_top=1), id="meft3-top1")]
LENGTHS = (10, 7, 4)


def conversion_of(family, conversion):
    """meft3 splits a layer into its sublayers: GPT-NeoX's parallel residual keeps it whole (meft2)."""
    if family == "neox" and conversion.get("preserve") == "meft3":
        return dict(conversion, preserve="meft2")
    return conversion


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def sequences(lengths=LENGTHS):
    return [torch.randint(0, 128, (n,)) for n in lengths]


def padded(seqs, side):
    """(input_ids, attention_mask, position_ids) of the sequences padded to the longest, as HF builds them
    (left padding: the positions generate computes, mask.cumsum - 1)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        where = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, where], mask[i, where] = s, 1
    positions = None if side == "right" else (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def real_tokens(rows, seqs, side):
    width = rows.shape[1]
    return torch.cat([row[: len(s)] if side == "right" else row[width - len(s):] for row, s in zip(rows, seqs)])


def packed(seqs):
    """One row of every sequence, position_ids restarting at 0 (DataCollatorWithFlattening)."""
    return torch.cat(seqs)[None], torch.cat([torch.arange(len(s)) for s in seqs])[None]


def alone_logits(model, seqs):
    return torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])


# -- the layout helpers -------------------------------------------------------------------------


def test_packed_segments_follow_the_position_restarts():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [3, 4, 5, 6, 0, 1, 2, 3]])
    assert packed_segments(positions).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4], [1, 1, 1, 1, 2, 2, 2, 2]]


def test_sequence_mask_sees_its_own_sequence_causally_and_never_padding():
    segments = torch.tensor([[0, 1, 1, 2, 2, 0]])
    mask = sequence_mask(segments, causal=True)[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0],   # padding with no real key before it: itself (finite)
                             [0, 1, 0, 0, 0, 0],
                             [0, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0],   # sequence 2 does not see sequence 1
                             [0, 0, 0, 1, 1, 0],
                             [0, 1, 1, 1, 1, 0]]   # padding sees the real keys, as the library's masks
    both_ways = sequence_mask(segments, causal=False)[0, 0].int()
    assert both_ways[1].tolist() == [0, 1, 1, 0, 0, 0] and both_ways[0].tolist() == [0, 1, 1, 1, 1, 0]
    window = sequence_mask(torch.ones(1, 5, dtype=torch.long), causal=True, window=2)[0, 0].int()
    assert window.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


# -- each real token as if its sequence ran alone -------------------------------------------------


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_padded_and_packed_rows_give_each_sequence_alone(family, exact, conversion, seeded):
    model = revify(BUILDERS[family](seeded), exact=exact, **conversion_of(family, conversion)).eval()
    # Float rounding differs between a row and its sequence alone (~1e-7); exact streams round every
    # half output to 2**-16, so such a difference can flip a rounding: one grid step (1.5e-5) per flip,
    # carried to the logits (at most 1.2e-4 over 40 seeds; a token that saw another sequence: ~0.1).
    atol = 5e-4 if exact else 1e-5
    seqs = sequences()
    layout = dict(use_cache=False)  # no cache: the layout reaches the fused path (a cache: the library's modules)
    with torch.no_grad():
        alone = alone_logits(model, seqs)
        for side in ("right", "left"):
            ids, mask, positions = padded(seqs, side)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **layout).logits
            assert torch.isfinite(logits).all()  # padding rows too
            stepped = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True,
                            **layout)
            assert torch.equal(stepped.logits, logits)  # block by block, with the same layout
            torch.testing.assert_close(real_tokens(logits, seqs, side), alone, rtol=0, atol=atol)
        ids, positions = packed(seqs)
        torch.testing.assert_close(model(input_ids=ids, position_ids=positions, **layout).logits[0], alone, rtol=0,
                                   atol=atol)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_packed_gradients_are_the_sum_over_sequences_alone(family, seeded):
    """Training on a packed row (labels -100 at each sequence start, as the collator sets them) gives
    the gradients of the sequences trained one by one: no gradient crosses a sequence boundary."""
    model = revify(BUILDERS[family](seeded).double(), exact=False).train()  # float64: only the layout differs
    seqs = sequences()
    ids, positions = packed(seqs)
    labels = ids.clone()
    starts = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0)[:-1].tolist()])
    labels[0, starts] = -100  # the library's loss shifts labels: no token predicts across a boundary
    total_tokens = sum(len(s) - 1 for s in seqs)
    (model(input_ids=ids, position_ids=positions, labels=labels).loss * total_tokens).backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for s in seqs:
        # One padding token after the sequence (never seen: attention is causal) sends it through the
        # same layout path as the packed row; the library's RMSNorm rounds to float32 where the fused
        # path does not, and only the layout is under test here.
        ids, mask = torch.cat([s, s[:1]])[None], torch.ones(1, len(s) + 1, dtype=torch.long)
        mask[0, -1] = 0
        labels = ids.masked_fill(mask == 0, -100)
        (model(input_ids=ids, attention_mask=mask, labels=labels).loss * (len(s) - 1)).backward()
    # Gemma's own RMSNorm, and Qwen3's q / k RMSNorms (the library's, in its attention), compute in float32
    # whatever the model's dtype: float32 rounding of inputs that differ by float64 noise between a packed
    # row and a sequence alone (Qwen3: a float32 ulp, 6e-6 relative on a gradient, under 1 seed in 4).
    tolerance = dict(rtol=1e-4, atol=1e-8) if family in ("gemma", "qwen3") else dict(rtol=1e-9, atol=1e-12)
    for (name, p), g in zip(model.named_parameters(), packed_grads):
        torch.testing.assert_close(g, p.grad, **tolerance, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_padded_training_step_matches_the_stored_activation_twin(family, exact, conversion, seeded):
    model = revify(BUILDERS[family](seeded), exact=exact, **conversion_of(family, conversion)).train()
    twin = to_stored_activations(copy.deepcopy(model))
    ids, mask, positions = padded(sequences(), "left")
    labels = ids.masked_fill(mask == 0, -100)

    def loss_of(m):
        return m(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss

    loss, twin_loss = loss_of(model), loss_of(twin)
    loss.backward()
    twin_loss.backward()
    if exact or not conversion:
        check_against_twin(model, twin, loss, twin_loss, exact, FLOAT_TWIN_BOUND.get(family, 1e-5))
    else:  # float meft3: each block's rebuild amplifies rounding by 2**12 (perf/reconstruction.py)
        torch.testing.assert_close(loss, twin_loss, rtol=1e-6, atol=0)
        assert max_relative_grad_error(model, twin) <= 1e-4


def test_llama_generate_with_left_padding_gives_each_prompt_alone(seeded):
    model = revify(hf_llama(seeded, initializer_range=0.3, eos_token_id=None, pad_token_id=0)).eval()  # no EOS stop
    prompts = sequences((6, 3))
    ids, mask, _ = padded(prompts, "left")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    for row, prompt in zip(out, prompts):
        # (the mask said outright: generate would take a token 0 of the prompt for padding)
        alone = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=4,
                               do_sample=False, pad_token_id=0)[0]
        assert torch.equal(row[ids.shape[1]:], alone[len(prompt):])


# -- bad layouts raise ------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_masks_and_positions_of_the_wrong_shape_raise(family, seeded):
    model = revify(BUILDERS[family](seeded))
    ids = torch.randint(0, 128, (2, 6))
    with pytest.raises(NotImplementedError, match="2-D padding mask"):
        model(input_ids=ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="position_ids must be"):
        model(input_ids=ids, position_ids=torch.arange(5)[None])


def test_layout_reaches_the_halves_only_when_rows_are_not_whole_sequences(seeded, monkeypatch):
    """All-ones masks and default positions keep the fused path (no mask built); RoPE positions that
    are not 0..T-1 (LLaMA) or a padded row take the layout (use_cache=False: no decoding)."""
    from revtriton.ops import attention

    model = revify(hf_llama(seeded), exact=False).eval()
    calls = []
    real = attention.sequence_mask
    monkeypatch.setattr(attention, "sequence_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, 128, (2, 6))
    whole = torch.ones_like(ids)
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(model(input_ids=ids, attention_mask=whole, position_ids=torch.arange(6)[None],
                                         use_cache=False).logits, plain, rtol=0, atol=0)
        assert not calls
        # A mask, so the gap is not read as packing: RoPE sees the positions, relative distances change.
        gapped = torch.tensor([[0, 1, 2, 10, 11, 12]])
        moved = model(input_ids=ids, attention_mask=whole, position_ids=gapped, use_cache=False).logits
        decoded = model(input_ids=ids, attention_mask=whole, position_ids=gapped).logits  # the cache path: the same
        torch.testing.assert_close(decoded, moved, rtol=0, atol=1e-5)
    assert calls and (moved - plain)[:, 3:].abs().max() > 1e-3
    torch.testing.assert_close(moved[:, :3], plain[:, :3], rtol=0, atol=1e-5)  # the first three see the same


# -- the Hugging Face Trainer with its collators ----------------------------------------------


def _pad_right(features):
    """A padding collator (what DataCollatorWithPadding + labels does, without a tokenizer)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_flash_attention_varlen_inputs_must_mark_the_packed_sequences(seeded):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds cu_seq_lens / max_length to the
    restarting position_ids: the same logits as the position_ids alone; cu_seq_lens that disagree with
    them, or come without them, raise instead of joining or splitting sequences silently."""
    from transformers import DataCollatorWithFlattening

    model = revify(hf_llama(seeded), exact=False).eval()  # float streams: alone within 1e-5
    seqs = sequences()
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in seqs])
    batch.pop("labels")
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q"} <= set(batch)
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        assert torch.equal(model(**batch).logits, expected)
        torch.testing.assert_close(expected[0], alone_logits(model, seqs), rtol=0, atol=1e-5)
        wrong = dict(batch, cu_seq_lens_q=torch.tensor([0, 5, 21], dtype=torch.int32))
        with pytest.raises(ValueError, match="does not mark the sequences"):
            model(**wrong)
        without = {key: value for key, value in batch.items() if key != "position_ids"}
        with pytest.raises(NotImplementedError, match="without position_ids"):
            model(**without)


def _packing_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """A CPU stand-in for flash attention's packing rule: no mask (the tests using it pass none), packed
    sequences found from restarting ``position_ids`` in the call's keyword inputs (as transformers'
    ``_flash_attention_forward`` finds them without ``cu_seq_lens``); SDPA inside."""
    assert attention_mask is None, "the stand-in covers packed rows without a padding mask only"
    batch, heads, tokens, _ = query.shape
    key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    allowed = torch.ones(batch, 1, tokens, key.shape[2], dtype=torch.bool)
    segments = None
    if kwargs.get("position_ids") is not None:
        segments = packed_segments(kwargs["position_ids"])
    if segments is not None:
        _PACKING_SEEN.append(True)
        allowed &= segments[:, None, :, None] == segments[:, None, None, :]
    if module.is_causal if is_causal is None else is_causal:
        allowed &= torch.ones(tokens, key.shape[2], dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_PACKING_SEEN = []


@pytest.fixture(scope="module")
def packing_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("revtriton_packing_test", _packing_attention)
    AttentionMaskInterface.register("revtriton_packing_test", flash_attention_mask)
    return "revtriton_packing_test"


@pytest.mark.parametrize("family", ["gpt_bigcode", "roberta_pre_lora"])
def test_packed_rows_reach_a_flash_style_attention_on_the_library_path(family, packing_attention, seeded):
    """With a flash-style attention (no 4-D mask: packed sequences found from the call's position ids),
    halves that run the library's attention modules (GPTBigCode's, whose loop passes no position ids to
    its layers; an encoder whose projections carry LoRA) pass the packed rows' position ids on: each
    sequence of a packed row gets the logits it gets alone."""
    import test_host_forward
    from test_revify import hf_roberta_pre

    seqs = sequences()
    if family == "gpt_bigcode":
        model = test_host_forward._bigcode(seeded)
    else:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(hf_roberta_pre(seeded), peft.LoraConfig(r=4, target_modules=["query", "value"]))
    model.base_model.config._attn_implementation = packing_attention
    model = revify(model, exact=False).eval()
    ids, positions = packed(seqs)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None], position_ids=torch.arange(len(s))[None]).logits[0] for s in seqs])
        _PACKING_SEEN.clear()
        together = model(input_ids=ids, position_ids=positions).logits[0]
    assert _PACKING_SEEN  # the library's attention found the packed sequences
    # float rounding between a row and its sequence alone, at logits of ~10 (GPTBigCode's 0.3 init); joined
    # sequences: ~1
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5 * max(1.0, alone.abs().max().item()))


@pytest.mark.parametrize("collator", ["flattening", "padding"])
def test_trainer_trains_with_the_library_collators(collator, seeded, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from revtriton.ops import attention

    masks = []
    real = attention.sequence_mask
    monkeypatch.setattr(attention, "sequence_mask", lambda *a, **k: masks.append(1) or real(*a, **k))
    model = revify(hf_llama(seeded), exact=True)
    rows = [{"input_ids": torch.randint(0, 128, (int(n),)).tolist()} for n in torch.randint(4, 16, (16,))]
    collate = transformers.DataCollatorWithFlattening() if collator == "flattening" else _pad_right
    before = [p.detach().clone() for p in model.parameters()]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=4,
                                          learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                          use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses)))
    assert masks  # the batches reached the halves as padded / packed rows
    assert sum(not torch.equal(a, p) for a, p in zip(before, model.parameters())) >= 0.9 * len(before)


# -- against the library's own model ------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_padded_packed_and_generated_outputs_are_the_library_models(family, seeded):
    """A function-preserving conversion (meft3, scale 2**-16: the library's function up to that term)
    against the unconverted model with the same inputs: right padding at every position (padding
    queries see the real keys, as the library's masks let them), left padding at the real tokens,
    packed rows (the library with use_cache=False: with a cache it does not detect packing), and
    cached greedy generation. Mistral's window (4) is shorter than the sequences here."""
    overrides = dict(initializer_range=0.3, eos_token_id=None, pad_token_id=0)
    original = BUILDERS[family](seeded, **overrides).eval()
    preserve = conversion_of(family, dict(preserve="meft3"))["preserve"]
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    seqs = sequences()
    close = dict(rtol=0, atol=2e-3)  # the 2**-16 term of meft3 through 3 blocks of large (init 0.3) weights; a mask bug: ~0.1
    with torch.no_grad():
        for use_cache in (False, True):  # the layout path, and the cache path (the default without grad)
            ids, mask, _ = padded(seqs, "right")
            theirs = original(input_ids=ids, attention_mask=mask, labels=ids)
            ours = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=use_cache)
            torch.testing.assert_close(ours.logits, theirs.logits, **close)
            torch.testing.assert_close(ours.loss, theirs.loss, **close)
            ids, mask, positions = padded(seqs, "left")
            theirs = original(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            ours = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=use_cache).logits
            torch.testing.assert_close(real_tokens(ours, seqs, "left"), real_tokens(theirs, seqs, "left"), **close)
        ids, positions = packed(seqs)
        theirs = original(input_ids=ids, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(model(input_ids=ids, position_ids=positions).logits, theirs, **close)
    prompt = torch.randint(1, 128, (2, 5))
    ours = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert_greedy_tokens_are_the_librarys(original, ours, original.generate(prompt, max_new_tokens=6, do_sample=False,
                                                                            use_cache=True))


# -- the fused kernels take the layout ----------------------------------------------------------


# Family x rows x stream mode covered pairwise (6 runs, not 12; each trains a step twice, once on
# the interpreted kernels): every family with both layouts and both stream modes, every layout
# with both stream modes.
FUSED_LAYOUT_CASES = [(family, rows, (i + j) % 2 == 1) for i, family in enumerate(["gpt2", "llama", "neox_sequential"])
                      for j, rows in enumerate(["left-padded", "packed"])]


@pytest.mark.skipif(not dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (conftest)")
@pytest.mark.parametrize("family,rows,exact", FUSED_LAYOUT_CASES)
def test_padded_and_packed_rows_run_the_fused_kernels(family, rows, exact, seeded):
    """The attention halves hand the token layout to the fused op: its Triton kernels (interpreter)
    mask padded or packed rows and rotate at each row's positions, with the reference path's loss
    and gradients (the same model both ways). Exact streams: the engine's checksums compare every
    rebuilt block input with the forward's (a rebuild off by one bit raises)."""
    model = revify(BUILDERS[family](seeded), exact=exact).train()
    seqs = sequences()
    if rows == "packed":
        ids, positions = packed(seqs)
        batch = dict(input_ids=ids, position_ids=positions, labels=ids)
    else:
        ids, mask, positions = padded(seqs, "left")
        batch = dict(input_ids=ids, attention_mask=mask, position_ids=positions,
                     labels=ids.masked_fill(mask == 0, -100))
    assert_fused_kernels_match_the_reference(model, batch, exact)


def assert_fused_kernels_match_the_reference(model, batch, exact):
    """One training step of ``model`` on ``batch`` with the fused Triton kernels (interpreter) and with
    the reference path: the same loss and gradients, and kernels launched only in the first."""
    from revtriton.ops.dispatch import count_launches, force_triton

    results = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        with force_triton(fused), count_launches() as launches:
            loss = model(**batch).loss
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], launches.total()))
    (loss, grads, launched), (ref_loss, ref_grads, ref_launched) = results
    assert launched > 0 and ref_launched == 0
    # exact: the two paths' half outputs round to the 2**-16 grid apart where they differ in the last bit
    # (1e-4 of a gradient's size measured; a mask or RoPE bug moves them by > 1e-1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4 if exact else 1e-5, atol=0)
    bound = 2e-3 if exact else 1e-4
    # A key bias's gradient is zero (softmax ignores a shift of a query's scores): its rounding (1e-12)
    # is measured against the model's gradient scale.
    scale = max(b.abs().max() for b in ref_grads)
    assert max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6 * scale)).item()
               for a, b in zip(grads, ref_grads)) <= bound


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_a_custom_4d_mask_is_the_library_models(family, seeded):
    """The library's forward runs in a revified decoder, so a custom 4-D mask (here prefix-LM: the
    first 4 tokens see each other both ways) reaches its attention modules as it would the original's:
    logits and loss of a preserving conversion equal the unconverted model's, with grad too."""
    original = BUILDERS[family](seeded, initializer_range=0.3).eval()
    preserve = conversion_of(family, dict(preserve="meft3"))["preserve"]
    model = revify(copy.deepcopy(original), preserve=preserve, scale_bits=16, exact=False).eval()
    ids = torch.randint(0, 128, (2, 9))
    mask = torch.ones(9, 9).tril().bool()
    mask[:4, :4] = True
    mask = mask.expand(2, 1, 9, 9)
    theirs = original(input_ids=ids, attention_mask=mask, labels=ids)
    ours = model(input_ids=ids, attention_mask=mask, labels=ids)
    causal = model(input_ids=ids, labels=ids)
    close = dict(rtol=0, atol=2e-3)  # the 2**-16 term of meft3 (as above); the prefix's keys seen or not: ~0.1
    torch.testing.assert_close(ours.logits, theirs.logits, **close)
    torch.testing.assert_close(ours.loss, theirs.loss, **close)
    assert (ours.logits[:, :3] - causal.logits[:, :3]).abs().max() > 1e-2  # the mask changed the prefix
    ours.loss.backward()
    first_attention = [p for name, p in model.named_parameters()
                       if any(f".0.{part}." in name for part in ("self_attn", "attention", "attn"))]
    assert first_attention and all(p.grad is not None for p in first_attention)

