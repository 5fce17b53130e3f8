"""Supported versions and the bare-machine path.

- An older torch or triton fails at ``import revtriton`` with an ImportError naming the minimum
  (revtriton/_versions.py), not deep in a kernel.
- Triton < 3.7's interpreter runs loops with a runtime bound on numpy >= 2.4 (revtriton patches it).
- A source tree that is not installed imports (``revtriton`` and ``revtriton.kernels``) and
  ``perf/gpu_check.sh --dry-run`` passes, in a clean environment (``env -i``) with only ``python3``
  on PATH, as on the GPU machine. "Not installed" is proved: the interpreter runs with ``-S`` (no
  site processing, so the editable install's path hook is never loaded; site-packages is put on
  PYTHONPATH so torch and triton still import), and ``import revtriton`` from outside the tree fails.
"""
from __future__ import annotations

import os
import shutil
import site
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from revtriton import _versions

REPO = Path(__file__).resolve().parent.parent


def test_parse_version():
    assert _versions.parse_version("2.11.0+cu130") == (2, 11, 0)
    assert _versions.parse_version("2.12.0a0+git1234abc") == (2, 12, 0)
    assert _versions.parse_version("3.6.0") == (3, 6, 0)
    assert _versions.too_old("2.10.1", (2, 11)) and not _versions.too_old("2.11.0a0+nv25.01", (2, 11))
    assert _versions.too_old("3.5.1", (3, 6)) and not _versions.too_old("3.10.0", (3, 6))


@pytest.mark.parametrize("package, version", [("torch", "2.10.0+cu128"), ("triton", "3.5.1")])
def test_old_version_raises_import_error_naming_the_minimum(monkeypatch, package, version):
    monkeypatch.delenv("REVTRITON_SKIP_VERSION_CHECK", raising=False)
    _versions.check()  # the installed stack passes
    monkeypatch.setattr({"torch": torch, "triton": triton}[package], "__version__", version)
    minimum = {"torch": _versions.MIN_TORCH, "triton": _versions.MIN_TRITON}[package]
    with pytest.raises(ImportError) as info:
        _versions.check()
    assert f"{package}>={minimum[0]}.{minimum[1]} (found {package} {version})" in str(info.value)
    monkeypatch.setenv("REVTRITON_SKIP_VERSION_CHECK", "1")
    _versions.check()


def test_triton_is_read_from_its_distribution_without_importing_it(monkeypatch):
    """``import revtriton`` reads Triton's version from its distribution record (importing Triton is
    about 0.15 s: issue 38's import-time bar), from the module once it is imported, and imports it
    only where there is no record; an installed Triton that fails to import raises when the kernels
    first ask for it (ops.dispatch.triton_available), naming why."""
    import importlib.metadata

    from revtriton.ops import dispatch

    monkeypatch.delenv("REVTRITON_SKIP_VERSION_CHECK", raising=False)
    monkeypatch.delitem(sys.modules, "triton")
    versions = {"triton": "3.5.1"}

    def version(name):
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(ImportError, match=r"triton>=3\.6 \(found triton 3\.5\.1\)"):
        _versions.check()
    assert "triton" not in sys.modules
    versions = {"pytorch-triton": "3.7.0+git"}  # a nightly's distribution
    _versions.check()
    versions = {}  # no record (a source tree): the module's own version
    assert _versions.installed_triton_version() == triton.__version__ and "triton" in sys.modules

    def broken_import(name, *args, **kwargs):
        if name == "triton":
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
        return real_import(name, *args, **kwargs)

    import builtins
    real_import = builtins.__import__
    monkeypatch.delitem(sys.modules, "triton")
    monkeypatch.setattr(builtins, "__import__", broken_import)
    with pytest.raises(ImportError, match="triton is installed but fails to import: No module named 'numpy'"):
        dispatch.triton_available()


def test_import_fails_on_old_torch():
    """The real import: a torch reporting 2.10 stops ``import revtriton`` at once with the minimum."""
    code = ("import torch; torch.__version__ = '2.10.0'\n"
            "try:\n    import revtriton\nexcept ImportError as e:\n    print(e)")
    env = {k: v for k, v in os.environ.items() if k != "REVTRITON_SKIP_VERSION_CHECK"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"torch>={_versions.MIN_TORCH[0]}.{_versions.MIN_TORCH[1]} (found torch 2.10.0)" in out.stdout


@triton.jit
def _count_blocks_kernel(out_ptr, n, BLOCK: tl.constexpr):
    total = 0
    for _ in range(0, tl.cdiv(n, BLOCK)):  # a runtime loop bound, as in the GEMM main loop
        total += 1
    tl.store(out_ptr, total)


def test_runtime_loop_bound_under_the_interpreter():
    out = torch.zeros(1, dtype=torch.int32)
    _count_blocks_kernel[(1,)](out, 300, BLOCK=64)
    assert out.item() == 5


def _clean_tree_and_python(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the source tree, and a PATH whose python3 sees the venv's packages but no install of revtriton."""
    tree = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", "*.pyc", ".triton", "results")
    for name in ("revtriton", "kernels", "perf", "tests", "examples"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, tree / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):  # (tests/test_readme.py reads the README at collection)
        shutil.copy(REPO / name, tree / name)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    sitepkgs = os.pathsep.join(p for p in site.getsitepackages() if os.path.isdir(p))
    wrapper = bindir / "python3"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{sitepkgs}"'
                       f' exec "{sys.executable}" -S "$@"\n')
    decoy = bindir / "python"  # the GPU machine has no `python`: using it fails loudly
    decoy.write_text('#!/bin/sh\necho "gpu_check must call python3, not python" >&2\nexit 127\n')
    for f in (wrapper, decoy):
        f.chmod(f.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path))}
    return tree, env


def test_source_tree_imports_without_install(tmp_path):
    tree, env = _clean_tree_and_python(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Not installed: from outside the tree, revtriton is not importable at all.
    out = subprocess.run(["python3", "-c", "import revtriton"], check=False, cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "No module named 'revtriton'" in out.stderr, out.stderr
    code = ("import sys, revtriton, revtriton.kernels\n"
            "from revtriton.kernels import configs\n"
            "from revtriton.ops import fused_attention, fused_mlp, gemm\n"
            "print(revtriton.__file__); print(list(revtriton.kernels.__path__)[0]); print(configs.__file__)\n"
            "print(gemm.gemm_kernels.__name__)\n"
            "print(sorted(m for m in sys.modules if m == 'kernels' or m.startswith('kernels.')))\n")
    runs = {"repo root as cwd": dict(cwd=tree, env=env),
            "PYTHONPATH=repo root": dict(cwd=elsewhere, env=dict(env, PYTHONPATH=str(tree)))}
    for how, kw in runs.items():
        out = subprocess.run(["python3", "-c", code], check=False, capture_output=True, text=True, timeout=300, **kw)
        assert out.returncode == 0, f"{how}:\n{out.stderr[-3000:]}"
        lines = out.stdout.splitlines()
        assert lines[:3] == [str(tree / "revtriton" / "__init__.py"), str(tree / "kernels"),
                             str(tree / "kernels" / "configs.py")], how
        assert lines[3] == "revtriton.kernels.gemm" and lines[4] == "[]", (how, lines)  # one copy of the kernels


def test_gpu_check_dry_run_in_a_clean_environment(tmp_path):
    tree, env = _clean_tree_and_python(tmp_path)
    out = subprocess.run(["/bin/bash", "perf/gpu_check.sh", str(tmp_path / "out"), "--dry-run"], check=False, cwd=tree,
                         env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for requirement in ("python", "torch", "triton", "pytest", "revtriton", "perf", "network", "OUTDIR",
                        "gpu tests"):
        assert f"  ok    {requirement}: " in out.stdout, (requirement, text[-4000:])
    where = f"  ok    revtriton: imports from {tree / 'revtriton'}, {tree / 'kernels'}; the source tree is used"
    assert where in out.stdout, text[-4000:]
    assert "python3 -m pytest -m gpu" in out.stdout and "FAIL" not in out.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
