"""Revified Hugging Face causal LMs and the RevGPT presets train through the chunked linear +
cross-entropy (issue 36): the library's loss without its logits; evaluation, generate, PEFT and
the Trainer's gradient accumulation unchanged."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from revtriton import revify
from revtriton.lm_loss import FusedLossForward, prepare_causal_lm
from revtriton.models import rev_gpt, rev_llama
from test_revify import hf_decoder, hf_gemma, hf_gpt2, hf_llama, hf_qwen2

FAMILIES = {"gpt2": hf_gpt2, "llama": hf_llama, "qwen2": hf_qwen2}


def batch(vocab=128, rows=2, tokens=24):
    ids = torch.randint(0, vocab, (rows, tokens))
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    return ids, labels


def twins(make, seed, **options):
    """The revified model with the fused loss, and a copy taking the library's path."""
    fused = revify(make(seed), **options).train()
    library = copy.deepcopy(fused)
    library.revtriton_fused_loss = False
    return fused, library


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_revified_lm_trains_the_same_losses_with_and_without_the_fused_loss(seeded, family):
    """20 AdamW steps of the fused model; at each, the library's twin takes the same weights and both
    losses and gradients are compared. Free-running twins drift apart: the exact streams round to
    2**-16, so an fp32 rounding difference in a step's gradient can flip a rounding of the next
    step's streams, and Adam's normalised update carries it to weights with tiny gradients (seen
    up to 1.1e-5 relative after 20 steps). In step, the differences are the loss's summation order:
    seen <= 2.4e-7 (loss) and <= 3.6e-6 (a parameter's gradient against its largest entry) over 8
    seeds of each family."""
    fused, library = twins(FAMILIES[family], seeded)
    ids, labels = batch()
    optimizer = torch.optim.AdamW(fused.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        library.load_state_dict(fused.state_dict())
        outs = []
        for name, model in (("fused", fused), ("library", library)):
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=labels)
            assert (out.logits is None) == (name == "fused")
            out.loss.backward()
            outs.append(out.loss.detach())
        assert relative(*outs) <= 1e-6
        for p, q in zip(fused.parameters(), library.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None and q.grad.abs().max() > 0:
                assert relative(p.grad, q.grad) <= 1e-5
        optimizer.step()
        losses.append(outs[0])
    assert losses[-1] < losses[0]


def test_gradient_accumulations_num_items_and_shift_labels_give_the_librarys_loss(seeded):
    fused, library = twins(hf_llama, seeded)
    ids, labels = batch()
    shifted = torch.roll(labels, -1, 1)
    shifted[:, -1] = -100
    for kwargs in (dict(num_items_in_batch=torch.tensor(31)), dict(shift_labels=shifted),
                   dict(num_items_in_batch=7, shift_labels=shifted)):
        ours, theirs = (m(input_ids=ids, labels=labels, **kwargs).loss for m in (fused, library))
        assert relative(ours, theirs) <= 1e-6
        g_ours = torch.autograd.grad(ours, fused.lm_head.weight)[0]
        g_theirs = torch.autograd.grad(theirs, library.lm_head.weight)[0]
        assert relative(g_ours, g_theirs) <= 1e-5


def softcapped_gemma2(seed):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, final_logit_softcapping=0.05,
                                       attn_logit_softcapping=None, query_pre_attn_scalar=16)
    return transformers.Gemma2ForCausalLM(config)


def test_logits_the_library_transforms_after_the_head(seeded):
    """Gemma 2 softcaps its logits: the fused loss does too. Gemma (1) has the config field and
    ignores it: so does the fused loss. A scale the fused loss lacks (Granite's): the library's path."""
    ids, labels = batch()
    # Gemma 2 (post-norms) is not a family revify converts: the loss's mechanism on the plain model.
    gemma2 = softcapped_gemma2(seeded).train()
    gemma2_library = copy.deepcopy(gemma2)
    assert prepare_causal_lm(gemma2, fused_loss=True)
    for fused, library, after in ((gemma2, gemma2_library, "softcap"), (*twins(hf_gemma, seeded), "nothing")):
        fused.config.final_logit_softcapping = library.config.final_logit_softcapping = 0.05  # binding here
        ours, theirs = (m(input_ids=ids, labels=labels) for m in (fused, library))
        assert fused.forward.after_head == after and ours.logits is None
        assert relative(ours.loss, theirs.loss) <= 1e-6
    granite, library = twins(lambda seed: hf_decoder("Granite", seed, logits_scaling=4.0), seeded)
    with pytest.warns(UserWarning, match="keeps the library's loss"):
        ours = granite(input_ids=ids, labels=labels)
    assert granite.forward.after_head == "other" and ours.logits is not None
    assert torch.equal(ours.loss, library(input_ids=ids, labels=labels).loss)


def test_evaluation_generate_and_return_logits_keep_the_librarys_path(seeded):
    fused, library = twins(hf_gpt2, seeded)
    ids, labels = batch()
    out = fused(input_ids=ids, labels=labels, return_logits=True)
    assert out.logits.shape == (2, 24, 128) and torch.equal(out.loss, library(input_ids=ids, labels=labels).loss)
    fused.eval(), library.eval()
    with torch.no_grad():
        ours, theirs = (m(input_ids=ids, labels=labels) for m in (fused, library))
        assert ours.logits is not None and torch.equal(ours.loss, theirs.loss) and torch.equal(ours.logits,
                                                                                             theirs.logits)
        prompt = ids[:1, :6]
        generated = [m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                                pad_token_id=0) for m in (fused, library)]
    assert torch.equal(*generated)


def test_the_fused_forward_survives_copy_pickle_and_save_load(seeded, tmp_path):
    import revtriton

    model = revify(hf_llama(seeded))
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(other.forward, FusedLossForward) and other.forward.model is other
    model.save_pretrained(tmp_path)
    loaded = revtriton.from_pretrained(tmp_path).train()
    assert isinstance(loaded.forward, FusedLossForward)
    ids, labels = batch()
    assert loaded(input_ids=ids, labels=labels).logits is None
    assert not isinstance(revify(hf_llama(seeded), fused_loss=False).__dict__.get("forward"), FusedLossForward)
    with pytest.raises(TypeError, match="fused_loss must be a bool"):
        revify(hf_llama(seeded), fused_loss="yes")


def test_peft_lora_on_a_revified_lm_takes_the_fused_loss(seeded):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    fused, library = twins(hf_llama, seeded)
    torch.manual_seed(seeded + 1)
    fused = peft.get_peft_model(fused, config)
    torch.manual_seed(seeded + 1)
    library = peft.get_peft_model(library, config)
    ids, labels = batch()
    outs = [m(input_ids=ids, labels=labels) for m in (fused, library)]
    assert outs[0].logits is None and outs[1].logits is not None
    assert relative(outs[0].loss, outs[1].loss) <= 1e-6
    grads = []
    for model, out in zip((fused, library), outs):
        out.loss.backward()
        grads.append([p.grad for n, p in model.named_parameters() if "lora_" in n])
    assert grads[0] and all(relative(a, b) <= 1e-5 for a, b in zip(*grads))


def test_the_trainer_with_gradient_accumulation_logs_the_same_losses(seeded, tmp_path):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    rows = []
    for i in range(8):  # rows of different lengths: the accumulated steps count different token numbers
        ids = torch.randint(0, 128, (8 + 2 * i,))
        rows.append({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def pad(examples):
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.tensor([e["input_ids"] + [0] * (width - len(e["input_ids"])) for e in examples])
        labels = torch.tensor([e["labels"] + [-100] * (width - len(e["labels"])) for e in examples])
        return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -100).long()}

    losses = []
    for model in twins(hf_llama, seeded):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=2, learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=1,
                                 use_cpu=True, disable_tqdm=True, seed=seeded % 2**31)
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=pad)
        trainer.train()
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_rev_causal_lm_prints_no_loss_type_line(capfd, caplog):
    from revtriton.models.hf import rev_causal_lm

    model = rev_causal_lm("gpt2", depth=1, dim=32, heads=2, vocab_size=64, block_size=32).train()
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    model.eval()(input_ids=ids, labels=ids)  # the library's loss too
    out, err = capfd.readouterr()
    assert "loss_type" not in out + err + caplog.text


@pytest.mark.parametrize("make", [rev_gpt, rev_llama], ids=["gpt2", "llama"])
def test_the_presets_loss_is_the_fused_one_and_equals_the_full_logits(seeded, make):
    model = make("gpt2-tiny" if make is rev_gpt else "llama-tiny", depth=2, exact=False)
    idx = torch.randint(0, 256, (2, 16))
    targets = idx.roll(-1, 1)
    targets[:, -1] = -100
    logits, loss = model(idx, targets)
    full_logits, full_loss = model(idx, targets, return_logits=True)
    assert logits is None and full_logits.shape == (2, 16, 256)
    assert relative(loss, full_loss) <= 1e-6
    assert relative(loss, F.cross_entropy(full_logits.reshape(-1, 256), targets.reshape(-1))) <= 1e-6
    grad = torch.autograd.grad(loss, model.lm_head.weight)[0]
    assert relative(grad, torch.autograd.grad(full_loss, model.lm_head.weight)[0]) <= 1e-5
    with pytest.raises(ValueError, match="targets must match"):
        model(idx, targets[:, :-1])
