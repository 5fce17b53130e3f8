"""revify on timm's EVA (EVA-02: rotary position embeddings, SwiGLU, layer scale), issue 15.

timm's own forward_features / forward_intermediates run; their block loops meet the stack's
stand-ins, and the attention halves take the model's rotary embedding as conditioning.
"""
import copy

import pytest
import torch

from revtriton.convert import revify
from revtriton.models import to_stored_activations

from test_models import check_against_twin

pytestmark = pytest.mark.timm
timm = pytest.importorskip("timm")
from timm.models.eva import Eva  # noqa: E402


def eva(seed, **overrides):
    torch.manual_seed(seed)
    config = dict(img_size=32, patch_size=8, num_classes=10, embed_dim=64, depth=3, num_heads=4, mlp_ratio=2.0,
                  swiglu_mlp=True, scale_mlp=True, use_rot_pos_emb=True, ref_feat_shape=(4, 4), init_values=0.5)
    model = Eva(**{**config, **overrides}).eval()
    with torch.no_grad():  # spread weights (timm's init is small): every branch shows in the outputs
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
def test_eva_keeps_its_function_and_intermediates(seeded):
    """A preserving conversion (meft3, 2**-16) computes the unconverted EVA: logits, and
    forward_intermediates (block by block, stopping early too); the rotary embedding mattered."""
    original = eva(seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    x = torch.randn(2, 3, 32, 32)
    close = dict(rtol=1e-3, atol=1e-3)  # the 2**-16 term of meft3 through 3 blocks; no rotary: ~0.1
    with torch.no_grad():
        theirs = original(x)
        torch.testing.assert_close(model(x), theirs, **close)
        wanted = original.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
        got = model.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
        for ours, them in zip(got, wanted):
            torch.testing.assert_close(ours, them, **close)
        early = model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        torch.testing.assert_close(early[0], wanted[0], **close)
        no_rope = copy.deepcopy(model)
        no_rope.rope = None
        assert (no_rope(x) - theirs).abs().max() > 1e-2


def test_eva_trains_as_its_stored_activation_twin(seeded):
    """Exact streams: a training step (stochastic depth drawn the same way) is bitwise the twin's."""
    model = revify(eva(seeded, drop_path_rate=0.2), exact=True).train()
    twin = to_stored_activations(copy.deepcopy(model))
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(seeded)
    loss = model(x).square().mean()
    loss.backward()
    torch.manual_seed(seeded)
    twin_loss = twin(x).square().mean()
    twin_loss.backward()
    check_against_twin(model, twin, loss, twin_loss, exact=True)


def test_eva_variants_it_cannot_convert_raise(seeded):
    with pytest.raises(NotImplementedError, match="EvaBlockPostNorm"):
        revify(eva(seeded, use_post_norm=True))
    model = revify(eva(seeded))
    with pytest.raises(RuntimeError, match="call the model"):
        model.blocks[0].coupling_halves()[0](torch.randn(1, 17, 64))
    with pytest.warns(UserWarning, match="not needed"):
        model.set_grad_checkpointing(True)


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("features_only", [False, True])
def test_registered_eva02_converts_as_created(features_only, seeded):
    """timm.create_model's EVA-02 (and its features_only wrapper, whose intermediates step through the
    stack) keeps its outputs under a preserving conversion."""
    torch.manual_seed(seeded)
    original = timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28,
                                 features_only=features_only, out_indices=(1, 3) if features_only else None).eval()
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    x = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        theirs, ours = original(x), model(x)
    for a, b in zip(ours if features_only else [ours], theirs if features_only else [theirs]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)

