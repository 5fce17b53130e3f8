"""Issue 38 point 5: every code block of the README runs as written on a CPU.

Each ``python`` block runs in a fresh namespace, in a temporary directory (a block may write a
checkpoint); a block that imports an optional package (timm, transformers) is skipped where it is
not installed (CI's timm job has both). ``module.compile()`` runs with Dynamo's eager backend (the
default, inductor, spends half a minute in a C++ compiler on a CPU: tests/test_compile.py). Every other block is shell commands (each documented tool
has tests of its own), or one of the fragments below, which cannot run on a CPU as written.
"""
import importlib.util
import pathlib
import re

import pytest
import torch
from torch._dynamo.utils import counters

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = [(README[:m.start()].count("\n") + 1, m.group(1), m.group(2))
          for m in re.finditer(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)]
PYTHON = [(line, code) for line, lang, code in BLOCKS if lang == "python"]

# Fragments that need what a CPU test has not: FSDP2 over a device mesh of GPUs, under torchrun; a
# CUDA graph (tests/test_graphs.py runs CapturedStep with a stand-in, tests/test_gpu.py for real).
FRAGMENTS = ("shard_reversible(model, init_device_mesh(\"cuda\"", "revtriton.CapturedStep(train_step")
SHELL = re.compile(r"^(python3? |pip |torchrun |bash |perf/|git |cd |export |[A-Z_]+=\S* |#|$)")
OPTIONAL = {"timm": r"\bimport timm\b", "transformers": r"\btransformers\b|\brev_causal_lm\b",
            "peft": r"\bpeft\b"}

# What some blocks leave behind, checked beyond running (the block's first distinctive call).
CHECKS = {
    "rev_mvit(": lambda scope: scope["loss"].ndim == 0 and scope["gpt"].lm_head.weight.grad is not None,
    "revify(model)": lambda scope: scope["loss"].ndim == 0,
    "train_adapters_only(model)": lambda scope: abs(float(scope["before"]) - float(scope["after"])) < 0.01,
    "half.compile()": lambda scope: counters["stats"]["unique_graphs"] >= 2,
    "PeftModel.from_pretrained(": lambda scope: _same_logits(scope["loaded"], scope["model"], scope["ids"]),
}


def _same_logits(loaded, model, ids) -> bool:
    with torch.no_grad():
        return torch.equal(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("line, code", [
    pytest.param(line, code, id=f"line-{line}", marks=[pytest.mark.timm] if re.search(OPTIONAL["timm"], code) else [])
    for line, code in PYTHON])
def test_every_python_block_runs_as_written(line, code, tmp_path, monkeypatch):
    for name, uses in OPTIONAL.items():
        if re.search(uses, code) and importlib.util.find_spec(name) is None:
            pytest.skip(f"README line {line} needs {name}")
    monkeypatch.chdir(tmp_path)
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: compile_module(self, backend="eager"))
    if "compile()" in code:
        torch._dynamo.reset()
        counters.clear()
    torch.manual_seed(0)
    scope = {}
    exec(compile(code, f"README.md:{line}", "exec"), scope)
    for marker, check in CHECKS.items():
        if marker in code:
            assert check(scope), f"README line {line}: {marker}"


def test_every_other_block_is_shell_commands_or_a_named_fragment():
    assert len(PYTHON) >= 8
    for line, lang, code in BLOCKS:
        if lang == "python" or any(fragment in code for fragment in FRAGMENTS):
            continue
        for text in code.splitlines():
            assert SHELL.match(text.strip()), f"README line {line}: not a shell command, nor a python block: {text!r}"


def test_every_check_and_fragment_still_names_a_block():
    """A check or fragment whose block was edited away would pass without checking anything."""
    for marker in (*CHECKS, *FRAGMENTS):
        assert any(marker in code for _, _, code in BLOCKS), marker
