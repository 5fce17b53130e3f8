"""CLIP and SigLIP encoders under revify (revtriton/convert/clip.py): each text or vision tower a
reversible stack run through the library's own forward (its embeddings, masks and pooling), both
towers of CLIPModel / SiglipModel, the heads around them."""
import copy

import pytest
import torch

from revtriton import ReversibleStack
from revtriton.convert import revify

from revified import assert_exact_step_equals_twin, assert_round_trips
from test_models import check_against_twin

transformers = pytest.importorskip("transformers")

DEPTH = 3
KINDS = ("CLIP", "Siglip", "Siglip2", "MetaClip2")  # (MetaCLIP 2: CLIP's modules)


def _configs(kind):
    text = getattr(transformers, f"{kind}TextConfig")(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4,
        max_position_embeddings=32, pad_token_id=1,
        **(dict(bos_token_id=0, eos_token_id=2) if kind in ("CLIP", "MetaClip2") else {}))
    # SigLIP 2 takes patches as they come (up to 16 of 4 x 4 pixels a sample, a mask of the padded ones).
    size = dict(num_patches=16, patch_size=4) if kind == "Siglip2" else dict(image_size=32, patch_size=8)
    vision = getattr(transformers, f"{kind}VisionConfig")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH, num_attention_heads=4, **size)
    return text, vision


def _model(kind, tower, seed):
    """A tiny random-init model: ``tower`` "text" / "vision" (the tower model), or "both" (CLIPModel /
    SiglipModel). Weights off their small init, so that every branch shows in the outputs."""
    torch.manual_seed(seed)
    text, vision = _configs(kind)
    if tower == "both":
        config = getattr(transformers, f"{kind}Config")(text_config=text.to_dict(), vision_config=vision.to_dict())
        model = getattr(transformers, f"{kind}Model")(config)
    else:
        model = getattr(transformers, f"{kind}{tower.title()}Model")(text if tower == "text" else vision)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1)
    return model.eval()


def _inputs(tower, kind="CLIP"):
    """Images (SigLIP 2: 16 patches a sample, the second sample's last 4 padding); or token ids with the
    end-of-text id (CLIP pools at it) and a right-padded second row."""
    if tower == "vision" and kind == "Siglip2":
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 12:] = 0
        return dict(pixel_values=torch.randn(2, 16, 3 * 4 * 4), pixel_attention_mask=mask,
                    spatial_shapes=torch.tensor([[4, 4], [3, 4]]))
    if tower == "vision":
        return dict(pixel_values=torch.randn(2, 3, 32, 32))
    ids = torch.randint(3, 100, (2, 9))
    ids[0, -1], ids[1, 5] = 2, 2
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return dict(input_ids=ids, attention_mask=mask)


def _outputs(out):
    """The tensors a caller reads of a tower's or a two-tower model's output."""
    if hasattr(out, "logits_per_image"):  # (each tower's hidden states: the outer model captures none itself)
        return [out.logits_per_image, out.text_embeds, out.image_embeds, *out.text_model_output.hidden_states,
                *out.vision_model_output.hidden_states]
    return [out.last_hidden_state, out.pooler_output, *out.hidden_states]


def _stacks(model):
    return [m for m in model.modules() if isinstance(m, ReversibleStack)]


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("tower", ["text", "vision", "both"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_preserving_conversion_keeps_the_librarys_function(kind, tower, seeded):
    """meft3 keeps what the pretrained model computes: the last and every hidden state and the pooled
    output of a tower (the text one causal in CLIP, with padding), the image-text logits of both;
    each tower is a stack of its own."""
    original = _model(kind, tower, seeded)
    model = revify(copy.deepcopy(original), preserve="meft3", scale_bits=16, exact=False).eval()
    assert len(_stacks(model)) == (2 if tower == "both" else 1)
    inputs = {**_inputs("text"), **_inputs("vision", kind)} if tower == "both" else _inputs(tower, kind)
    options = dict(output_hidden_states=True)
    with torch.no_grad():
        theirs, ours = _outputs(original(**inputs, **options)), _outputs(model(**inputs, **options))
    assert len(ours) == len(theirs)
    for got, expected in zip(ours, theirs):
        # meft3's scaled couplings round each branch at 2**-16 of its scale: far below the weights' size.
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-3 * expected.abs().max().item())


@pytest.mark.parametrize("tower", ["text", "vision"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_fused_kernels_run_where_they_compute_the_branch(kind, tower, seeded):
    """A training step runs no attention module of the library (the fused attention computes it, the
    text towers' padding by its token layout; not SigLIP 2's patch mask) and no MLP module of SigLIP
    (tanh GELU); CLIP's quick-GELU MLP runs the layer's own. The step's gradients match the unconverted
    layers' function: the stored-activation twin of the same halves is checked elsewhere; here, against
    the library's modules forced on every half (float streams in float64: equal to its rounding)."""
    model = revify(_model(kind, tower, seeded), exact=False).double().train()
    calls = {"self_attn": 0, "mlp": 0}

    def counter(name):
        def count(*_):
            calls[name] += 1
        return count

    for layer in model.encoder.layers:
        for name in calls:
            getattr(layer, name).register_forward_pre_hook(counter(name))
    inputs = {name: t.double() if t.is_floating_point() else t for name, t in _inputs(tower, kind).items()}

    def step():
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        loss = out.last_hidden_state.square().mean() + out.pooler_output.square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step()
    # Each count: the forward and the rebuild. SigLIP 2's padded patches: a mask only the library's
    # attention sees (the fused attention takes token layouts, the text towers' padding).
    assert calls["self_attn"] == (2 * DEPTH if (kind, tower) == ("Siglip2", "vision") else 0)
    assert calls["mlp"] == (2 * DEPTH if kind in ("CLIP", "MetaClip2") else 0)
    for layer in model.encoder.layers:
        layer._revtriton_spec.fused_attention, layer._revtriton_spec.activation = False, None
    calls["self_attn"] = 0
    module_loss, module_grads = step()
    assert calls["self_attn"] == 2 * DEPTH
    torch.testing.assert_close(loss, module_loss, rtol=1e-12, atol=0)
    assert grads.keys() == module_grads.keys()
    # Relative to the largest gradient of the step: the key projection's bias has none (softmax does
    # not see a shift of all keys), only rounding of the other terms' size.
    scale = max(g.abs().max().item() for g in module_grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, module_grads[name], rtol=0, atol=1e-10 * scale, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_token_chunk_keeps_the_gradients_of_the_whole_towers(kind, seeded):
    """``revify(token_chunk=7)``: both towers' MLPs by 7 rows, their attention a sample at a time (the
    text's padded rows with their mask). Float streams, eval mode, float64 (these random weights make
    sharp attention, which magnifies fp32 rounding to 1e-4 of the key bias's null gradient): the
    contrastive loss and gradients of the unchunked model up to float64 rounding."""
    whole = revify(_model(kind, "both", seeded), exact=False).double().eval()
    chunked = revify(_model(kind, "both", seeded), exact=False, token_chunk=7).double().eval()
    inputs = {**_inputs("text"), **_inputs("vision", kind), "return_loss": True}
    inputs["pixel_values"] = inputs["pixel_values"].double()
    losses = [model(**inputs).loss for model in (whole, chunked)]
    for loss in losses:
        loss.backward()
    check_against_twin(chunked, whole, losses[1], losses[0], False, 1e-9)


def test_clip_text_attention_stays_causal(seeded):
    """A CLIP text tower's first tokens do not see the later ones (its layers get is_causal=True and,
    without padding, no mask: the halves pass it on), so changing the last token leaves the others."""
    model = revify(_model("CLIP", "text", seeded), exact=True).eval()
    ids = _inputs("text")["input_ids"]
    other = ids.clone()
    other[:, -1] = (ids[:, -1] + 1) % 100
    for fused in (True, False):  # the fused kernels; the layer's own attention module (the library's call)
        for layer in model.encoder.layers:
            layer._revtriton_spec.fused_attention = fused
        with torch.no_grad():
            a, b = model(input_ids=ids).last_hidden_state, model(input_ids=other).last_hidden_state
        assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1]), fused
        for layer in model.encoder.layers:
            layer._revtriton_spec.fused_attention = True
    attention = model.encoder.layers[0].coupling_halves()[0]  # alone (no mask from the model): causal too
    x = torch.randn(2, 5, 32)
    y = x.clone()
    y[:, -1] += 1.0
    with torch.no_grad():
        assert torch.equal(attention(x)[:, :-1], attention(y)[:, :-1])
        model.encoder.layers[0]._revtriton_spec.fused_attention = False  # the layer's own module, alone
        assert torch.equal(attention(x)[:, :-1], attention(y)[:, :-1])


@pytest.mark.parametrize("kind", KINDS)
def test_both_towers_train_bitwise_their_twin_save_and_pickle(kind, seeded, tmp_path):
    """The contrastive loss of CLIPModel / SiglipModel (both towers reversible, padding in the text):
    an exact training step's loss and every gradient bitwise equal the stored-activation twin's; then
    save_pretrained -> revtriton.from_pretrained, a pickle, and a fresh process's unpickling give its
    logits."""
    model = revify(_model(kind, "both", seeded), exact=True).train()
    inputs = {**_inputs("text"), **_inputs("vision", kind)}
    assert_exact_step_equals_twin(model, lambda m: m(**inputs, return_loss=True).loss)
    assert all(p.grad is not None for name, p in model.named_parameters() if ".layers." in name)
    loaded = assert_round_trips(model, inputs, tmp_path, output="logits_per_image")
    assert len(_stacks(loaded)) == 2


def test_the_heads_around_a_tower_convert_it():
    """A tower with its projection, or a classifier over the vision tower, converts that tower."""
    text, vision = _configs("CLIP")
    for model in (transformers.CLIPTextModelWithProjection(text), transformers.CLIPVisionModelWithProjection(vision),
                  transformers.CLIPForImageClassification(transformers.CLIPConfig(
                      text_config=text.to_dict(), vision_config=vision.to_dict(), num_labels=3))):
        revify(model)
        assert len(_stacks(model)) == 1, type(model).__name__
    model = transformers.CLIPForImageClassification(transformers.CLIPConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), num_labels=3))
    revify(model, exact=True).train()
    model(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([0, 2])).loss.backward()
    assert model.vision_model.encoder.layers[0].layer_norm1.weight.grad is not None


def test_a_layer_with_other_parts_is_refused_naming_them():
    model = _model("Siglip", "vision", 0)
    model.encoder.layers[1].adapter = torch.nn.Identity()  # an extra part the halves would not run
    with pytest.raises(NotImplementedError, match=r"SiglipEncoderLayer has parts \['adapter', 'layer_norm1'"):
        revify(model)
    assert not _stacks(model)  # nothing changed
