"""Pre-norm encoders with BERT's layer parts (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL, Megatron-BERT), issue 15.

revify admits them by their layers' parts (``attention.self`` / ``attention.output`` /
``intermediate`` / ``output`` with a LayerNorm before each branch), probes each layer against its
own forward, and keeps the library's forward: it embeds (absolute positions, computed from the
padding in input_ids), builds its bidirectional mask (padding, packed rows) and loops over
``encoder.layer``, where the reversible stack stands in. Training, masks, packing, the fused kernels,
save / load and pickling are tested here; test_revify.py runs them through every family's tests too.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from revtriton.convert import revify
from revtriton.models import to_stored_activations
from revtriton.ops import dispatch

from test_host_forward import assert_trains_saves_and_pickles
from test_models import check_against_twin
from test_token_layouts import _pad_right, assert_fused_kernels_match_the_reference, packed, real_tokens
from test_token_layouts import padded as padded_with_positions
from test_revify import DEPTH, hf_encoder, hf_megatron, hf_roberta_pre, hf_xlmr_xl

transformers = pytest.importorskip("transformers")

ENCODERS = {"roberta_pre": hf_roberta_pre, "xlmr_xl": hf_xlmr_xl}
LENGTHS = (10, 7, 4)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def sequences(lengths=LENGTHS):
    return [torch.randint(1, 128, (n,)) for n in lengths]  # no padding id inside a sequence


def padded(seqs, side):
    """(input_ids, attention_mask) padded with 0 (the builders' pad_token_id) to the longest; the library
    derives the positions from the ids, skipping the padding."""
    ids, mask, _ = padded_with_positions(seqs, side)
    return ids, mask


def alone(model, seqs, packed_positions=False, **kwargs):
    """Each sequence's logits run alone (with the packed row's positions 0..n-1 when asked)."""
    outs = []
    for s in seqs:
        positions = dict(position_ids=torch.arange(len(s))[None]) if packed_positions else {}
        outs.append(model(input_ids=s[None], **positions, **kwargs).logits[0])
    return torch.cat(outs)


@pytest.mark.parametrize("family", sorted(ENCODERS))
@pytest.mark.parametrize("exact", [False, True])
def test_padded_and_packed_rows_give_each_sequence_alone(family, exact, seeded):
    """Right and left padding (a 2-D mask) and packed rows (position_ids restarting, no mask): each real
    token gets the logits of its sequence run alone; padding keys are never seen."""
    model = revify(ENCODERS[family](seeded), exact=exact).eval()
    atol = 5e-4 if exact else 1e-5  # exact: one 2**-16 rounding flip per half at most (test_token_layouts.py)
    seqs = sequences()
    with torch.no_grad():
        expected = alone(model, seqs)
        for side in ("right", "left"):
            ids, mask = padded(seqs, side)
            logits = model(input_ids=ids, attention_mask=mask).logits
            assert torch.isfinite(logits).all()
            torch.testing.assert_close(real_tokens(logits, seqs, side), expected, rtol=0, atol=atol)
            stepped = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).logits
            assert torch.equal(stepped, logits)  # block by block, with the same layout
        ids, positions = packed(seqs)
        torch.testing.assert_close(model(input_ids=ids, position_ids=positions).logits[0],
                                   alone(model, seqs, packed_positions=True), rtol=0, atol=atol)


@pytest.mark.parametrize("family", sorted(ENCODERS))
def test_packed_and_padded_losses_train_as_the_sequences_alone(family, seeded):
    """Per-token losses and gradients (float64, float streams): a packed row and a right-padded batch
    (labels -100 at the padding) give the gradient of the summed per-token losses of the sequences run
    alone."""
    model = revify(ENCODERS[family](seeded).double(), exact=False).train()
    seqs = sequences()

    def grads_of(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    def summed(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                               reduction="sum")

    reference = grads_of(sum(summed(model(input_ids=s[None], position_ids=torch.arange(len(s))[None]).logits, s[None])
                             for s in seqs))
    ids, positions = packed(seqs)
    packed_grads = grads_of(summed(model(input_ids=ids, position_ids=positions).logits, ids))
    assert packed_grads.keys() == reference.keys()
    for name, g in reference.items():
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")
    reference = grads_of(sum(summed(model(input_ids=s[None]).logits, s[None]) for s in seqs))
    ids, mask = padded(seqs, "right")
    padded_grads = grads_of(summed(model(input_ids=ids, attention_mask=mask).logits, ids.masked_fill(mask == 0, -100)))
    for name, g in reference.items():
        torch.testing.assert_close(padded_grads[name], g, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", sorted(ENCODERS))
@pytest.mark.parametrize("exact", [False, True])
def test_padded_training_step_matches_the_stored_activation_twin(family, exact, seeded):
    model = revify(ENCODERS[family](seeded), exact=exact).train()
    twin = to_stored_activations(copy.deepcopy(model))
    ids, mask = padded(sequences(), "left")
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    twin_loss = twin(input_ids=ids, attention_mask=mask, labels=labels).loss
    twin_loss.backward()
    check_against_twin(model, twin, loss, twin_loss, exact)


def assert_the_librarys_encoder(original, model, seqs):
    """``model`` (meft3 at 2**-16) computes ``original``'s logits, loss and hidden states (the library's
    layout: embeddings, each layer's output, the last one normed) on right- and left-padded rows, and its
    logits on packed rows (position_ids restarting, no mask), as the library treats them."""
    close = dict(rtol=0, atol=2e-3)  # the 2**-16 term through 3 blocks of large weights; a mask bug: ~0.1
    with torch.no_grad():
        for side in ("right", "left"):
            ids, mask = padded(seqs, side)
            theirs = original(input_ids=ids, attention_mask=mask, labels=ids, output_hidden_states=True)
            ours = model(input_ids=ids, attention_mask=mask, labels=ids, output_hidden_states=True)
            torch.testing.assert_close(ours.logits, theirs.logits, **close)
            torch.testing.assert_close(ours.loss, theirs.loss, **close)
            assert len(ours.hidden_states) == len(theirs.hidden_states) == DEPTH + 1
            for a, b in zip(ours.hidden_states, theirs.hidden_states):
                torch.testing.assert_close(a, b, **close)
        ids, positions = packed(seqs)
        torch.testing.assert_close(model(input_ids=ids, position_ids=positions).logits,
                                   original(input_ids=ids, position_ids=positions).logits, **close)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("family", sorted(ENCODERS))
def test_a_preserving_conversion_computes_the_librarys_encoder(family, seeded):
    """meft3 at 2**-16 against the unconverted model: padded rows (every position: padding queries see
    the real keys, as the library's mask lets them), packed rows, hidden states (the library's layout:
    embeddings, each layer's output, the last one normed) and the library's masked-LM loss."""
    original = ENCODERS[family](seeded, initializer_range=0.3).eval()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    seqs = sequences()
    assert_the_librarys_encoder(original, model, seqs)
    with torch.no_grad():
        ids, positions = packed(seqs)
        theirs = original(input_ids=ids, position_ids=positions).logits
        # The packing matters: the same positions with a mask of ones (no packing) let sequences see each other.
        joined = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids)).logits
        assert (joined - theirs).abs().max() > 1e-2


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_megatron_bert_computes_the_librarys_encoder(seeded, tmp_path):
    """Megatron-BERT: attention.ln and the layer's ln before the branches, a loop reading each layer's
    output as layer_outputs[0], the encoder's ln after it; BERT's absolute positions (not derived from the
    padding) and an extended mask that lets packed rows see each other. meft3 at 2**-16 computes the
    library's logits, loss and hidden states on padded rows and on packed ones (as the library: mixed);
    an exact training step equals its stored-activation twin; it saves, loads and pickles."""
    original = hf_megatron(seeded, initializer_range=0.3).eval()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert type(model.bert).__qualname__.startswith("RevifiedHostUnpackedEncoder")
    assert_the_librarys_encoder(original, model, sequences())
    model = revify(hf_megatron(seeded, hidden_dropout_prob=0.1), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path, seed=seeded)


@pytest.mark.skipif(not dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (conftest)")
@pytest.mark.parametrize("rows", ["right-padded", "packed"])
@pytest.mark.parametrize("exact", [False, True])
def test_padded_and_packed_rows_run_the_fused_kernels(rows, exact, seeded):
    """The encoder's attention halves hand the padding / packing to the fused op: its Triton kernels
    (interpreter, bidirectional attention with segments) give the reference path's loss and gradients."""
    model = revify(hf_roberta_pre(seeded), exact=exact).train()
    seqs = sequences()
    if rows == "packed":
        ids, positions = packed(seqs)
        batch = dict(input_ids=ids, position_ids=positions, labels=ids)
    else:
        ids, mask = padded(seqs, "right")
        batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    assert_fused_kernels_match_the_reference(model, batch, exact)


def test_an_encoder_found_by_its_conventions_trains_saves_and_pickles(seeded, tmp_path):
    """An exact training step bitwise equals the stored-activation twin; save_pretrained ->
    revtriton.from_pretrained converts it again; the swapped classes pickle, and a fresh process finds
    them in transformers' module for the family."""
    from revtriton.convert import _convention_class

    model = revify(hf_xlmr_xl(seeded), exact=True).train()
    assert type(model).__name__ == "XLMRobertaXLForMaskedLM"  # config.architectures stays the library's
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path)
    module = "transformers.models.roberta_prelayernorm.modeling_roberta_prelayernorm"
    assert _convention_class("RevifiedHostEncoderOrdinaryRobertaPreLayerNormLayer")[:2] == (
        module, "RobertaPreLayerNormLayer")
    assert _convention_class("RevifiedRobertaPreLayerNormForSequenceClassification")[:2] == (
        module, "RobertaPreLayerNormForSequenceClassification")
    assert _convention_class("RevifiedHostEncoderNoSuchLayer") is None


def test_heads_and_the_base_model_convert(seeded, monkeypatch):
    """Any head (a sequence classifier here) and the base model alone: the encoder's layers become one
    stack, training runs, inference runs the fused halves (an encoder has no decoding path), and a
    half called alone is the layer's own branch (no mask)."""
    import revtriton.convert.encoder

    fused_calls = []  # the attention halves' fused path (their couples may run bound: ops.dispatch.run_bound)
    half = revtriton.convert.encoder._EncoderAttentionHalf
    real = half._fused
    monkeypatch.setattr(half, "_fused", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    config = hf_roberta_pre(seeded).config
    classifier = revify(transformers.RobertaPreLayerNormForSequenceClassification(config)).train()
    ids = torch.randint(1, 128, (2, 10))
    classifier(input_ids=ids, labels=torch.tensor([0, 1])).loss.backward()
    assert all(p.grad is not None for name, p in classifier.named_parameters() if ".encoder.layer.0." in name)
    base = revify(transformers.RobertaPreLayerNormModel(config)).eval()
    fused_calls.clear()
    with torch.no_grad():
        base(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert len(fused_calls) == DEPTH
    layer = base.encoder.layer[0]
    attention, _ = layer.coupling_halves()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        own = layer.attention(x)[0] - x  # the library's attention branch: output(self(norm(x)), x) - x
        torch.testing.assert_close(attention(x), own, rtol=0, atol=1e-5)


def _esm(seed, **overrides):  # ESM-2's layers: attention.LayerNorm and the layer's LayerNorm before the MLP
    esm = dict(vocab_size=33, pad_token_id=1, mask_token_id=32, position_embedding_type="absolute", initializer_range=0.3)
    return hf_encoder("Esm", seed, **{**esm, **overrides}).eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_esm_with_absolute_positions_converts_by_its_layer_parts(seeded):
    """ESM (protein language model) has the same layer parts: a preserving conversion computes its
    logits on right-padded rows (its own padding id)."""
    original = _esm(seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    ids = torch.randint(4, 30, (2, 9))
    ids[1, 6:] = 1
    mask = (ids != 1).long()
    with torch.no_grad():
        theirs = original(input_ids=ids, attention_mask=mask).logits
        ours = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3 * theirs.abs().max().item())


class _ScaledOutput(torch.nn.Module):
    """An MLP output that scales its branch: BERT's parts, another function."""

    def __init__(self, output):
        super().__init__()
        self.dense, self.dropout = output.dense, output.dropout

    def forward(self, hidden_states, input_tensor):
        return 0.5 * self.dropout(self.dense(hidden_states)) + input_tensor


def test_encoders_that_are_not_pre_norm_layers_raise_and_leave_the_model_as_it_was(seeded):
    """A layer whose parts match but whose function does not fails the probe (model unchanged); a
    decoder configuration, positions computed inside attention (ESM's rotary) and a forward that
    hides its layer loop are named; BERT (post-norm) is named elsewhere (test_revify.py)."""
    original = hf_roberta_pre(seeded, initializer_range=0.3).eval()
    for layer in original.base_model.encoder.layer:
        layer.output = _ScaledOutput(layer.output)
    model = copy.deepcopy(original)
    with pytest.raises(NotImplementedError, match="does not compute a pre-norm encoder layer"):
        revify(model)
    layers = model.base_model.encoder.layer
    assert type(layers) is torch.nn.ModuleList and not any(hasattr(layer, "_revtriton_spec") for layer in layers)
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits)
    with pytest.raises(NotImplementedError, match="as a decoder"):
        revify(hf_roberta_pre(seeded, is_decoder=True))
    with pytest.raises(NotImplementedError, match="position_embedding_type='rotary'"):
        revify(_esm(seeded, position_embedding_type="rotary"))
    wrapped = hf_roberta_pre(seeded)
    wrapped.base_model.encoder.__class__ = _WrappedEncoder
    with pytest.raises(NotImplementedError, match="does not loop over self.layer"):
        revify(wrapped)


class _WrappedEncoder(transformers.models.roberta_prelayernorm.modeling_roberta_prelayernorm.RobertaPreLayerNormEncoder):
    """An encoder whose own forward does not show its layer loop (a stand-in could not be sure to answer it)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize("collator", ["flattening", "padding"])
def test_trainer_trains_a_masked_lm_with_the_library_collators(collator, seeded, tmp_path):
    """Hugging Face Trainer, 5 steps: DataCollatorWithFlattening (packed rows) or a padding collator
    with masked-LM labels; the loss is finite and the weights move."""
    pytest.importorskip("accelerate")  # (Trainer needs it)
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    model = revify(hf_roberta_pre(seeded))
    # labels = the ids, as _pad_right (a padding collator) makes them
    examples = [{"input_ids": s.tolist(), "labels": s.tolist()} for s in sequences((9, 5, 7, 3, 8, 6))]
    collate = DataCollatorWithFlattening() if collator == "flattening" else _pad_right
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=5, learning_rate=1e-3,
                             report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=collate)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(not torch.equal(a, p) for a, p in zip(before, model.parameters())) >= 0.8 * len(before)
