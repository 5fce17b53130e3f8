"""The chunked linear + cross-entropy (issue 36) against the full-logits loss of plain autograd."""
import pytest
import torch
import torch.nn.functional as F

from revtriton.ops.linear_cross_entropy import (chunk_count, linear_cross_entropy, linear_cross_entropy_reference)
from revtriton.profiling import LiveBytes
from test_host_sync import CountSyncs

DIM = 12


def problem(tokens, vocab, dtype, *, bias=False, ignored=0.25):
    hidden = torch.randn(tokens, DIM, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, DIM, dtype=dtype) * 0.5).requires_grad_()
    b = torch.randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (tokens,))
    labels[torch.rand(tokens) < ignored] = -100
    if tokens > 1 and (labels == -100).all():
        labels[0] = 0
    return hidden, weight, b, labels


def loss_and_grads(fn, hidden, weight, bias, labels, **options):
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    loss = fn(hidden, weight, labels, bias, **options)
    return (loss, *torch.autograd.grad(loss, inputs))


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


OPTIONS = [dict(), dict(reduction="sum"), dict(label_smoothing=0.1), dict(softcap=3.0), dict(z_loss=1e-3),
           dict(num_items_in_batch=5), dict(label_smoothing=0.2, softcap=2.0, z_loss=1e-2, reduction="sum")]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
def test_the_reference_is_torchs_cross_entropy(seeded, reduction, smoothing):
    hidden, weight, bias, labels = problem(9, 11, torch.float64, bias=True)
    ours = linear_cross_entropy_reference(hidden, weight, labels, bias, reduction=reduction,
                                          label_smoothing=smoothing)
    theirs = F.cross_entropy(F.linear(hidden, weight, bias), labels, reduction=reduction, label_smoothing=smoothing)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)


@pytest.mark.parametrize("tokens,vocab", [(1, 7), (7, 1000), (130, 7), (130, 50257), (7, 50257)])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "mean")
def test_chunked_loss_and_grads_equal_the_full_logits_in_float64(seeded, tokens, vocab, options):
    hidden, weight, bias, labels = problem(tokens, vocab, torch.float64, bias=vocab != 1000,
                                           ignored=0.0 if tokens == 1 else 0.25)
    expected = loss_and_grads(linear_cross_entropy_reference, hidden, weight, bias, labels, **options)
    for chunk in (None, 3):  # the default (one chunk here) and several, the last one short
        got = loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels, chunk_tokens=chunk, **options)
        for g, e in zip(got, expected):
            assert relative(g, e) <= 1e-10


@pytest.mark.parametrize("options", OPTIONS[:4], ids=["mean", "sum", "smoothing", "softcap"])
def test_chunked_loss_and_grads_in_float32(seeded, options):
    hidden, weight, bias, labels = problem(130, 1000, torch.float32, bias=True)
    expected = loss_and_grads(linear_cross_entropy_reference, hidden, weight, bias, labels, **options)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels, chunk_tokens=16, **options)
    for g, e in zip(got, expected):
        assert relative(g, e) <= 1e-5


def test_tied_embedding_gets_both_gradients(seeded):
    """GPT-2's head: the embedding's weight is the head's; both uses reach its gradient."""
    embed = torch.nn.Embedding(50, DIM, dtype=torch.float64)
    ids, labels = torch.randint(0, 50, (2, 9)), torch.randint(0, 50, (18,))
    grads = []
    for fn in (linear_cross_entropy_reference, linear_cross_entropy):
        embed.zero_grad(set_to_none=True)
        hidden = torch.tanh(embed(ids)).reshape(-1, DIM)
        fn(hidden, embed.weight, labels).backward()
        grads.append(embed.weight.grad.clone())
    assert relative(grads[1], grads[0]) <= 1e-10


def test_the_backward_is_deterministic(seeded):
    hidden, weight, bias, labels = problem(70, 300, torch.float32, bias=True)
    first = loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels, chunk_tokens=8)
    second = loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels, chunk_tokens=8)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_only_the_wanted_gradients_are_made(seeded):
    hidden, weight, _, labels = problem(20, 30, torch.float64)
    frozen = weight.detach()
    (grad,) = torch.autograd.grad(linear_cross_entropy(hidden, frozen, labels), [hidden])
    (expected,) = torch.autograd.grad(linear_cross_entropy_reference(hidden, frozen, labels), [hidden])
    assert relative(grad, expected) <= 1e-10


def test_no_ignored_token_counts_and_all_ignored_is_nan_like_torch(seeded):
    hidden, weight, _, labels = problem(10, 20, torch.float64, ignored=0.0)
    masked = labels.clone()
    masked[3:] = -100
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, masked),
                               linear_cross_entropy(hidden[:3], weight, labels[:3]), rtol=1e-12, atol=0)
    nothing = torch.full_like(labels, -100)
    assert torch.isnan(linear_cross_entropy(hidden, weight, nothing))
    assert torch.isnan(F.cross_entropy(F.linear(hidden, weight), nothing))


def test_a_chunk_holds_a_bounded_number_of_logits(seeded):
    """Peak bytes of forward + backward: a few chunks' logits, not the tokens x vocab ones."""
    tokens, vocab, chunk = 512, 4000, 16
    hidden, weight, _, labels = problem(tokens, vocab, torch.float32)
    weight.grad = torch.zeros_like(weight)  # the parameter's gradient exists before the step
    logits_bytes = tokens * vocab * 4

    def peak(fn, **options):
        with LiveBytes() as meter:
            fn(hidden, weight, labels, **options).backward()
        # the weight's gradient (made by the backward, then added into .grad) is a parameter gradient
        return meter.peak - weight.numel() * 4

    full, chunked = peak(linear_cross_entropy_reference), peak(linear_cross_entropy, chunk_tokens=chunk)
    assert full >= 2.5 * logits_bytes  # logits, log-softmax, their gradients
    assert chunked <= 3 * chunk * vocab * 4 + 4 * tokens * DIM * 4 and chunked < 0.15 * logits_bytes
    assert chunk_count(tokens, vocab, hidden.device, chunk) == 32


def test_a_step_makes_no_host_sync(seeded):
    hidden, weight, bias, labels = problem(40, 50, torch.float32, bias=True)
    with CountSyncs() as counter:
        linear_cross_entropy(hidden, weight, labels, bias, chunk_tokens=7, label_smoothing=0.1).backward()
    assert not counter.counts


def test_bf16_autocast_matches_the_autocast_head(seeded):
    """Under CPU autocast the GEMMs run in bfloat16, the softmax in float32, as the head would."""
    hidden, weight, _, labels = problem(64, 200, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = loss_and_grads(linear_cross_entropy, hidden, weight, None, labels, chunk_tokens=16)
        theirs = loss_and_grads(linear_cross_entropy_reference, hidden, weight, None, labels)
    assert ours[1].dtype == hidden.dtype and ours[2].dtype == weight.dtype
    for g, e in zip(ours, theirs):
        assert relative(g, e) <= 2e-2  # bfloat16 logits either way, rounded at different points


@pytest.mark.parametrize("bad,error", [
    (dict(hidden=torch.randn(2, 3, DIM)), ValueError), (dict(labels=torch.zeros(5)), ValueError),
    (dict(labels=torch.zeros(4, dtype=torch.long)), ValueError), (dict(bias=torch.zeros(3)), ValueError),
    (dict(weight=torch.randn(9, DIM, dtype=torch.float64)), TypeError), (dict(reduction="none"), ValueError),
    (dict(label_smoothing=1.5), ValueError), (dict(softcap=0.0), ValueError), (dict(z_loss=-1.0), ValueError),
    (dict(chunk_tokens=0), ValueError), (dict(reduction="sum", num_items_in_batch=3), ValueError),
])
def test_bad_inputs_raise(bad, error):
    args = dict(hidden=torch.randn(5, DIM), weight=torch.randn(9, DIM), labels=torch.zeros(5, dtype=torch.long))
    args.update(bad)
    hidden, weight, labels = args.pop("hidden"), args.pop("weight"), args.pop("labels")
    with pytest.raises(error):
        linear_cross_entropy(hidden, weight, labels, **args)
