"""The training examples run end to end in smoke mode (a few steps; each well under 2 minutes on CPU)."""
import math
import os
import re
from pathlib import Path

import pytest

from fresh_process import run_python

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# ``python SCRIPT ARGS...`` in a fresh process (tests/fresh_process: a fork of one that imported torch and
# transformers' base, nothing else, so each run does not pay those imports again): the script's folder
# first on sys.path, its path as argv[0], run as __main__.
_AS_A_SCRIPT = ("import runpy, sys, os; script = sys.argv[1]; sys.argv = sys.argv[1:]; "
                "sys.path.insert(0, os.path.dirname(script)); runpy.run_path(script, run_name='__main__')")


def run_example(script, *args):
    env = {**os.environ, "KINETO_LOG_LEVEL": "5"}
    # One thread: on a busy 2-core runner, two torch threads each wait on the other.
    proc = run_python(_AS_A_SCRIPT, EXAMPLES / script, "--smoke", "--threads", "1", *args, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def check_report(stdout, stderr, rate, identical=True):
    assert re.search(rf"model\s+final loss .*{rate}\s+peak MiB", stdout), stdout
    rows = {name: line.split() for line in stdout.splitlines()
            for name in ("reversible", "stored-activation") if line.startswith(name + " ")}
    assert set(rows) == {"reversible", "stored-activation"}, stdout
    for row in rows.values():
        assert float(row[1]) > 0 and float(row[3].replace(",", "")) > 0  # finite loss, positive throughput
    # The reversible model keeps less for backward than its stored-activation twin.
    assert float(rows["reversible"][5]) < float(rows["stored-activation"][5]), stdout
    assert "loss gap" in stdout
    # Four steps from identical weights and batches: the losses agree within 2%, and with exact
    # streams against the same (rounded) model they are equal, step for step.
    assert "losses within 2.0% at every step: yes" in stdout, stdout
    if identical:
        assert "identical losses: 4 of 4 steps" in stdout, stdout
    assert "100%" in stderr  # the tqdm progress bar ran to the end


def test_train_lm_smoke():
    stdout, stderr = run_example("train_lm.py")
    check_report(stdout, stderr, "tokens/s")
    assert "/*.py" in stdout  # trained on the standard library's sources


def test_train_lm_smoke_llama_against_float_streams():
    stdout, stderr = run_example("train_lm.py", "--style", "llama", "--baseline", "float")
    assert "float baseline" in stdout
    check_report(stdout, stderr, "tokens/s", identical=False)


def test_train_vit_smoke():
    pytest.importorskip("sklearn")
    stdout, stderr = run_example("train_vit.py")
    check_report(stdout, stderr, "images/s")


def test_train_vit_smoke_under_bf16_autocast_with_plot(tmp_path):
    pytest.importorskip("sklearn")
    plot = tmp_path / "curves.png"
    stdout, stderr = run_example("train_vit.py", "--bf16", "--plot", str(plot))
    assert "bf16 autocast" in stdout
    check_report(stdout, stderr, "images/s")  # identical losses under autocast too
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_train_vit_mvit_smoke():
    pytest.importorskip("sklearn")
    stdout, stderr = run_example("train_vit.py", "--model", "mvit")
    check_report(stdout, stderr, "images/s")


def test_compare_curves_flags_a_gap(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from argparse import Namespace

    from loss_curves import compare_curves

    args = Namespace(tolerance=0.02, atol=0.0, window=2, plot=None)
    ref = [2.0, 1.5, 1.0, 0.5]
    assert compare_curves([2.0, 1.5, 1.0, 0.5], ref, args)
    assert "identical losses: 4 of 4 steps" in capsys.readouterr().out
    assert compare_curves([2.0, 1.52, 1.0, 0.509], ref, args)  # 1.3% and 1.8%
    assert not compare_curves([2.0, 1.5, 1.0, 0.511], ref, args)  # 2.2% at the last step
    assert "at every step: NO" in capsys.readouterr().out
    assert compare_curves([2.0, 1.5, 1.0, 0.511], ref, Namespace(tolerance=0.02, atol=0.01, window=2, plot=None))


def _finetune_rows(stdout):
    """{variant: [columns]} of finetune_pretrained.py's final table."""
    return {line.split()[0]: line.split() for line in stdout.splitlines()
            if line.split() and line.split()[0] in ("original", "none", "meft1", "meft2", "meft3")}


def check_finetune_report(stdout, stderr):
    assert re.search(r"variant\s+trainable\s+pretrain@conv\s+ratio\s+new@conv\s+ratio\s+new@end", stdout), stdout
    rows = _finetune_rows(stdout)
    assert set(rows) == {"original", "none", "meft1", "meft2", "meft3"}, stdout
    for row in rows.values():
        assert all(math.isfinite(float(v.replace(",", ""))) for v in row[1:]), row
    # Right after conversion the preserving variants compute the pretrained function (up to the
    # 2**-scale_bits term): validation loss within 1% of the original's on the pretraining data.
    for variant in ("meft1", "meft2", "meft3"):
        assert abs(float(rows[variant][3]) - 1.0) < 0.01, stdout
    # Reversible variants keep less for backward than the unconverted model.
    assert all(float(rows[v][-1]) < float(rows["original"][-1]) for v in ("none", "meft1", "meft2", "meft3")), stdout
    assert "100%" in stderr  # the tqdm progress bars ran to the end


def test_finetune_pretrained_smoke(tmp_path):
    pytest.importorskip("transformers")
    plot = tmp_path / "finetune.png"
    stdout, stderr = run_example("finetune_pretrained.py", "--plot", str(plot))
    assert "LlamaForCausalLM" in stdout and "exact streams" in stdout
    check_finetune_report(stdout, stderr)
    # The preserving variants add adapters: trainable parameters beyond the original's.
    rows = _finetune_rows(stdout)
    original = int(rows["original"][1].replace(",", ""))
    assert all(int(rows[v][1].replace(",", "")) > original for v in ("meft1", "meft2", "meft3")), stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_finetune_pretrained_smoke_gpt2_adapters_only_float_streams():
    pytest.importorskip("transformers")
    stdout, stderr = run_example("finetune_pretrained.py", "--family", "gpt2", "--adapters-only", "--float-streams")
    assert "GPT2LMHeadModel" in stdout and "float streams" in stdout and "adapters only" in stdout
    check_finetune_report(stdout, stderr)
    rows = _finetune_rows(stdout)
    # Only the adapters train: far fewer trainable parameters than the whole model.
    original = int(rows["original"][1].replace(",", ""))
    assert all(int(rows[v][1].replace(",", "")) < original // 2 for v in ("meft1", "meft2", "meft3")), stdout


@pytest.mark.parametrize("script", ["train_lm", "train_vit", "finetune_pretrained"])
def test_every_example_option_has_a_description(script, monkeypatch):
    """Issue 38: each option of an example's --help says what it does (many had none)."""
    import argparse
    import importlib

    monkeypatch.syspath_prepend(str(EXAMPLES))
    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        importlib.import_module(script).main([])
    (parser,) = parsers
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 10
    assert [a.option_strings[0] for a in options if not a.help] == []
