"""Checks every revified family's tests make: an exact training step against the stored-activation
twin, and the save / load / pickle round trips."""
import copy
import pickle

import torch

from revtriton import from_pretrained
from revtriton.models import to_stored_activations

from fresh_process import run_python


def _steps_with_twin(model, loss_of, seed=None):
    """A training step (``loss_of``, then backward; ``seed`` set before each) of the model and of its
    stored-activation twin, their losses bitwise equal. Returns the twin."""
    twin = to_stored_activations(copy.deepcopy(model))
    losses = []
    for m in (model, twin):
        if seed is not None:
            torch.manual_seed(seed)
        losses.append(loss_of(m))
        losses[-1].backward()
    assert torch.equal(*losses)
    return twin


def seq2seq_batch():
    """A seq2seq model's source rows (the second left-padded) and decoder inputs (vocabulary 128)."""
    ids = torch.randint(3, 128, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.randint(3, 128, (2, 6)))


def assert_seq2seq_keeps_the_librarys_function(original, model, inputs, depth=None, relative=2e-3):
    """A preserving conversion of a seq2seq model on ``inputs`` (:func:`seq2seq_batch`): the logits and
    both stacks' hidden states (``depth`` + 1 of each when given) within ``relative`` of the largest of
    the library's, and its greedy generation with the library's cache after the decoder inputs' first
    four: the tokens (:func:`assert_greedy_tokens_are_the_librarys`) and each step's logits while the
    tokens agree."""
    with torch.no_grad():
        theirs, ours = (m(**inputs, output_hidden_states=True) for m in (original, model))
    pairs = [(ours.logits, theirs.logits)]
    for states in ("encoder_hidden_states", "decoder_hidden_states"):
        if depth is not None:
            assert len(getattr(ours, states)) == len(getattr(theirs, states)) == depth + 1
        pairs += zip(getattr(ours, states), getattr(theirs, states))
    source = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    # From a prefix of distinct tokens: a tiny random model's greedy choice soon repeats one token, and
    # over equal keys and values no position (T5's relative bias) would change a logit.
    prefix = inputs["decoder_input_ids"][:, :4]
    ours, theirs = (m.generate(**source, decoder_input_ids=prefix, max_new_tokens=6, do_sample=False,
                               output_scores=True, return_dict_in_generate=True) for m in (model, original))
    assert_greedy_tokens_are_the_librarys(original, ours.sequences, theirs.sequences, relative, source=source)
    for step, (a, b) in enumerate(zip(ours.scores, theirs.scores)):
        if not torch.equal(ours.sequences[:, :step + 1], theirs.sequences[:, :step + 1]):
            break
        pairs.append((a, b))
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=0, atol=relative * b.abs().max().item())


def assert_seq2seq_memory_flat_in_depth(build, tokens=128):
    """A training step's peak memory past its parameter gradients, for a seq2seq model ``build(depth)``
    (vocabulary 128) with ``depth`` layers in each stack: revified, at 8 layers at most 1.05x its peak
    at 4; unconverted, at least 1.5x (what the reversible stacks remove)."""
    from revtriton import revify
    from revtriton.profiling import peak_memory

    def step_peak(depth, convert):
        model = build(depth)
        model = (revify(model) if convert else model).train()
        ids, labels = torch.randint(3, 128, (2, tokens)), torch.randint(3, 128, (2, tokens))
        model(input_ids=ids, labels=labels).loss.backward()  # (the parameter gradients exist before the peak)
        return peak_memory(lambda: model(input_ids=ids, labels=labels).loss.backward())

    assert step_peak(8, True) <= 1.05 * step_peak(4, True)
    assert step_peak(8, False) >= 1.5 * step_peak(4, False)


def assert_exact_step_equals_twin(model, loss_of, seed=None):
    """An exact training step (``loss_of(model)``, then backward) of a revified model: the loss and
    every gradient bitwise those of its stored-activation twin; a parameter without a gradient (a
    part the loss does not reach) has none in either. ``seed``: set before each step (the same
    dropout draws in both). Returns the twin."""
    twin = _steps_with_twin(model, loss_of, seed)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
    return twin


def assert_seq2seq_step_equals_its_twin(model, loss_of, seed=None, preserve=None,
                                        encoder_side=("model.encoder.", "model.shared.")):
    """An exact training step of a seq2seq model with both stacks reversible (``loss_of(model)``, then
    backward; ``seed`` set before each: the same dropout draws) against its stored-activation twin's:
    the loss and the decoder's gradients bitwise, the encoder's (``encoder_side``: the names it and a
    shared embedding start with) within float rounding: the decoder layers' cross-attention gradients
    reach the encoder's states summed in another order (a layer's projections first, then over the
    layers; autograd adds each as it comes). meft1's top G adapter has no gradient in the twin, a zero
    one here."""
    twin = _steps_with_twin(model, loss_of, seed)
    mine, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
    encoder = [name for name in mine if name.startswith(encoder_side) and theirs[name].grad is not None]
    largest = max(theirs[name].grad.abs().max().item() for name in encoder)
    for name, p in mine.items():
        q = theirs[name]
        if q.grad is None:
            assert p.grad is None or (preserve == "meft1" and not p.grad.any()), name
        elif name in encoder:  # (relative to the largest: some are about zero by symmetry, a key's bias)
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5 * largest, msg=name)
        else:
            assert p.grad is not None and torch.equal(p.grad, q.grad), name
    return twin


def assert_greedy_tokens_are_the_librarys(original, ours, theirs, relative=2e-3, source=None, beside=None):
    """Greedy generations ``ours`` (a converted model's) and ``theirs`` (the library's, from the same
    prompt) agree, but where the library's own logits tie within the conversion's term (``relative`` to
    the largest logit): there rounding picks either token (a preserving conversion is the function up
    to a term of 2**-scale_bits), and each row is compared up to the first such token. A token the
    library ranks clearly lower fails. ``source``: a seq2seq model's encoder inputs (the generations
    are then its decoder's tokens); ``beside``: what else the model reads beside its tokens (GIT's
    pixel values), by row."""
    assert ours.shape == theirs.shape
    for row in range(ours.shape[0]):
        differ = (ours[row] != theirs[row]).nonzero()
        if not len(differ):
            continue
        at = int(differ[0])  # (the prompts are the same: a generated position)
        prefix = theirs[row:row + 1, :at]
        inputs = (dict(input_ids=prefix) if source is None else
                  {**{key: value[row:row + 1] for key, value in source.items()}, "decoder_input_ids": prefix})
        inputs.update({key: value[row:row + 1] for key, value in (beside or {}).items()})
        with torch.no_grad():
            logits = original(**inputs, use_cache=False).logits[0, -1]
        gap = (logits.max() - logits[ours[row, at]]).item()
        assert gap <= relative * logits.abs().max().item(), (
            f"row {row}: token {int(ours[row, at])} at position {at} where the library's greedy choice is "
            f"{int(theirs[row, at])}, {gap:.2e} below it (not a tie within the conversion's term)")


def assert_round_trips(model, inputs: dict, tmp_path, output="logits"):
    """In eval mode, the model's ``output`` on ``inputs`` (keyword inputs), bitwise, from:
    save_pretrained -> revtriton.from_pretrained, a pickle, and a fresh process's unpickling (it must
    find the swapped classes by name). Returns the model from_pretrained loaded."""
    model.eval()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = getattr(model(**inputs), output)
        loaded = from_pretrained(tmp_path).eval()
        assert torch.equal(getattr(loaded(**inputs), output), expected)
        assert torch.equal(getattr(pickle.loads(pickle.dumps(model))(**inputs), output), expected)
    assert_loads_in_a_fresh_process(model, inputs, expected, tmp_path, output)
    return loaded


def assert_loads_in_a_fresh_process(model, inputs: dict, expected, tmp_path, output="logits"):
    """A whole-model pickle (torch.save) loads in a new interpreter, which must find the swapped classes
    by name, and gives ``expected`` as its ``output`` on ``inputs`` (tests/fresh_process: a child of a
    server that imported torch and transformers' base, nothing else). ``expected`` comes from under
    torch.no_grad(): so does the fresh process's (with grad a decoder runs the fused halves, without it
    and a cache the library's modules: equal up to float rounding, not bitwise), on as many threads (a
    GEMM's sums split by thread)."""
    torch.save({"model": model, "inputs": inputs, "expected": expected}, tmp_path / "whole.pt")
    fresh = ("import sys, torch; torch.set_num_threads(int(sys.argv[2])); "
             "saved = torch.load(sys.argv[1], weights_only=False); torch.set_grad_enabled(False); "
             "out = getattr(saved['model'](**saved['inputs']), sys.argv[3]); "
             "sys.exit(0 if torch.equal(out, saved['expected']) else 1)")
    run_python(fresh, tmp_path / "whole.pt", torch.get_num_threads(), output, check=True)
