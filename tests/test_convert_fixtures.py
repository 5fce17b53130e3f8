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
