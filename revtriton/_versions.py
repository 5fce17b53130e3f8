"""The oldest PyTorch and Triton revtriton runs on, checked when ``revtriton`` is imported.

The minimums are the oldest versions CI tests (``.ci/run``): an older stack gets an ImportError
that names them, not a failure deep inside a kernel or an import of a torch API that does not
exist yet. ``REVTRITON_SKIP_VERSION_CHECK=1`` skips the check (a fork or a nightly at your own
risk).

What sets each minimum:
- torch 2.11: the oldest torch CI runs the tests on (PyPI's torch 2.11.0, which pins triton 3.6.0:
  the lent GPU machine's stack). The APIs the code uses are older: FSDP2's public
  ``torch.distributed.fsdp.fully_shard`` / ``register_fsdp_forward_method`` / ``FSDPModule`` /
  ``MixedPrecisionPolicy`` (2.6; tests/test_distributed.py also patches
  ``torch.distributed.fsdp._fully_shard._fsdp_param_group``, 2.6), ``torch.get_autocast_dtype``,
  ``torch.is_autocast_enabled(device_type)`` and ``nn.RMSNorm`` (2.4), but nothing older than
  2.11 is tested.
- triton 3.6: the oldest triton CI runs the interpreter kernel tests and the sm_90 / sm_80
  compile checks on. Triton 3.4 and 3.5 passed the interpreter kernel tests once by hand (with
  :func:`patch_interpreter`); triton 3.3 and older cannot import the kernels
  (``triton.autotune(cache_results=...)`` is new in 3.4). ``tl.make_tensor_descriptor`` and
  ``tl.range(warp_specialize=...)`` exist from 3.4 on.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys

MIN_TORCH = (2, 11)
MIN_TRITON = (3, 6)


def parse_version(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: '2.11.0+cu130' -> (2, 11, 0), '2.12.0a0+git' -> (2, 12, 0).

    A pre-release counts as its release (NGC containers ship 'a0' builds of released torch versions).
    """
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    if not m:
        raise ValueError(f"cannot read a version from {text!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in v)


def too_old(version: str, minimum: tuple[int, ...]) -> bool:
    got = parse_version(version)
    n = max(len(got), len(minimum))
    return got + (0,) * (n - len(got)) < minimum + (0,) * (n - len(minimum))


def check(torch_version: str | None = None, triton_version: str | None = None) -> None:
    """Raise ImportError when torch or triton is older than the minimum (or triton is missing).

    The arguments override the installed versions (for tests).
    """
    if os.environ.get("REVTRITON_SKIP_VERSION_CHECK", "0") not in ("", "0"):
        return
    problems = []
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    if too_old(torch_version, MIN_TORCH):
        problems.append(f"torch>={_fmt(MIN_TORCH)} (found torch {torch_version})")
    if triton_version is None:
        triton_version = installed_triton_version()
    if too_old(triton_version, MIN_TRITON):
        problems.append(f"triton>={_fmt(MIN_TRITON)} (found triton {triton_version})")
    if problems:
        raise ImportError("revtriton needs " + " and ".join(problems) + ": upgrade with "
                          f"pip install 'torch>={_fmt(MIN_TORCH)}' 'triton>={_fmt(MIN_TRITON)}', or set "
                          "REVTRITON_SKIP_VERSION_CHECK=1 to try anyway")


# The distributions that install the ``triton`` package (PyPI's, PyTorch's nightly and ROCm builds).
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm")


def installed_triton_version() -> str:
    """Triton's version without importing it where its distribution says (``import triton`` is about
    0.15 s of ``import revtriton``: the kernels import it when first needed, ops.dispatch); the
    module's own when it is imported already or has no distribution record (a source tree)."""
    module = sys.modules.get("triton")
    if module is not None:
        return module.__version__
    for name in TRITON_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import triton
    except ModuleNotFoundError as e:
        if e.name != "triton":  # installed, but something it imports is missing (numpy, say)
            raise ImportError(f"revtriton needs triton, which is installed but fails to import: {e}") from e
        raise ImportError(f"revtriton needs triton>={_fmt(MIN_TRITON)} (Linux), which is not installed") from e
    return triton.__version__


def patch_interpreter() -> bool:
    """Let triton < 3.7's interpreter run loops with a runtime bound on numpy >= 2.4.

    Under ``TRITON_INTERPRET=1`` a scalar is a one-element numpy array, and triton < 3.7 converts it
    to a loop bound with ``int(array)``, which numpy 2.4 refuses for arrays of ndim > 0 ("only
    0-dimensional arrays can be converted to Python scalars"): every ``for i in range(0, n)`` with
    a runtime ``n`` failed. Triton 3.7 squeezes the array first; this gives older interpreters the
    same ``__index__``. Does nothing without the interpreter or where it is not needed; returns
    whether it patched.
    """
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int32))
        return False  # numpy < 2.4 still converts one-element arrays
    except TypeError:
        pass
    import triton

    if not too_old(triton.__version__, (3, 7)):
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_revtriton_index_fix", False):
        return False

    def index(self):
        return int(self.handle.data.squeeze())

    def patched(tensor, *args, **kwargs):
        original(tensor, *args, **kwargs)
        if args or "scope" in kwargs:  # triton 3.6: a scope that restores the attributes after the launch
            scope = args[0] if args else kwargs["scope"]
            scope.set_attr(tensor, "__index__", index)
        else:  # triton <= 3.5 sets the attribute for good
            tensor.__index__ = index

    patched._revtriton_index_fix = True
    interpreter._patch_lang_tensor = patched
    return True
