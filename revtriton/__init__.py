"""revtriton: reversible transformer blocks for LLM and ViT training, with Triton kernels."""
from . import _versions

_versions.check()  # before anything else: an old torch / triton fails here, naming the minimum
_versions.patch_interpreter()


def _source_tree_kernels() -> None:
    """In a source checkout, make ./kernels importable as ``revtriton.kernels``, its installed name.

    Installed, kernels/ sits inside the package; in a checkout (editable install or none, e.g. on a
    GPU machine with the repository only) it sits beside revtriton/. kernels/ has no __init__.py on
    purpose: a checkout's root is on sys.path under ``python -m``, and a regular package named
    ``kernels`` there would shadow PyPI's ``kernels`` (which transformers imports); a directory
    without __init__.py never shadows an installed package. So it is registered here as a package
    whose modules load from that directory: one copy of each kernel module, one autotune cache.
    """
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sibling = os.path.join(os.path.dirname(here), "kernels")
    if ("revtriton.kernels" in sys.modules or os.path.isdir(os.path.join(here, "kernels"))
            or not os.path.isfile(os.path.join(sibling, "configs.py"))):
        return
    spec = importlib.machinery.ModuleSpec("revtriton.kernels", None, is_package=True)
    spec.submodule_search_locations = [sibling]
    module = importlib.util.module_from_spec(spec)
    module.__doc__ = "Triton device code and autotune configs only (kernels/ of the source tree)."
    sys.modules["revtriton.kernels"] = module
    globals()["kernels"] = module


_source_tree_kernels()

from .convert import ADAPTER_MODULES, PRESERVE_MODES, from_pretrained, revify, train_adapters_only  # noqa: E402
from .engine import CapturedStep, Coupling, ReversibleBlock, ReversibleStack, check_step, deferred_checks  # noqa: E402
from .halves import (  # noqa: E402
    Adapter, CouplingHalf, GenericHalf, LayerNormAttention, LayerNormMLP, RMSNormAttention, RMSNormSwiGLU, as_half)
from .models import (  # noqa: E402
    GPTConfig, RevGPT, RevMViT, RevViT, rev_causal_lm, rev_gpt, rev_llama, rev_mvit, rev_vit, to_reversible,
    to_stored_activations)
from .schedules import ScheduleTrace  # noqa: E402

__version__ = "0.1.0"

__all__ = ["revify", "from_pretrained", "train_adapters_only", "PRESERVE_MODES", "ADAPTER_MODULES", "Coupling",
           "ReversibleBlock", "ReversibleStack", "Adapter", "CouplingHalf", "GenericHalf", "LayerNormAttention",
           "LayerNormMLP", "RMSNormAttention", "RMSNormSwiGLU", "as_half", "GPTConfig", "RevGPT", "RevMViT", "RevViT",
           "rev_causal_lm",
           "rev_gpt", "rev_llama", "rev_mvit", "rev_vit", "to_reversible", "to_stored_activations", "ScheduleTrace",
           "check_step", "deferred_checks", "CapturedStep"]
