"""Model presets: parameter counts, gradients vs their stored-activation twins, bad inputs."""
import copy

import pytest
import torch

from revtriton import LayerNormAttention, LayerNormMLP, RMSNormSwiGLU
from revtriton.engine import ReversibleStack
from revtriton.models import (GPT_PRESETS, RevGPT, RevMViT, RevViT, StageTransition, StoredActivationStack,
                              count_parameters, rev_gpt, rev_llama, rev_mvit, rev_vit, to_reversible,
                              to_stored_activations)

# Reference counts of the standard models (1000 classes, 224 px, patch 16 for the ViTs), as timm and
# Hugging Face report them; computed from the architecture formula below and, when the libraries are
# installed, from the libraries themselves.
VIT_COUNTS = {"tiny": 5_717_416, "small": 22_050_664, "base": 86_567_656, "large": 304_326_632}
TIMM_NAMES = {name: f"vit_{name}_patch16_224" for name in VIT_COUNTS}
GPT_COUNTS = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
              "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248}


def vit_formula(dim, depth, patch=16, img=224, classes=1000, chans=3, mlp_ratio=4):
    tokens = (img // patch) ** 2 + 1
    block = 2 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + 2 * dim \
        + (dim * mlp_ratio * dim + mlp_ratio * dim) + (mlp_ratio * dim * dim + dim)
    return chans * patch * patch * dim + dim + dim + tokens * dim + depth * block + 2 * dim + dim * classes + classes


def gpt2_formula(vocab, positions, dim, depth):
    block = 4 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (4 * dim * dim + 4 * dim) + (4 * dim * dim + dim)
    return vocab * dim + positions * dim + depth * block + 2 * dim


def llama_formula(vocab, dim, depth, heads, kv_heads, hidden):
    head_dim = dim // heads
    block = 2 * dim + dim * dim * 2 + 2 * dim * kv_heads * head_dim + 3 * dim * hidden
    return 2 * vocab * dim + depth * block + dim


def meta_count(build):
    with torch.device("meta"):
        return count_parameters(build())


def max_relative_grad_error(model, twin):
    """Worst per-tensor max|g - g_twin| / max|g_twin| (denominator floored at 1e-3 of the largest grad:
    some grads are ~0 by symmetry, e.g. a key bias under softmax, and their noise is no signal)."""
    pairs = [(n, p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters())]
    missing = [n for n, g, h in pairs if g is None or h is None]
    assert not missing, f"parameters without grads: {missing}"
    floor = 1e-3 * max(h.abs().max().item() for _, _, h in pairs)
    return max(((g - h).abs().max() / max(h.abs().max().item(), floor)).item() for _, g, h in pairs)


def check_against_twin(model, twin, loss, twin_loss, exact, float_bound=1e-5):
    """Exact streams: the same rounded function with the same summation order, so the loss and every
    gradient are bitwise equal. Float streams: equal to float rounding of the inverse (relative
    gradient error <= ``float_bound``)."""
    if exact:
        assert torch.equal(loss, twin_loss)
        differ = [n for (n, p), q in zip(model.named_parameters(), twin.parameters())  # (a frozen one: None in both)
                  if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad))]
        assert not differ, f"gradients not bitwise equal to the stored-activation twin: {differ}"
    else:
        assert torch.allclose(loss, twin_loss, rtol=1e-6, atol=0)
        assert max_relative_grad_error(model, twin) <= float_bound


def twin_grads(model, make_loss, seed):
    """Run the model and its stored-activation twin on the same RNG stream; return (twin, losses)."""
    twin = to_stored_activations(copy.deepcopy(model))
    assert any(isinstance(m, StoredActivationStack) for m in twin.modules())
    torch.manual_seed(seed)
    loss = make_loss(model)
    loss.backward()
    torch.manual_seed(seed)
    twin_loss = make_loss(twin)
    twin_loss.backward()
    return twin, loss, twin_loss


# -- parameter counts -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VIT_COUNTS))
def test_vit_preset_counts(name):
    model_count = meta_count(lambda: rev_vit(name))
    preset = {"tiny": (192, 12), "small": (384, 12), "base": (768, 12), "large": (1024, 24)}[name]
    assert vit_formula(*preset) == VIT_COUNTS[name]
    assert model_count == VIT_COUNTS[name]
    # Layer scale adds two gamma vectors per block, as timm's init_values does.
    assert meta_count(lambda: rev_vit(name, layer_scale=1e-5)) == VIT_COUNTS[name] + 2 * preset[0] * preset[1]
    # Mean pooling drops the cls token and its position.
    assert meta_count(lambda: rev_vit(name, pool="mean")) == VIT_COUNTS[name] - 2 * preset[0]


@pytest.mark.timm
@pytest.mark.parametrize("name", ["tiny", "base"])
def test_vit_preset_counts_match_timm(name):
    timm = pytest.importorskip("timm")
    assert meta_count(lambda: timm.create_model(TIMM_NAMES[name], pretrained=False)) == VIT_COUNTS[name]


@pytest.mark.parametrize("name", sorted(GPT_COUNTS))
def test_gpt_preset_counts(name):
    c = GPT_PRESETS[name].resolved()
    if c.style == "gpt2":
        assert gpt2_formula(c.vocab_size, c.block_size, c.dim, c.depth) == GPT_COUNTS[name]
    else:
        assert llama_formula(c.vocab_size, c.dim, c.depth, c.heads, c.kv_heads, c.hidden) == GPT_COUNTS[name]
    assert meta_count(lambda: rev_gpt(name)) == GPT_COUNTS[name]


def test_gpt_preset_counts_match_transformers():
    transformers = pytest.importorskip("transformers")
    hf = meta_count(lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()))
    assert hf == GPT_COUNTS["gpt2"]
    llama = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)
    assert meta_count(lambda: transformers.LlamaForCausalLM(llama)) == GPT_COUNTS["llama2-7b"]


def test_the_presets_truncated_normal_is_the_distribution_in_its_bounds(seeded):
    """models.common.trunc_normal_ (the inverse CDF in one pass, where torch's redraws whole tensors):
    every value within [a, b], and the mean and standard deviation of N(0, std) truncated there
    (2**20 draws: the bounds below are over 10 standard errors of each estimate)."""
    import math

    from revtriton.models.common import trunc_normal_

    std, n = 0.02, 2**20
    for a, b in ((-2 * std, 2 * std), (-std, 3 * std)):
        x = trunc_normal_(torch.empty(n, dtype=torch.float64), std=std, a=a, b=b)
        assert a <= x.min() and x.max() <= b
        alpha, beta = a / std, b / std
        pdf = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
        cdf = lambda t: (1 + math.erf(t / math.sqrt(2))) / 2  # noqa: E731
        z = cdf(beta) - cdf(alpha)
        mean = std * (pdf(alpha) - pdf(beta)) / z
        var = std**2 * (1 + (alpha * pdf(alpha) - beta * pdf(beta)) / z - ((pdf(alpha) - pdf(beta)) / z) ** 2)
        assert abs(x.mean().item() - mean) < 10 * math.sqrt(var / n)
        assert abs(x.std().item() / math.sqrt(var) - 1) < 10 / math.sqrt(2 * n)
    assert trunc_normal_(torch.empty(8, 8), std=1.0, a=-2.0, b=2.0).dtype == torch.float32


# -- gradients vs the stored-activation twin ----------------------------------------------------


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("pool", ["token", "mean"])
def test_revvit_gradients_match_twin(seeded, exact, pool):
    model = rev_vit("small", depth=3, img_size=32, num_classes=10, pool=pool, drop_path_rate=0.2, layer_scale=0.1,
                    exact=exact)
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    twin, loss, twin_loss = twin_grads(model, lambda m: torch.nn.functional.cross_entropy(m(images), labels), seeded)
    check_against_twin(model, twin, loss, twin_loss, exact)


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_revgpt_gradients_match_twin(seeded, exact, preset):
    model = rev_gpt(preset, depth=3, drop_path_rate=0.1, exact=exact)
    idx = torch.randint(0, 256, (2, 48))
    twin, loss, twin_loss = twin_grads(model, lambda m: m(idx[:, :-1], idx[:, 1:])[1], seeded)
    check_against_twin(model, twin, loss, twin_loss, exact)


@pytest.mark.parametrize("exact", [False, True])
def test_revmvit_gradients_match_twin(seeded, exact):
    model = rev_mvit("xs", img_size=16, in_chans=1, num_classes=10, patch_kernel=3, patch_stride=2,
                     drop_path_rate=0.2, exact=exact)
    kinds = [type(layer).__name__ for layer in model.blocks]
    assert kinds.count("StageTransition") == 2 and kinds.count("ReversibleBlock") == 4
    images, labels = torch.randn(4, 1, 16, 16), torch.randint(0, 10, (4,))
    twin, loss, twin_loss = twin_grads(model, lambda m: torch.nn.functional.cross_entropy(m(images), labels), seeded)
    check_against_twin(model, twin, loss, twin_loss, exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("preset", ["vit", "llama-tiny"])
def test_models_held_in_bf16_or_float64_train_exactly(seeded, dtype, preset):
    """No autocast: the whole model in bf16 (or float64). Exact streams hand the halves values in
    that dtype, and the gradients are bitwise the stored-activation twin's."""
    if preset == "vit":
        model = rev_vit("small", depth=2, img_size=32, num_classes=10, drop_path_rate=0.2).to(dtype)
        images, labels = torch.randn(2, 3, 32, 32, dtype=dtype), torch.randint(0, 10, (2,))
        make_loss = lambda m: torch.nn.functional.cross_entropy(m(images).float(), labels)  # noqa: E731
    else:
        model = rev_gpt(preset, depth=2, drop_path_rate=0.1).to(dtype)
        idx = torch.randint(0, 256, (2, 24))
        make_loss = lambda m: m(idx[:, :-1], idx[:, 1:])[1]  # noqa: E731
    twin, loss, twin_loss = twin_grads(model, make_loss, seeded)
    assert torch.isfinite(loss)
    assert all(p.grad.dtype == dtype for p in model.parameters())
    check_against_twin(model, twin, loss, twin_loss, exact=True)


@pytest.mark.parametrize("make", [lambda: LayerNormMLP(16, 32, drop_path=0.25),
                                  lambda: RMSNormSwiGLU(16, 32, drop_path=0.25),
                                  lambda: LayerNormAttention(16, 2, drop_path=0.25)], ids=["mlp", "swiglu", "attn"])
def test_drop_path_drops_whole_samples_and_rescales(seeded, make):
    """Stochastic depth as timm: per sample, all its tokens dropped or all scaled by 1 / keep."""
    half = make()
    x = torch.randn(64, 5, 16)
    full = half.eval()(x)
    out = half.train()(x)
    dropped = out.flatten(1).abs().amax(1) == 0
    kept = ~dropped
    assert 0 < int(dropped.sum()) < 64  # both happen (p = 0.25 over 64 samples)
    assert torch.allclose(out[kept], full[kept] / 0.75, rtol=1e-5, atol=1e-6)
    res = torch.randn_like(x)
    torch.manual_seed(seeded)
    via_couple, _ = half.couple(res, x, +1)
    torch.manual_seed(seeded)
    assert torch.allclose(via_couple - res, half(x), rtol=1e-5, atol=1e-6)  # couple draws the same mask


def test_twin_check_detects_a_different_model(seeded):
    """The comparison above can fail: a twin with one perturbed weight is caught."""
    model = rev_gpt("gpt2-tiny", depth=2, exact=False)
    idx = torch.randint(0, 256, (2, 16))
    twin = to_stored_activations(copy.deepcopy(model))
    with torch.no_grad():
        twin.blocks[1].coupling_halves()[1].fc1.weight.mul_(1.001)
    model(idx, idx)[1].backward()
    twin(idx, idx)[1].backward()
    assert max_relative_grad_error(model, twin) > 1e-5


def test_revmvit_shapes_and_training_on_cpu(seeded):
    model = rev_mvit("xs", img_size=16, in_chans=1, num_classes=10, patch_kernel=3, patch_stride=2)
    assert model.grid == (8, 8) and model.out_grid == (2, 2)
    images, labels = torch.randn(8, 1, 16, 16), torch.randint(0, 10, (8,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_stage_transition_pools_and_widens(seeded):
    block = StageTransition(16, 32, heads=2, grid=(5, 5), q_stride=2, kv_stride=2)
    out = block(torch.randn(2, 25, 16))
    assert out.shape == (2, 9, 32) and block.out_grid == (3, 3)
    with pytest.raises(ValueError, match="24 tokens|25 tokens"):
        block(torch.randn(2, 24, 16))


# -- structure, round trips, bad inputs -------------------------------------------------------


def test_twin_switch_keeps_parameters_and_keys():
    model = rev_vit("tiny", depth=2, img_size=32, num_classes=3)
    keys = list(model.state_dict())
    to_stored_activations(model)
    assert type(model.blocks) is StoredActivationStack and list(model.state_dict()) == keys
    to_reversible(model)
    assert type(model.blocks) is ReversibleStack
    plain = rev_vit("tiny", depth=2, img_size=32, num_classes=3, reversible=False)
    assert type(plain.blocks) is StoredActivationStack and list(plain.state_dict()) == keys


def test_revvit_grad_checkpointing_request_warns_and_training_runs(seeded):
    """timm's train script calls set_grad_checkpointing(True): reversible blocks need none."""
    model = rev_vit("tiny", img_size=32, patch_size=16, depth=2, num_classes=3)
    with pytest.warns(UserWarning, match="gradient checkpointing is not needed"):
        model.set_grad_checkpointing(True)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_revvit_exact_inverse_is_bitwise(seeded):
    model = rev_vit("tiny", depth=4, img_size=32, num_classes=3).eval()
    x = torch.randn(2, 5, 192)
    with torch.no_grad():
        s = torch.round(x * 2**16).to(torch.int32)
        y1, y2 = model.blocks.forward_streams(s, s)
        x1, x2 = model.blocks.inverse(y1, y2)
    assert torch.equal(x1, s) and torch.equal(x2, s)


def test_revgpt_state_dict_round_trip(seeded):
    model = rev_llama("llama-tiny", depth=2)
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx)[1].backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    fresh = rev_llama("llama-tiny", depth=2)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(idx)[0], fresh(idx)[0])


def test_tied_embeddings():
    gpt = rev_gpt("gpt2-tiny", depth=1)
    assert gpt.lm_head.weight is gpt.tok_embed.weight
    llama = rev_llama("llama-tiny", depth=1)
    assert llama.lm_head.weight is not llama.tok_embed.weight and llama.pos_embed is None


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="unknown RevViT preset"):
        rev_vit("huge")
    with pytest.raises(ValueError, match="unknown RevGPT preset"):
        rev_gpt("gpt5")
    with pytest.raises(ValueError, match="not a LLaMA-style preset"):
        rev_llama("gpt2")
    with pytest.raises(ValueError, match="pool"):
        RevViT(img_size=32, dim=32, depth=1, heads=2, pool="max")
    with pytest.raises(ValueError, match="divide img_size"):
        RevViT(img_size=30, patch_size=16, dim=32, depth=1, heads=2)
    with pytest.raises(TypeError, match="unexpected"):
        RevViT(img_size=32, dim=32, depth=1, heads=2, bogus=1)
    with pytest.raises(ValueError, match="kv_heads"):
        RevGPT(GPT_PRESETS["gpt2-tiny"], kv_heads=2)
    with pytest.raises(ValueError, match="one entry per stage"):
        RevMViT(dims=(8, 16), heads=(1,), depths=(1, 1))
    vit = rev_vit("tiny", depth=1, img_size=32)
    with pytest.raises(ValueError, match="32x32"):
        vit(torch.randn(1, 3, 64, 64))
    gpt = rev_gpt("gpt2-tiny", depth=1)
    with pytest.raises(ValueError, match="block_size"):
        gpt(torch.zeros(1, 257, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        gpt(torch.zeros(1, 8))
