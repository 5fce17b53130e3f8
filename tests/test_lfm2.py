"""LFM2 and LFM2-MoE (revtriton.convert.lfm2): hybrid decoders whose pre-norm layers run attention or a
gated short convolution, each converted with both halves on the layer's own modules: the library's
function kept under the preserving conversions (logits on whole and left-padded rows, cached greedy
generation: the attention's keys and values and the convolution's state in the cache), an exact
training step bitwise its stored-activation twin's, save / load / pickle, a half alone refused."""
import pytest
import torch

from revtriton.convert import revify

from test_host_forward import assert_preserved_on_whole_and_padded_rows, assert_trains_saves_and_pickles

transformers = pytest.importorskip("transformers")

# Odd depth, both kinds, two convolution layers in a row and the last layer an attention one.
LAYER_TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]


def _lfm2(seed, moe=False):
    """A tiny LFM2 (LFM2-MoE: its first layer dense, the others a mixture of experts), its norms off their
    init (ones, where a norm left out would change nothing)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4,
                  num_key_value_heads=2, layer_types=LAYER_TYPES, conv_L_cache=3, pad_token_id=0,
                  initializer_range=0.3)
    if moe:
        config = transformers.Lfm2MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                            num_experts_per_tok=2, num_dense_layers=1, **common)
        model = transformers.Lfm2MoeForCausalLM(config)
    else:
        config = transformers.Lfm2Config(intermediate_size=96, block_auto_adjust_ff_dim=False, **common)
        model = transformers.Lfm2ForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.filterwarnings("ignore:revtriton. float streams with scaled couplings")  # inference only
@pytest.mark.parametrize("moe", [False, True], ids=["lfm2", "lfm2-moe"])
@pytest.mark.parametrize("preserve", ["meft1", "meft3"])
def test_lfm2_keeps_the_librarys_function(preserve, moe, seeded):
    """The convolution layers take the model's padding mask (left padding zeroed before the convolution
    reads it), the attention layers its causal mask: the library's logits on whole and left-padded
    rows and its cached greedy generation."""
    assert_preserved_on_whole_and_padded_rows(_lfm2(seeded, moe), preserve)


@pytest.mark.parametrize("moe", [False, True], ids=["lfm2", "lfm2-moe"])
def test_lfm2_trains_saves_and_pickles(moe, seeded, tmp_path):
    """An exact training step bitwise equals its stored-activation twin's; save / load and a fresh
    process's unpickling give the converted model back; a half called alone refuses (the mask and the
    rotary embedding are the model's)."""
    model = revify(_lfm2(seeded, moe), exact=True).train()
    assert_trains_saves_and_pickles(model, torch.randint(1, 128, (2, 10)), tmp_path, seed=seeded)
    for block in model.model.layers[:2]:  # a convolution layer and an attention layer
        with pytest.raises(RuntimeError, match="call the model"):
            block.coupling_halves()[0](torch.randn(1, 4, 64))


def test_a_layer_missing_its_parts_is_refused_naming_it(seeded):
    model = _lfm2(seeded)
    del model.model.layers[2].ffn_norm
    with pytest.raises(NotImplementedError, match="ffn_norm"):
        revify(model)
