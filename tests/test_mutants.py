"""The planted-bug list (tools/mutate.py) stays applicable: a mutant whose text no longer occurs
exactly once in its file would silently stop testing anything (the mutation run reports it as
stale only when someone runs it)."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTATE = os.path.join(ROOT, "tools", "mutate.py")
if not os.path.exists(MUTATE):  # a copy of the package and tests only (gpu_check's clean tree)
    pytest.skip("tools/mutate.py is not in this tree", allow_module_level=True)


def mutants():
    spec = importlib.util.spec_from_file_location("mutate", MUTATE)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutate", module)  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module.MUTANTS


@pytest.mark.parametrize("mutant", mutants(), ids=lambda m: m.name)
def test_every_mutant_applies_once_and_names_existing_tests(mutant):
    with open(os.path.join(ROOT, mutant.path)) as f:
        assert f.read().count(mutant.old) == 1, f"{mutant.name}: its text must occur once in {mutant.path}"
    test_files = [arg for arg in mutant.tests if arg.endswith(".py")]
    assert test_files and all(os.path.exists(os.path.join(ROOT, t)) for t in test_files), mutant.tests
