"""tests/fresh_process.py, which the "a fresh process loads it" checks run in: a child that has
imported nothing of the caller's, runs its script as ``python -c`` would and reports as
``subprocess.run`` does."""
import subprocess

import pytest
import torch

import revtriton  # noqa: F401 (imported here: the child must not have it)
from fresh_process import run_python


def test_the_child_has_none_of_the_callers_imports_or_state(tmp_path, monkeypatch):
    monkeypatch.setenv("REVTRITON_FRESH_PROCESS_PROBE", "seen")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(1234)
    script = ("import os, sys, torch\n"
              "print(sorted(m for m in ('revtriton', 'test_fresh_process', 'fresh_process') if m in sys.modules))\n"
              "print(os.environ['REVTRITON_FRESH_PROCESS_PROBE'], os.getcwd(), sys.argv[1:])\n"
              "print(torch.initial_seed())\n"
              "sys.exit(3)")
    done = run_python(script, "a", 2)
    assert done.returncode == 3
    lines = done.stdout.splitlines()
    assert lines[:2] == ["[]", f"seen {tmp_path} ['a', '2']"]
    assert lines[2] != "1234"  # the global generator is not the caller's


def test_errors_come_back_as_from_subprocess_run():
    done = run_python("import sys; print('out'); print('err', file=sys.stderr); raise ValueError('boom')")
    assert done.returncode == 1 and done.stdout == "out\n"
    assert done.stderr.startswith("err\n") and "ValueError: boom" in done.stderr
    first_child_parent = run_python("import os; print(os.getppid())").stdout
    assert run_python("import sys; sys.exit('why')").stderr == "why\n"
    with pytest.raises(AssertionError, match="exited with 1"):
        run_python("raise SystemExit(1)", check=True)
    with pytest.raises(subprocess.TimeoutExpired):
        run_python("import time; time.sleep(30)", timeout=1)
    assert run_python("import os; print(os.getppid())").stdout == first_child_parent  # the same server

