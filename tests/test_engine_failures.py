"""Failure cases of issue 13: each one a correct result or a clear error, never a silently wrong one.

Oracles: the stored-activation twin of the same stack (``to_stored_activations``, same weights) in
float64, or ``torch.equal`` where the claim is bitwise. Fresh random inputs (conftest's seed).
"""
import copy
import re

import pytest
import torch
from torch import nn

from revtriton import ReversibleBlock, ReversibleStack
from revtriton.models import to_stored_activations
from test_engine import Noisy, WidenTokens, loss_of
from revtriton.schedules import SCHEDULES
from twins import MODES, CountingHalf, DropPath, grads_of, max_rel_error, mlp

DIM = 8
pytestmark = pytest.mark.usefixtures("seeded")  # fresh random inputs in every test (conftest)


def blocks(depth, dim=DIM, dropout=0.0, drop_path=0.0):
    return [ReversibleBlock(DropPath(mlp(dim, dropout=dropout), drop_path),
                            DropPath(mlp(dim, dropout=dropout), drop_path))
            for _ in range(depth)]


def stack_of(layers, exact, schedule="sequential", **options):
    stack = ReversibleStack(layers, exact=exact, schedule=schedule, **options)
    return stack.double() if not exact else stack


def dtype_of(exact):
    return torch.float32 if exact else torch.float64


def twin_of(stack):
    return to_stored_activations(copy.deepcopy(stack))


# -- 1. double backward ---------------------------------------------------------------------------


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_double_backward_raises_at_the_first_backward(exact, depth):
    stack = stack_of(blocks(depth), exact)
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    with pytest.raises(RuntimeError, match="does not support double backward.*create_graph=True"):
        torch.autograd.grad(stack(x).square().sum(), x, create_graph=True)
    # The twin (what the message points to) does give second-order gradients.
    twin = twin_of(stack)
    g, = torch.autograd.grad(twin(x).square().sum(), x, create_graph=True)
    g.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # An ordinary backward still works.
    x.grad = None
    stack(x).square().sum().backward()
    assert x.grad is not None


# -- 3. state changed between forward and backward ------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [2, 3])
def test_training_flag_changed_before_backward_is_named(exact, schedule, depth):
    stack = stack_of(blocks(depth, dropout=0.3), exact, schedule).train()
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    y = stack(x)
    stack.eval()
    with pytest.raises(RuntimeError, match=r"training flag of layer 0 \(ReversibleBlock\) went from train to "
                                           r"eval between the forward and the backward"):
        loss_of(y).backward()
    # A single submodule switched is named by its path inside the block.
    stack.train()
    y = stack(x)
    stack[depth - 1].g.module.module[4].eval()
    flag = rf"training flag of submodule g\.module\.module\.4 of layer {depth - 1} \(Dropout\)"
    with pytest.raises(RuntimeError, match=flag):
        loss_of(y).backward()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [2, 3])
def test_parameter_changed_in_place_before_backward_is_named(exact, schedule, depth):
    stack = stack_of(blocks(depth), exact, schedule)
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    y = stack(x)
    with torch.no_grad():
        stack[1].f.module.module[1].weight.mul_(1.5)
    with pytest.raises(RuntimeError, match=r"parameter f\.module\.module\.1\.weight of layer 1 was modified in place "
                                           r"\(its version counter went from \d+ to \d+\)"):
        loss_of(y).backward()


class RenormalisingHalf(nn.Module):
    """Edits its own weight in place in its forward (as nn.Embedding(max_norm=...) does)."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.2, 0.2)
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_forward_that_edits_its_own_weights_is_no_false_alarm(exact, depth):
    stack = stack_of([ReversibleBlock(RenormalisingHalf(DIM), mlp(DIM)) for _ in range(depth)], exact)
    twin = twin_of(stack)
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    want = grads_of(twin, x, lambda: loss_of(twin(x)))
    if exact:
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    else:
        assert max_rel_error([got[0]] + got[1], [want[0]] + want[1]) <= 1e-10


@pytest.mark.parametrize("exact", MODES)
def test_optimizer_steps_between_iterations_are_fine(exact):
    """No false alarm: the usual loop (forward, backward, step, forward...) matches the twin's loop."""
    stack = stack_of(blocks(3, dropout=0.2), exact).train()
    twin = twin_of(stack)
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact))
    weights = torch.randn(DIM, dtype=dtype_of(exact))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (stack, twin)]
    for _ in range(3):
        seed = int(torch.randint(0, 2**31, ()))
        for model, optimizer in zip((stack, twin), optimizers):
            torch.manual_seed(seed)
            optimizer.zero_grad()
            (model(x) * weights).sum().backward()
            optimizer.step()
    for a, b in zip(stack.parameters(), twin.parameters()):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-10, atol=1e-12)


# -- 5 and 6. checksums -----------------------------------------------------------------------------


class RollRows(CountingHalf):
    """Not deterministic in a way a plain sum cannot see: rolls the token rows of its output by a
    different amount at every call (the values are the same, their positions are not)."""

    def forward(self, x):
        return super().forward(x).roll(self.calls, dims=-2)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_checksum_sees_values_moved_between_positions(schedule, depth):
    # The bad half is in layer 0: its rebuilt input has the same plain sum as the forward's.
    layers = [ReversibleBlock(RollRows(DIM), mlp(DIM))] + blocks(depth - 1)
    stack = ReversibleStack(layers, schedule=schedule)
    x = torch.randn(2, 5, DIM, requires_grad=True)
    with pytest.raises(RuntimeError, match="input of layer 0 .* not deterministic"):
        loss_of(stack(x)).backward()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("depth", [1, 2])
def test_frozen_first_segment_still_checks_later_segments(schedule, depth):
    """Input without grad, a frozen first segment, then a stage transition and trainable blocks, one
    of them not deterministic: the mismatch is reported by the end of the backward."""
    frozen = blocks(depth)
    for p in nn.ModuleList(frozen).parameters():
        p.requires_grad_(False)
    layers = frozen + [WidenTokens(DIM, DIM)] + blocks(1) + [ReversibleBlock(mlp(DIM), Noisy(DIM))] + blocks(1)
    stack = ReversibleStack(layers, schedule=schedule)
    x = torch.randn(2, 3, DIM)
    with pytest.raises(RuntimeError, match=rf"input of layer {depth + 2} .* not deterministic"):
        loss_of(stack(x)).backward()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mismatch_in_a_later_segment_is_reported_and_cleared(schedule):
    # Two recorded segments, the bad block in the later one: reported once the whole backward is done.
    layers = blocks(2) + [WidenTokens(DIM, DIM)] + [ReversibleBlock(Noisy(DIM), mlp(DIM))] + blocks(2)
    stack = ReversibleStack(layers, schedule=schedule)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    with pytest.raises(RuntimeError, match="input of layer 3 .* not deterministic"):
        loss_of(stack(x)).backward()
    # And a deterministic stack passes, again and again (no flag left over from the failed backward).
    good = ReversibleStack(blocks(2) + [WidenTokens(DIM, DIM)] + blocks(3), schedule=schedule)
    for _ in range(2):
        loss_of(good(x)).backward()


# -- 7. overflow hint --------------------------------------------------------------------------------


class Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


@pytest.mark.parametrize("depth", [5, 6])
def test_overflow_hint_fits_the_whole_stack_at_once(depth):
    """Streams grow ~10x a block: the first overflow is early, the peak is at the last block. The
    suggested frac_bits must make the whole stack run on the first try."""
    layers = [ReversibleBlock(Scale(3.0), Scale(3.0)) for _ in range(depth)]
    x = torch.randn(2, 3, DIM)
    with pytest.raises(OverflowError, match=r"over the whole stack.*frac_bits <= \d+") as error:
        ReversibleStack(layers)(x).sum().backward()
    first = int(re.search(r"layer (\d+)", str(error.value)).group(1))
    assert first < depth - 1  # the first failure is not where the stack peaks
    fit = int(str(error.value).split("frac_bits <= ")[1].split()[0])
    y = ReversibleStack(layers, frac_bits=fit)(x)  # no second OverflowError
    assert torch.isfinite(y).all()


# -- 8. empty batch ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 3, DIM), (2, 0, DIM)], ids=["batch0", "tokens0"])
@pytest.mark.parametrize("exact", MODES)
def test_empty_batch_runs_like_the_twin(exact, shape):
    stack = stack_of(blocks(3) + [WidenTokens(DIM, DIM)] + blocks(2), exact)
    twin = twin_of(stack)
    x = torch.randn(*shape, dtype=dtype_of(exact), requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    want = grads_of(twin, x, lambda: loss_of(twin(x)))
    assert stack(x).shape == x.shape
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    with torch.no_grad():
        assert stack(x).shape == x.shape


# -- 9. buffers (BatchNorm) --------------------------------------------------------------------------


class BatchNormHalf(nn.Module):
    """A half with running statistics: Linear -> BatchNorm1d -> tanh on [N, C] rows."""

    def __init__(self, dim):
        super().__init__()
        self.lin, self.bn = nn.Linear(dim, dim), nn.BatchNorm1d(dim)

    def forward(self, x):
        return torch.tanh(self.bn(self.lin(x)))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_rebuild_leaves_buffers_as_the_forward_left_them(exact, schedule, depth):
    stack = stack_of([ReversibleBlock(BatchNormHalf(DIM), BatchNormHalf(DIM)) for _ in range(depth)], exact, schedule)
    twin = twin_of(stack)
    x = torch.randn(16, DIM, dtype=dtype_of(exact), requires_grad=True)
    for _ in range(2):  # two steps: the second one starts from the first one's statistics
        got = grads_of(stack, x, lambda: loss_of(stack(x)))
        want = grads_of(twin, x, lambda: loss_of(twin(x)))
    for (name, a), b in zip(stack.named_buffers(), twin.buffers()):
        assert torch.equal(a, b), name
    assert all(int(b) == 2 for name, b in stack.named_buffers() if name.endswith("num_batches_tracked"))
    if exact:
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    else:  # (the bias before a batch norm has a gradient of ~1e-17: an absolute floor)
        assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip([got[0]] + got[1], [want[0]] + want[1]))


class SpectralNormHalf(nn.Module):
    """A half whose forward reads buffers it then updates in place: spectral_norm's power iteration
    (its u and v vectors move one iteration in every training forward, and the weight is divided by
    the sigma they give). Issue 39, case 1: the rebuild ran one more iteration (2.6e-2 off)."""

    def __init__(self, dim):
        super().__init__()
        self.lin = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(dim, dim))

    def forward(self, x):
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [1, 2])
def test_rebuild_reads_the_buffers_the_forward_read(exact, schedule, depth):
    stack = stack_of([ReversibleBlock(SpectralNormHalf(DIM), BatchNormHalf(DIM)) for _ in range(depth)], exact, schedule)
    twin = twin_of(stack)
    x = torch.randn(16, DIM, dtype=dtype_of(exact), requires_grad=True)
    for _ in range(3):  # the first step finds the buffers the forward updates, later ones copy only those
        got = grads_of(stack, x, lambda: loss_of(stack(x)))
        want = grads_of(twin, x, lambda: loss_of(twin(x)))
        if exact:
            assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        else:
            assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip([got[0]] + got[1], [want[0]] + want[1]))
    for (name, a), b in zip(stack.named_buffers(), twin.buffers()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_functional_call_with_a_gradient_wanted_names_the_swapped_parameter(exact, trainable):
    """Issue 39, case 4: torch.func.functional_call swaps other tensors into the parameter slots for one
    call; the backward would rebuild with the module's own weights after it (x.grad 0.21 off, the passed
    weights without gradient). A forward recording a graph raises naming the parameter; under no_grad
    the call runs the passed weights, as the stored-activation twin does."""
    stack = stack_of(blocks(3), exact)
    twin = twin_of(stack)
    for p in stack.parameters():
        p.requires_grad_(trainable)
    weights = {name: (p.detach() * 0.5).requires_grad_(trainable) for name, p in stack.named_parameters()}
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"parameter f\.module\.module\.0\.weight of layer 0 .*functional_call"):
        torch.func.functional_call(stack, weights, (x,))
    with torch.no_grad():
        got = torch.func.functional_call(stack, weights, (x,))
        want = torch.func.functional_call(twin, weights, (x,))
        assert not torch.equal(got, stack(x))
    if exact:
        assert torch.equal(got, want)
    else:
        assert max_rel_error([got], [want]) <= 1e-12
    # nn.Parameter values pass the forward's check: the backward, after the call, sees the swap
    parameters = {name: nn.Parameter(w.detach(), requires_grad=trainable) for name, w in weights.items()}
    out = torch.func.functional_call(stack, parameters, (x,))
    with pytest.raises(RuntimeError, match=r"parameter f\.module\.module\.0\.weight of layer 0 .*functional_call"):
        loss_of(out).backward()
    del out
    loss_of(stack(x)).backward()  # the module's own weights again: a plain step works
    assert x.grad is not None


# -- 10. torch.autograd.grad(loss, x) ----------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [2, 3])
def test_grad_of_the_input_leaves_parameters_alone(exact, schedule, depth):
    layers = blocks(depth) + [WidenTokens(DIM, DIM)] + blocks(depth)
    stack = stack_of(layers, exact, schedule)
    twin = twin_of(stack)
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    got, = torch.autograd.grad(loss_of(stack(x)), x)
    want, = torch.autograd.grad(loss_of(twin(x)), x)
    assert all(p.grad is None for p in stack.parameters())
    assert all(p.grad is None for p in twin.parameters())
    if exact:
        assert torch.equal(got, want)
    else:
        assert max_rel_error([got], [want]) <= 1e-10
    # backward(inputs=[x]) likewise fills only x.grad
    loss_of(stack(x)).backward(inputs=[x])
    assert all(p.grad is None for p in stack.parameters())
    assert torch.equal(x.grad, got)
    # and a plain backward still fills every parameter's .grad
    loss_of(stack(x)).backward()
    assert all(p.grad is not None for p in stack.parameters())


@pytest.mark.parametrize("exact", MODES)
def test_a_module_used_inside_a_half_and_before_the_stack_refuses_a_partial_gradient(exact):
    """Issue 39 case 3: a module used by a half and before the stack. ``torch.autograd.grad(loss,
    [its weight])`` and ``backward(inputs=[its weight])`` would return the outside part alone (0.45
    relative off, silently): they raise, naming the parameter and loss.backward(); requests of
    other tensors, and loss.backward() (checked against plain autograd), are as before."""
    torch.manual_seed(0)
    shared = nn.Linear(DIM, DIM).to(dtype_of(exact))
    stack = stack_of([ReversibleBlock(nn.Sequential(nn.LayerNorm(DIM), shared), mlp(DIM))], exact, "sequential")
    stack.to(dtype_of(exact))
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    for ask in (lambda loss: torch.autograd.grad(loss, [shared.weight]),
                lambda loss: loss.backward(inputs=[shared.weight])):
        with pytest.raises(RuntimeError, match=r"gradient of f\.module\.1\.weight \(layer 0\).*loss\.backward\(\)"):
            ask(loss_of(stack(shared(x))))
    assert shared.weight.grad is None
    torch.autograd.grad(loss_of(stack(shared(x))), [x])  # the input: as before
    loss_of(stack(shared(x))).backward()
    got = [x.grad, shared.weight.grad]
    to_stored_activations(stack)  # in place: the twin's half holds the same shared module
    want = torch.autograd.grad(loss_of(stack(shared(x))), [x, shared.weight])
    assert max_rel_error(got, list(want)) <= (1e-5 if exact else 1e-10)


# -- 11. in-place op on a half's input -------------------------------------------------------------


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("half", ["F", "G"])
def test_in_place_op_on_a_half_input_is_named_at_forward(exact, half, grad):
    def inplace():
        return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(DIM, DIM))

    layers = blocks(1) + [ReversibleBlock(inplace(), mlp(DIM)) if half == "F" else ReversibleBlock(mlp(DIM), inplace())]
    stack = stack_of(layers, exact)
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=grad)
    with pytest.raises(RuntimeError, match=rf"the {half} half of layer 1 modified its input in place"):
        stack(x)


# -- 12. hooks on a ReversibleBlock -----------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("depth", [2, 3])
def test_block_hooks_fire_with_the_block_streams(exact, schedule, depth):
    stack = stack_of(blocks(depth), exact, schedule)
    twin = twin_of(stack)
    seen = {"pre": [], "post": [], "bpre": [], "bwd": []}
    first = stack[0]
    first.register_forward_pre_hook(lambda m, args: seen["pre"].append(args))
    first.register_forward_hook(lambda m, args, out: seen["post"].append((args, out)))
    first.register_full_backward_pre_hook(lambda m, grad_out: seen["bpre"].append(grad_out))
    first.register_full_backward_hook(lambda m, grad_in, grad_out: seen["bwd"].append((grad_in, grad_out)))
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    loss_of(stack(x)).backward()
    assert [len(v) for v in seen.values()] == [1, 1, 1, 1]
    (x1, x2), = seen["pre"]
    (_, (y1, y2)), = seen["post"]
    (dx1, dx2), (dy1, dy2) = seen["bwd"][0]
    assert all(torch.equal(a, b) for a, b in zip(seen["bpre"][0], (dy1, dy2)))
    assert torch.equal(x1, x2)  # both streams start as x (exact: its value on the 2**-16 grid)
    assert torch.equal(x1, x.detach()) if not exact else (x1 - x).abs().max() <= 2**-17
    # Block 0's input gradients make the stack input's: x.grad = dx1 + dx2, as the twin computes it.
    got = x.grad.clone()
    assert torch.equal(dx1 + dx2, got)
    want = grads_of(twin, x, lambda: loss_of(twin(x)))[0]
    assert torch.equal(got, want) if exact else max_rel_error([got], [want]) <= 1e-10
    with torch.no_grad():  # what the block computes from its inputs (float: exactly its plain forward)
        want1, want2 = first(x1, x2)
    tolerance = dict(rtol=0, atol=2**-14) if exact else dict(rtol=1e-12, atol=1e-12)
    assert torch.allclose(y1, want1, **tolerance) and torch.allclose(y2, want2, **tolerance)


@pytest.mark.parametrize("exact", MODES)
def test_block_hooks_can_replace_gradients_not_streams(exact):
    stack = stack_of(blocks(2), exact)
    x = torch.randn(2, 3, DIM, dtype=dtype_of(exact), requires_grad=True)
    handle = stack[0].register_full_backward_hook(lambda m, gi, go: (torch.zeros_like(gi[0]), torch.zeros_like(gi[1])))
    loss_of(stack(x)).backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    handle.remove()
    stack[1].register_forward_hook(lambda m, args, out: (out[0] * 2, out[1]))
    with pytest.raises(RuntimeError, match="forward hook on the reversible block at layer 1 returned a value"):
        stack(x)


# -- 13. the twin mirrors the engine with stage transitions anywhere --------------------------------


@pytest.mark.parametrize("layout", ["TBB", "BBT", "BTTB", "TTBBB", "BTBTB", "TT"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_twin_is_bitwise_with_transitions_at_the_ends_and_in_a_row(layout, schedule):
    layers = [WidenTokens(DIM, DIM) if c == "T" else blocks(1)[0] for c in layout]
    stack = ReversibleStack(layers, schedule=schedule)
    twin = twin_of(stack)
    x = torch.randn(2, 3, DIM, requires_grad=True)
    got = grads_of(stack, x, lambda: loss_of(stack(x)))
    want = grads_of(twin, x, lambda: loss_of(twin(x)))
    with torch.no_grad():
        assert torch.equal(stack(x), twin(x))
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


# -- 4. Hugging Face generate with use_cache=True ----------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_with_use_cache_gives_greedy_tokens(family, seeded):
    transformers = pytest.importorskip("transformers")
    from revtriton.convert import revify

    torch.manual_seed(seeded)
    common = dict(vocab_size=128, initializer_range=0.3, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_positions=64, n_embd=64, n_layer=3, n_head=4, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          **common)
        model = transformers.LlamaForCausalLM(config)
    name = type(model).__name__
    model = revify(model).eval()
    assert model.config.use_cache is True  # the user's setting is kept (it is saved with the model)
    assert type(model).__name__ == name  # what save_pretrained writes into config.architectures
    ids = torch.randint(1, 128, (2, 6))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         use_cache=True)
    greedy = ids
    with torch.no_grad():
        for _ in range(6):
            greedy = torch.cat([greedy, model(input_ids=greedy).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, greedy)


# -- 2. conditioning and captured tensors: tests/test_conditioning.py --------------------------------


def test_revified_gpt2_on_an_empty_batch_runs_like_its_twin(seeded):
    transformers = pytest.importorskip("transformers")
    from revtriton.convert import revify

    torch.manual_seed(seeded)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=3, n_head=4)
    model = revify(transformers.GPT2LMHeadModel(config))  # exact streams (the default)
    twin = twin_of(model)
    ids = torch.randint(0, 128, (0, 8))
    logits = model(input_ids=ids).logits
    assert logits.shape == (0, 8, 128) and torch.equal(logits, twin(input_ids=ids).logits)
    logits.sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
