"""The RevViT presets as timm models (issue 15): ``timm.create_model("rev_vit_*_patch16_224")``
builds RevViT with timm's sizes and parameter counts, and RevViT has timm's model API
(forward_features / forward_head / reset_classifier / get_classifier, num_classes, num_features,
global_pool), timm's data config, optimizer factory and checkpoint loading work on it, and what it
lacks (pretrained weights, per-block features) raises with the way to get it."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from revtriton.models import VIT_PRESETS, RevViT, count_parameters

pytestmark = pytest.mark.timm
timm = pytest.importorskip("timm")
import revtriton.models.timm_models  # noqa: E402,F401  (registers the presets with timm)
from timm.data import resolve_model_data_config  # noqa: E402
from timm.optim import create_optimizer_v2  # noqa: E402

NAMES = {preset: f"rev_vit_{preset}_patch16_224" for preset in VIT_PRESETS}
# Small enough for the CPU interpreter: 32 px, patch 8 (16 patches), 2 blocks of width 32.
SMALL = dict(img_size=32, patch_size=8, dim=32, depth=2, heads=2)


def small_model(pool="token", num_classes=5, **overrides):
    return timm.create_model(NAMES["tiny"], pretrained=False, num_classes=num_classes, pool=pool,
                             **{**SMALL, **overrides})


def images(batch=3):
    return torch.randn(batch, 3, SMALL["img_size"], SMALL["img_size"])


def pooled_reference(model, tokens):
    """RevViT's pooling written out: the cls token (its tokens are already normed), or the final
    norm of the mean of the tokens."""
    return tokens[:, 0] if model.pool == "token" else model.norm(tokens.mean(dim=1))


# -- the registered names ---------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(VIT_PRESETS))
def test_create_model_builds_the_preset_with_timms_sizes(preset):
    assert timm.is_model(NAMES[preset])
    assert NAMES[preset] not in timm.list_models(pretrained=True)  # no weights claimed
    with torch.device("meta"):  # sizes only: no memory, no init cost
        model = timm.create_model(NAMES[preset], pretrained=False, num_classes=10)
        theirs = timm.create_model(f"vit_{preset}_patch16_224", pretrained=False, num_classes=10)
    sizes = VIT_PRESETS[preset]
    assert isinstance(model, RevViT)
    assert (model.dim, len(model.blocks), model.blocks[0].f.heads) == (sizes["dim"], sizes["depth"], sizes["heads"])
    assert model.patch_size == 16 and model.img_size == 224
    assert model.num_classes == 10 and model.get_classifier().out_features == 10
    assert model.num_features == model.head_hidden_size == theirs.num_features == sizes["dim"]
    assert model.global_pool == theirs.global_pool == "token"
    assert count_parameters(model) == count_parameters(theirs)
    assert model.pretrained_cfg["url"] == "" and model.pretrained_cfg["input_size"] == (3, 224, 224)


def test_mean_pool_has_the_parameters_of_timms_avg_pool_without_cls_token():
    with torch.device("meta"):
        model = timm.create_model(NAMES["tiny"], num_classes=10, global_pool="avg")
        theirs = timm.create_model("vit_tiny_patch16_224", num_classes=10, global_pool="avg", class_token=False)
    assert model.pool == "mean" and model.global_pool == "avg" and model.cls_token is None
    assert count_parameters(model) == count_parameters(theirs)


def test_create_model_passes_revvit_arguments_through():
    model = timm.create_model(NAMES["small"], img_size=(32, 32), patch_size=8, depth=3, num_classes=7,
                              in_chans=1, drop_path_rate=0.1, exact=False, frac_bits=12, layer_scale=1e-5,
                              pretrained_cfg_overlay=dict(crop_pct=1.0), cache_dir="/nonexistent")
    assert model.img_size == 32 and model.in_chans == 1 and len(model.blocks) == 3 and model.num_classes == 7
    assert model.blocks.exact is False and model.blocks.frac_bits == 12
    assert model.pretrained_cfg["crop_pct"] == 1.0
    config = resolve_model_data_config(model)
    assert config["input_size"] == (1, 32, 32)  # the only size RevViT takes
    with pytest.raises(ValueError, match="not both"):
        timm.create_model(NAMES["tiny"], pool="mean", global_pool="avg", **SMALL)
    with pytest.raises(ValueError, match="square"):
        timm.create_model(NAMES["tiny"], **{**SMALL, "img_size": (32, 64)})
    with pytest.raises(TypeError, match="unexpected"):
        timm.create_model(NAMES["tiny"], bogus=1, **SMALL)


def test_what_the_presets_lack_raises_with_the_way_to_get_it():
    with pytest.raises(ValueError, match=r"no pretrained weights.*revtriton\.revify\(timm\.create_model"):
        timm.create_model(NAMES["base"], pretrained=True)
    with pytest.raises(NotImplementedError, match=r"features_only.*revtriton\.revify\(.*forward_intermediates"):
        timm.create_model(NAMES["base"], features_only=True)
    model = small_model()
    with pytest.raises(NotImplementedError, match=r"revtriton\.revify\("):
        model.forward_intermediates(images())
    with pytest.raises(NotImplementedError, match=r"revtriton\.revify\("):
        model.prune_intermediate_layers(1)


def test_revtriton_does_not_import_timm():
    script = "import sys, revtriton, revtriton.models; assert 'timm' not in sys.modules, 'timm imported'"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# -- timm's model API ---------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["token", "mean"])
def test_forward_is_forward_head_of_forward_features(seeded, pool):
    # Training mode with dropout and stochastic depth: the same random stream gives the same bits.
    model = small_model(pool, drop_rate=0.3, drop_path_rate=0.2).train()
    x = images()
    torch.manual_seed(seeded + 1)
    out = model(x)
    torch.manual_seed(seeded + 1)
    split = model.forward_head(model.forward_features(x))
    assert out.shape == (3, 5) and torch.equal(out, split)

    model.eval()
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape == (3, 16 + (pool == "token"), SMALL["dim"])
        features = model.forward_head(tokens, pre_logits=True)
        assert features.shape == (3, SMALL["dim"])
        assert torch.equal(features, pooled_reference(model, tokens))
        assert torch.equal(model(x), model.head(features))


@pytest.mark.parametrize("pool", ["token", "mean"])
def test_reset_classifier(seeded, pool):
    model = small_model(pool).eval()
    x = images()
    old_head = model.get_classifier()
    with torch.no_grad():
        features = model.forward_head(model.forward_features(x), pre_logits=True)

    model.reset_classifier(7)
    head = model.get_classifier()
    assert head is model.head and head is not old_head
    assert isinstance(head, nn.Linear) and (head.in_features, head.out_features) == (SMALL["dim"], 7)
    assert model.num_classes == 7 and model.pool == pool and not head.training
    with torch.no_grad():
        assert torch.equal(model(x), head(features))  # the new head on the same features

    # global_pool naming the current pooling (timm's name or RevViT's) keeps it.
    model.reset_classifier(4, global_pool=model.global_pool)
    model.reset_classifier(3, global_pool=pool)
    assert model.num_classes == 3 and model.pool == pool
    with torch.no_grad():
        assert model(x).shape == (3, 3)

    # 0 classes: no head, forward gives the pooled features.
    model.reset_classifier(0)
    assert isinstance(model.get_classifier(), nn.Identity) and model.num_classes == 0
    with torch.no_grad():
        assert torch.equal(model(x), features)

    # A pooling the model cannot switch to (it would add or drop the cls token) or has not: refused, unchanged.
    other = "avg" if pool == "token" else "token"
    for bad, message in ((other, "cls token"), ("max", "RevViT pools with"), ("", "RevViT pools with")):
        with pytest.raises(ValueError, match=message):
            model.reset_classifier(9, global_pool=bad)
        assert model.num_classes == 0 and model.pool == pool
    with pytest.raises(ValueError, match="num_classes"):
        model.reset_classifier(-1)


def test_reset_classifier_follows_the_models_dtype_and_mode(seeded):
    model = small_model().double().train()
    model.reset_classifier(6)
    assert model.head.weight.dtype == torch.float64 and model.head.training
    assert model(images().double()).shape == (3, 6)


def test_num_classes_zero_gives_pooled_features(seeded):
    model = small_model("mean", num_classes=0).eval()
    x = images()
    assert isinstance(model.get_classifier(), nn.Identity)
    with torch.no_grad():
        assert torch.equal(model(x), pooled_reference(model, model.forward_features(x)))


@pytest.mark.parametrize("pool", ["token", "mean"])
def test_training_step_with_timms_optimizer(seeded, pool):
    model = small_model(pool, drop_path_rate=0.1).train()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-2, weight_decay=0.05)
    # pos_embed and cls_token stay out of weight decay, as in timm's ViT.
    no_decay = next(group for group in optimizer.param_groups if group["weight_decay"] == 0.0)
    assert any(p is model.pos_embed for p in no_decay["params"])

    x, labels = images(4), torch.randint(0, 5, (4,))
    loss = nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    assert torch.isfinite(loss)
    named = dict(model.named_parameters())
    for name in ("head.weight", "head.bias", "norm.weight", "pos_embed", "patch_embed.weight"):
        assert torch.isfinite(named[name].grad).all() and named[name].grad.abs().sum() > 0, name
    block_grads = {n: p.grad for n, p in named.items() if n.startswith("blocks.")}
    assert block_grads and all(g is not None and torch.isfinite(g).all() for g in block_grads.values())
    assert all(block_grads[f"blocks.{i}.{half}.qkv.weight" if half == "f" else f"blocks.{i}.{half}.fc1.weight"]
               .abs().sum() > 0 for i in range(SMALL["depth"]) for half in ("f", "g"))

    before = {n: p.detach().clone() for n, p in named.items()}
    optimizer.step()
    assert all(not torch.equal(before[n], named[n]) for n in ("head.weight", "blocks.0.f.qkv.weight", "pos_embed"))


def test_checkpoint_path_loads_the_weights(seeded, tmp_path):
    model = small_model("mean").eval()
    path = tmp_path / "rev_vit.pth"
    torch.save(model.state_dict(), path)
    loaded = timm.create_model(NAMES["tiny"], num_classes=5, pool="mean", checkpoint_path=str(path), **SMALL).eval()
    x = images()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
