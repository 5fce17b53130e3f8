"""Checkpoints and pickles of converted models made by the code before the conversion package
(issue 46 step 2: tests/data/convert/, written once by tools/make_convert_fixtures.py) still load:
`revtriton.from_pretrained` on the `save_pretrained` folder and `torch.load` of the whole-model
pickle give back a converted model with the recorded logits. A failure here means users' files
stopped loading: fix the code (keep the pickled class names importable), never the fixtures."""
import json
from pathlib import Path

import pytest
import torch

from revtriton import ReversibleStack

pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "convert"
MANIFEST = json.loads((DATA / "manifest.json").read_text())


def logits_of(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def assert_converted_with_the_recorded_logits(model, name):
    expected = torch.load(DATA / f"{name}-expected.pt")
    assert any(isinstance(m, ReversibleStack) for m in model.modules())
    # Another CPU (or thread count) may sum a product in another order: the bits may differ, a load
    # that lost or misplaced a weight is off by the logits' own size.
    torch.testing.assert_close(logits_of(model, expected["ids"]), expected["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MANIFEST["models"]))
def test_a_checkpoint_saved_before_the_change_loads(name):
    from revtriton import from_pretrained

    assert_converted_with_the_recorded_logits(from_pretrained(DATA / f"{name}-checkpoint"), name)


@pytest.mark.parametrize("name", sorted(MANIFEST["models"]))
def test_a_whole_model_pickle_made_before_the_change_loads(name):
    import transformers

    if transformers.__version__ != MANIFEST["transformers"]:  # (CI installs the newest release)
        pytest.skip(f"the pickle holds transformers {MANIFEST['transformers']} objects, this is "
                    f"{transformers.__version__}: whole-model pickles do not cross that library's versions")
    model = torch.load(DATA / f"{name}-whole.pt", weights_only=False)
    # (the pickle names its classes by module and name: a move may leave the module an alias of another)
    assert type(model).__qualname__ == MANIFEST["models"][name]["class"].rsplit(".", 1)[1]
    assert_converted_with_the_recorded_logits(model, name)


def test_every_family_module_is_in_the_one_registry():
    """Each family module declares a FAMILY; revify tries only those listed in FAMILIES, and the
    supported list, the pickled class names and the convention names all derive from that list."""
    import importlib
    import pkgutil

    import revtriton.convert as convert

    modules = [importlib.import_module(f"revtriton.convert.{info.name}")
               for info in pkgutil.iter_modules(convert.__path__)]
    declared = sorted(module.FAMILY.name for module in modules if hasattr(module, "FAMILY"))
    assert declared == sorted(family.name for family in convert.FAMILIES)
    assert len(declared) == len(set(declared))
    assert convert.SUPPORTED == tuple(line for family in convert.FAMILIES for line in family.supported)
    for key in ("pickled", "conventions"):
        entries = [entry for family in convert.FAMILIES for entry in getattr(family, key)]
        assert len(entries) == len(set(entries)), f"a {key} entry declared by two families"
    assert all(family.classes or family.detect for family in convert.FAMILIES)


def test_a_pickle_made_now_names_the_package_not_its_modules():
    """Swapped classes and a stack's layers_view pickle as revtriton.convert.<name>, not by the module
    that defines them today: moving code between the package's modules keeps users' pickles loading."""
    import pickle
    import pickletools

    import transformers

    from revtriton import revify

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_key_value_heads=1, vocab_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32)
    model = revify(transformers.LlamaForCausalLM(config))
    names = [arg for op, arg, _ in pickletools.genops(pickle.dumps(model, protocol=2)) if op.name == "GLOBAL"]
    ours = sorted({name for name in names if name.startswith("revtriton.convert")})
    assert ours and all(name.startswith("revtriton.convert ") for name in ours), ours


def test_the_readmes_family_table_is_the_registrys():
    """README's table of families (issue 48) is revtriton.convert.family_table(): one row per
    registered family, what it converts and what its halves run."""
    from pathlib import Path

    import revtriton.convert as convert

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = convert.family_table()
    assert table in readme
    assert len(table.splitlines()) == 2 + len(convert.FAMILIES)
    assert all(family.halves in convert.FAMILY_HALVES for family in convert.FAMILIES)
