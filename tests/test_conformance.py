"""tools/conformance.py tells a converted model from a refused one, and flags what it must: a crash
(an error that is not revify's refusal) and a converted model off the library's logits."""
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "conformance.py")
if not os.path.exists(TOOL):  # a copy of the package and tests only (gpu_check's clean tree)
    pytest.skip("tools/conformance.py is not in this tree", allow_module_level=True)
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def conformance():
    spec = importlib.util.spec_from_file_location("conformance", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verdicts(conformance, monkeypatch):
    verdict, detail = conformance.check("LlamaForCausalLM", 60)
    assert verdict == "converted" and "without" in detail
    assert conformance.check("MambaForCausalLM", 60)[0] == "refused"  # no family takes it
    assert conformance.check("NoSuchForCausalLM", 60)[0] == "not built"
    assert conformance.main(["LlamaForCausalLM", "MambaForCausalLM"]) == 0

    import revtriton

    def crash(model, **options):
        raise KeyError("gate_proj")  # DeepSeek-V3's crash before this session's fix

    monkeypatch.setattr(revtriton, "revify", crash)
    assert conformance.check("LlamaForCausalLM", 60)[0] == "CRASH"
    assert conformance.main(["LlamaForCausalLM"]) == 1

    def silently_wrong(model, **options):  # "converts", but computes another function
        model.lm_head.weight.data.mul_(2.0)
        return model

    monkeypatch.setattr(revtriton, "revify", silently_wrong)
    assert conformance.check("LlamaForCausalLM", 60)[0] == "WRONG"


def test_masked_lms_and_image_classifiers(conformance):
    """The other kinds: a masked LM on a batch with a padded row, an image classifier on pixels, each
    compared without grad and with grad (the engine's recording forward)."""
    assert conformance.kind_of("BertForMaskedLM") == "masked-lm"
    assert conformance.kind_of("ViTForImageClassification") == "image-classification"
    verdict, detail = conformance.check("RobertaPreLayerNormForMaskedLM", 60)
    assert verdict == "converted" and "with grad" in detail
    assert conformance.check("ViTForImageClassification", 60)[0] == "converted"
    verdict, detail = conformance.check("BertForMaskedLM", 60)  # post-norm layers: meft1, as revify names it
    assert verdict == "converted" and detail.startswith("meft1:")
    assert conformance.check("AlbertForMaskedLM", 60)[0] == "refused"  # no family takes it
    assert conformance.main(["ViTForImageClassification", "BertForMaskedLM"]) == 0
    assert conformance.kind_of("LlamaForSequenceClassification") == "sequence-classification"
    verdict, detail = conformance.check("LlamaForSequenceClassification", 60)  # a padded row: its last real token
    assert verdict == "converted" and "with grad" in detail


def test_conditional_generation_models(conformance):
    """``--kind seq2seq-lm``: a seq2seq model with a left-padded source row and its decoder's inputs (both
    stacks converted: BART's post-norm layers under meft1), a vision-language model on text (its real
    tokens compared: a padded position's logits are the library's arbitrary ones), each with the
    cache and without."""
    assert conformance.kind_of("BartForConditionalGeneration") == "seq2seq-lm"
    verdict, detail = conformance.check("BartForConditionalGeneration", 60)
    assert verdict == "converted" and detail.startswith("meft1:") and "with the cache" in detail
    assert conformance.check("MBartForConditionalGeneration", 60)[0] == "converted"
    assert conformance.check("LlavaForConditionalGeneration", 60)[0] == "converted"


def test_sub_configs_are_built_tiny_too(conformance):
    """A classifier over CLIP's vision tower has its towers' configs inside its own: both tiny (at
    their defaults CLIP's vision tower takes 224-pixel images and the sweep's 32-pixel ones fail)."""
    import transformers

    model = conformance._tiny(transformers.CLIPForImageClassification)
    for tower in (model.config.vision_config, model.config.text_config):
        assert (tower.hidden_size, tower.num_hidden_layers) == (64, 2)
    assert model.config.vision_config.image_size == 32
    assert conformance.check("CLIPForImageClassification", 60)[0] == "converted"
    assert conformance.check("MetaClip2ForImageClassification", 60)[0] == "converted"


def test_a_converted_model_whose_forward_fails_is_a_crash(conformance, monkeypatch):
    """RemBERT's loop read each stand-in's output as ``outputs[0]``: converted, its first forward raised."""
    import revtriton

    class Failing(torch.nn.Module):
        def forward(self, **inputs):
            raise RuntimeError("each layer's output must reach the next layer unchanged")

    monkeypatch.setattr(revtriton, "revify", lambda model, **options: Failing())
    verdict, detail = conformance.check("ViTForImageClassification", 60)
    assert verdict == "CRASH" and "forward" in detail


def test_a_run_the_librarys_own_model_fails_is_not_the_conversions(conformance):
    """Switch Transformers' own model fails with use_cache=True (its encoder refuses the cache): that
    run is named the library's, the run without the cache compared."""
    verdict, detail = conformance.check("SwitchTransformersForConditionalGeneration", 60)
    assert verdict == "converted" and "(the library's own forward fails) with the cache" in detail
    assert "e-0" in detail.split("with the cache")[1]  # (the other run's error, measured)


def test_running_out_of_time_in_the_conversion_is_a_timeout(conformance, monkeypatch):
    """(Gemma 3's classifier ran past the sweep's 30 s inside revify: counted a crash before.)"""
    import revtriton

    def slow(model, **options):
        raise conformance._Timeout()

    monkeypatch.setattr(revtriton, "revify", slow)
    assert conformance.check("ViTForImageClassification", 60)[0] == "timeout"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", ["GlmAsrForConditionalGeneration", "MllamaForCausalLM", "CsmDepthDecoderForCausalLM",
                                  "MoonshineForConditionalGeneration"])
def test_a_model_admitted_by_its_layer_conventions_is_found_by_its_class_names(conformance, name):
    """Unpickling a revified model in a fresh process rebuilds each swapped class from its name alone
    (revtriton.convert's module __getattr__): a class made for a model that revify admits by its
    layers' conventions must resolve to its library class and mixin also where its names are not
    ``<Family>DecoderLayer`` / ``<Family>Model`` (an audio encoder's ``...EncoderLayer``, ``...Encoder``;
    Mllama's ``MllamaSelfAttentionDecoderLayer``; CSM's layers in a module no ``CsmModel`` names)."""
    import importlib

    import transformers

    from revtriton import convert

    torch.manual_seed(0)
    model = convert.revify(conformance._tiny(getattr(transformers, name)), preserve="meft3", scale_bits=16,
                           exact=False)
    swapped = {type(m) for m in model.modules() if type(m).__module__ == "revtriton.convert"}
    assert swapped
    for cls in swapped:
        found = convert._BLOCK_BASES.get(cls.__qualname__) or convert._convention_class(cls.__qualname__)
        assert found is not None, cls.__qualname__
        module, class_name, mixin = found
        library = getattr(importlib.import_module(module), class_name)
        assert library in cls.__mro__ and (mixin is None or mixin in cls.__mro__), cls.__qualname__


def test_a_converted_model_a_fresh_process_could_not_rebuild_is_listed_as_unpicklable(conformance, monkeypatch):
    from revtriton import convert

    assert conformance.check("LlamaForCausalLM", 60)[0] == "converted"
    forgotten = {name: entry for name, entry in convert._BLOCK_BASES.items() if "LlamaDecoderLayer" not in name}
    monkeypatch.setattr(convert, "_BLOCK_BASES", forgotten)
    monkeypatch.setattr(convert, "_convention_class", lambda name: None)  # (nor found by the name's pattern)
    verdict, detail = conformance.check("LlamaForCausalLM", 60)
    assert verdict == "unpicklable" and "RevifiedHostLlamaDecoderLayer" in detail
