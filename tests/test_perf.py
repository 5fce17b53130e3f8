"""perf/: the quick sweep's output and schema, the memory-vs-depth plot, the stacks it compares,
the max-batch search, torchrun, autotune on CPU and gpu_check.sh without a GPU."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from perf import autotune, engine_bench, sweep
from revtriton.ops.dispatch import force_triton, interpreter_enabled
from perf.stacks import PRESETS, VARIANTS, ReferenceHalf, build_stack, make_halves

REPO = Path(__file__).resolve().parents[1]
REVERSIBLE = ("revtriton-sequential", "revtriton-pareprop")


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """sweep.main(["--threads", ...]) sets torch's thread count for the process: put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    return env


def _run(args, timeout):
    # PYTHON: gpu_check.sh runs this interpreter (the test's venv), not whatever "python" is on PATH.
    return subprocess.run(args, cwd=REPO, env=dict(_env(), PYTHON=sys.executable), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``python -m perf.sweep --quick`` run (CPU), shared by the tests below.

    In-process (``main`` is what ``-m`` runs; the torchrun test runs the module as a command):
    it saves a second torch start-up.
    """
    out = tmp_path_factory.mktemp("quick")
    threads = torch.get_num_threads()
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = sweep.main(["--quick", "--device", "cpu", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, stdout.getvalue()[-3000:]
    (json_path,) = out.glob("*.json")
    return {"out": out, "stdout": stdout.getvalue(), "json": json_path, "doc": json.loads(json_path.read_text())}


def _rows(doc, **match):
    return [r for r in doc["rows"] if all(r[k] == v for k, v in match.items())]


def _peak(doc, preset, variant, depth):
    (row,) = _rows(doc, preset=preset, variant=variant, depth=depth, batch=doc["config"]["base_batch"],
                   halves="reference")
    return row["peak_mem_bytes"]


# --------------------------------------------------------------------------------------------
# The quick sweep


def test_quick_sweep_rows_have_every_column(quick):
    doc = quick["doc"]
    assert doc["complete"] is True and doc["device"]["type"] == "cpu"
    assert doc["torch_version"] == torch.__version__
    cfg = doc["config"]
    assert {12, 24} <= set(cfg["depths"])
    expected = {(p, v) for p in cfg["presets"] for v in VARIANTS}
    assert {(r["preset"], r["variant"]) for r in doc["rows"]} == expected
    for row in doc["rows"]:
        assert list(row) == list(sweep.COLUMNS)
        assert row["status"] == "ok", row
        for name in ("step_time_ms", "throughput", "tokens_per_s", "peak_mem_bytes", "launches_per_step",
                     "time_vs_vanilla", "mem_vs_vanilla", "time_vs_checkpoint", "mem_vs_checkpoint"):
            assert row[name] is not None, (name, row)
        assert row["step_time_ms"] > 0 and row["peak_mem_bytes"] > 0
        assert row["launches_per_step"] == 0  # the reference path launches no Triton kernel
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * row["seq_len"] / row["step_time_ms"] * 1e3)
        if row["variant"] == "vanilla":
            assert row["time_vs_vanilla"] == 1.0 and row["mem_vs_vanilla"] == 1.0
        assert (row["speedup_vs_sequential"] is not None) == (row["variant"] in REVERSIBLE)
    # The printed Markdown table has every point and the ratio columns.
    lines = [line for line in quick["stdout"].splitlines() if line.startswith("|")]
    assert "t/vanilla" in lines[0] and "mem/ckpt" in lines[0] and "peak MiB" in lines[0]
    assert len(lines) == 2 + len(doc["rows"])


def test_quick_sweep_revtriton_memory_is_flat_and_below_vanilla(quick):
    doc = quick["doc"]
    for preset in doc["config"]["presets"]:
        vanilla_12, vanilla_24 = _peak(doc, preset, "vanilla", 12), _peak(doc, preset, "vanilla", 24)
        assert vanilla_24 > 1.6 * vanilla_12, (preset, vanilla_12, vanilla_24)  # stored activations grow
        for variant in REVERSIBLE:
            rev_12, rev_24 = _peak(doc, preset, variant, 12), _peak(doc, preset, variant, 24)
            assert rev_24 < vanilla_24, (preset, variant, rev_24, vanilla_24)
            assert abs(rev_24 - rev_12) <= 0.05 * rev_12, (preset, variant, rev_12, rev_24)


def test_quick_sweep_results_follow_the_schema(quick):
    doc = quick["doc"]
    sweep.validate_results(doc)
    csv_rows = sweep.validate_csv(quick["json"].with_suffix(".csv"))
    assert len(csv_rows) == len(doc["rows"])
    for csv_row, row in zip(csv_rows, doc["rows"]):
        assert csv_row["device_name"] == doc["device"]["name"] and csv_row["torch_version"] == torch.__version__
        for name, value in row.items():
            assert csv_row[name] == (pytest.approx(value) if isinstance(value, float) else value), name
    assert quick["json"].with_suffix(".md").read_text().startswith("| preset |")
    assert quick["json"].name.startswith(doc["device"]["slug"] + "-" + doc["created"][:10])


def test_validate_results_rejects_broken_documents(quick):
    good = quick["doc"]
    breakages = {
        "missing column": lambda d: d["rows"][0].pop("peak_mem_bytes"),
        "extra column": lambda d: d["rows"][0].update(bogus=1),
        "wrong type": lambda d: d["rows"][1].update(depth="12"),
        "bool as int": lambda d: d["rows"][1].update(batch=True),
        "unknown variant": lambda d: d["rows"][2].update(variant="revlib"),
        "ok without figure": lambda d: d["rows"][3].update(step_time_ms=None),
        "skipped with figure": lambda d: d["rows"][3].update(status="skipped"),
        "negative memory": lambda d: d["rows"][4].update(peak_mem_bytes=-1),
        "nan": lambda d: d["rows"][4].update(throughput=float("nan")),
        "no device name": lambda d: d["device"].pop("name"),
        "schema version": lambda d: d.update(schema_version=99),
        "plot without series": lambda d: d["plots"]["memory_vs_depth"].pop("series"),
    }
    for name, breaking in breakages.items():
        doc = copy.deepcopy(good)
        breaking(doc)
        with pytest.raises(ValueError, match="schema"):
            sweep.validate_results(doc)
        print("rejected:", name)


def test_validate_csv_rejects_bad_files(quick, tmp_path):
    text = quick["json"].with_suffix(".csv").read_text().splitlines()
    bad_header = tmp_path / "header.csv"
    bad_header.write_text("\n".join([text[0].replace("peak_mem_bytes", "peak")] + text[1:]) + "\n")
    with pytest.raises(ValueError, match="header"):
        sweep.validate_csv(bad_header)
    column = sweep.CSV_COLUMNS.index("depth")
    cells = text[1].split(",")
    cells[column] = "deep"
    bad_value = tmp_path / "value.csv"
    bad_value.write_text("\n".join([text[0], ",".join(cells)]) + "\n")
    with pytest.raises(ValueError):
        sweep.validate_csv(bad_value)


def test_memory_vs_depth_plot_shows_reversible_flat_and_vanilla_growing(quick):
    doc, out = quick["doc"], quick["out"]
    for name in ("memory_vs_depth", "throughput_vs_batch"):
        png = out / doc["plots"][name]["file"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    plot = doc["plots"]["memory_vs_depth"]
    assert (plot["x"], plot["y"]) == ("depth", "peak_mem_bytes")
    assert set(plot["series"]) == set(doc["config"]["presets"])
    for preset, series in plot["series"].items():
        assert set(series) == set(VARIANTS)
        for variant, points in series.items():
            depths = [d for d, _ in points]
            assert depths == sorted(doc["config"]["depths"]), (preset, variant)
            for depth, peak in points:  # the plotted data is the table's
                assert peak == _peak(doc, preset, variant, depth)
        vanilla = [m for _, m in series["vanilla"]]
        assert all(b > 1.6 * a for a, b in zip(vanilla, vanilla[1:])), vanilla
        for variant in REVERSIBLE:
            peaks = [m for _, m in series[variant]]
            assert max(peaks) <= 1.05 * min(peaks), (variant, peaks)
    throughput = doc["plots"]["throughput_vs_batch"]["series"]
    for series in throughput.values():
        for points in series.values():
            assert [b for b, _ in points] == sorted(doc["config"]["batches"])


# --------------------------------------------------------------------------------------------
# The stacks compared are the same model


def test_variants_compute_the_same_function_and_gradients():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    preset = PRESETS["llama"].scaled(dim=32, heads=4, tokens=6)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    results = {}
    for variant in VARIANTS:
        torch.manual_seed(7)
        model = build_stack(preset, 3, variant, exact=False).double()
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        out.backward(torch.cos(out.detach()))
        results[variant] = (out.detach(), xi.grad, [p.grad for p in model.parameters()])
    ref_out, ref_dx, ref_grads = results["vanilla"]
    for variant, (out, dx, grads) in results.items():
        assert torch.allclose(out, ref_out, rtol=1e-10, atol=1e-12), variant
        assert torch.allclose(dx, ref_dx, rtol=1e-10, atol=1e-12), variant
        assert len(grads) == len(ref_grads)
        for g, ref in zip(grads, ref_grads):
            assert torch.allclose(g, ref, rtol=1e-9, atol=1e-11), variant


@pytest.mark.parametrize("family", list(PRESETS))
def test_reference_half_couples_like_the_fused_half(family):
    """The baselines' ReferenceHalf must compute what the fused half computes (Triton interpreter)."""
    f, g = make_halves(PRESETS[family].scaled(dim=64, heads=2, tokens=5))
    x, res = torch.randn(3, 5, 64), torch.randn(3, 5, 64)
    for half in (f, g):
        assert set(ReferenceHalf(half).parameters()) == set(half.parameters())
        want, _ = ReferenceHalf(half).couple(res, x, 1)
        with force_triton():
            got, _ = half.couple(res, x, 1)
        assert ((got - want).abs().max() / (want - res).abs().max()).item() <= 1e-5


def test_stack_builders_reject_bad_requests():
    preset = PRESETS["gpt2"].scaled(dim=32, heads=2, tokens=4)
    with pytest.raises(ValueError, match="variant"):
        build_stack(preset, 2, "revlib")
    with pytest.raises(ValueError, match="reference halves"):
        build_stack(preset, 2, "vanilla", "fused")
    with pytest.raises(ValueError, match="depth"):
        build_stack(preset, 0, "vanilla")
    with pytest.raises(TypeError):
        ReferenceHalf(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="divide"):
        PRESETS["gpt2"].scaled(dim=30, heads=4)


# --------------------------------------------------------------------------------------------
# Max batch, configuration, torchrun


def test_largest_batch_search():
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for _ in range(200):
        limit = rng.randint(1, 5000)
        start = rng.randint(1, 300)
        calls = []

        def fits(b):
            calls.append(b)
            return b <= limit

        got = sweep.largest_batch(fits, start, max_probes=40)
        assert fits(got) and limit - got <= max(1, got // 16), (limit, start, got)
        assert len(calls) <= 41
    assert sweep.largest_batch(lambda b: False, 8) is None
    assert sweep.largest_batch(lambda b: True, 8, limit=100) == 100


def test_max_batch_on_cpu_with_a_budget(tmp_path):
    args = ["--device", "cpu", "--presets", "gpt2", "--dim", "32", "--heads", "2", "--seq", "16", "--depths", "8",
            "--batches", "", "--seq-lens", "", "--variants", "vanilla,revtriton-sequential", "--warmup", "1",
            "--repeats", "1",
            "--mem-budget-gb", str(3 / 1024), "--out", str(tmp_path), "--tag", "budget", "--no-plots",
            "--no-progress", "--threads", "1"]
    assert sweep.main(args) == 0
    (path,) = tmp_path.glob("*budget.json")
    doc = json.loads(path.read_text())
    sweep.validate_results(doc)
    by_variant = {r["variant"]: r for r in doc["rows"]}
    assert all(r["mem_budget_bytes"] == 3 * 2**20 for r in by_variant.values())
    vanilla, rev = by_variant["vanilla"]["max_batch"], by_variant["revtriton-sequential"]["max_batch"]
    assert vanilla >= 1 and rev > 2 * vanilla, (vanilla, rev)  # activations at depth 8 vs one block's


def test_grid_and_config():
    cpu = torch.device("cpu")
    cfg = sweep.default_config("full", cpu)
    assert cfg.depths == [6, 12, 24, 48] and cfg.dim == 128 and cfg.variants == [[v, "reference"] for v in VARIANTS]
    points = sweep.build_grid(cfg)
    shapes = {(p.preset.name, p.depth, p.batch, p.seq_len) for p in points}
    assert ("gpt2", 48, cfg.base_batch, 64) in shapes and ("gpt2", 12, 8, 64) in shapes
    assert ("gpt2", 12, cfg.base_batch, 128) in shapes and ("llama", 12, cfg.base_batch, 32) in shapes
    assert not any(name == "vit-b" and seq != 65 for name, _, _, seq in shapes)  # image size fixed
    assert len(points) == len(shapes) * len(VARIANTS)
    product = sweep.default_config("pareprop", cpu)
    assert {(p.depth, p.batch) for p in sweep.build_grid(product)} == {(d, b) for d in product.depths
                                                                       for b in product.batches}
    with pytest.raises(SystemExit, match="CUDA"):
        sweep.config_from_args(sweep.parse_args(["--variants", "revtriton-pareprop/fused"]), cpu)
    with pytest.raises(SystemExit, match="mem-budget"):
        sweep.config_from_args(sweep.parse_args(["--max-batch"]), cpu)
    with pytest.raises(SystemExit, match="unknown presets"):
        sweep.config_from_args(sweep.parse_args(["--presets", "bert"]), cpu)


def test_time_limit_marks_the_rest_skipped(tmp_path):
    args = ["--device", "cpu", "--presets", "vit-b", "--dim", "32", "--heads", "2", "--seq", "8", "--depths", "2,3",
            "--seq-lens", "", "--batches", "", "--variants", "vanilla", "--repeats", "1", "--time-limit", "0",
            "--out", str(tmp_path), "--no-plots", "--no-progress", "--threads", "1"]
    assert sweep.main(args) == 0
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    sweep.validate_results(doc)
    assert [r["status"] for r in doc["rows"]] == ["ok", "skipped"]


def test_sweep_under_torchrun_records_every_rank(tmp_path):
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
            "perf.sweep", "--device", "cpu", "--presets", "gpt2", "--dim", "32", "--heads", "2", "--seq", "8",
            "--depths", "2", "--batches", "", "--seq-lens", "", "--variants", "vanilla,revtriton-sequential",
            "--warmup", "1", "--repeats", "2", "--threads", "1", "--out", str(tmp_path), "--no-plots", "--no-progress"]
    proc = _run(args, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*-ws2.json")
    doc = json.loads(path.read_text())
    sweep.validate_results(doc)
    assert doc["world_size"] == 2
    assert sorted((r["rank"], r["variant"]) for r in doc["rows"]) == [
        (0, "revtriton-sequential"), (0, "vanilla"), (1, "revtriton-sequential"), (1, "vanilla")]
    assert all(r["status"] == "ok" and r["peak_mem_bytes"] > 0 for r in doc["rows"])
    assert "per-rank extremes" in proc.stdout


# --------------------------------------------------------------------------------------------
# Engine benchmark, autotune, gpu_check.sh


def test_engine_bench_runs_and_reports_ratios(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert engine_bench.main(["--depths", "2,4", "--dim", "32", "--heads", "2", "--seq", "8", "--batch", "2",
                              "--warmup", "1", "--repeats", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "time / plain" in text and text.count("bar <= 1.30x") == 2
    results = json.loads(out.read_text())["results"]
    for depth in ("2", "4"):
        assert set(results[depth]) == set(engine_bench.VARIANTS)
    assert results["4"]["plain"]["peak_bytes"] > results["2"]["plain"]["peak_bytes"]


def test_autotune_on_cpu_says_it_needs_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert autotune.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


def test_gpu_check_dry_run_prints_the_plan(tmp_path):
    out = tmp_path / "gpu"
    proc = _run(["bash", "perf/gpu_check.sh", str(out), "--dry-run"], timeout=30)
    assert proc.returncode == 0, proc.stderr
    for needle in ("pytest -m gpu", "perf.sweep --suite short", "perf.kernels", "--suite pareprop", str(out)):
        assert needle in proc.stdout, needle
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU failure")
def test_gpu_check_without_a_gpu_fails_fast_and_clearly(tmp_path):
    out = tmp_path / "gpu"
    proc = _run(["bash", "perf/gpu_check.sh", str(out)], timeout=90)
    assert proc.returncode == 2
    assert "no usable GPU" in proc.stderr and "needs a CUDA device" in proc.stderr
    assert not out.exists()
    usage = _run(["bash", "perf/gpu_check.sh"], timeout=30)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_readme_documents_every_column_and_command():
    readme = (REPO / "perf" / "README.md").read_text()
    for name in sweep.COLUMNS:
        assert f"`{name}`" in readme, name
    for command in ("python -m perf.sweep --quick", "perf/gpu_check.sh OUTDIR --dry-run", "torchrun",
                    "python -m perf.autotune", "python -m perf.engine_bench"):
        assert command in readme, command


def test_failing_points_are_recorded_and_fail_the_run(tmp_path, monkeypatch, capsys):
    real_build = sweep.build_stack

    def build(preset, depth, variant, *args, **kwargs):
        if variant == "checkpoint":
            raise sweep.OutOfMemoryError("CUDA out of memory (simulated)")
        if variant == "revtriton-pareprop":
            raise RuntimeError("kernel exploded (simulated)")
        return real_build(preset, depth, variant, *args, **kwargs)

    monkeypatch.setattr(sweep, "build_stack", build)
    args = ["--device", "cpu", "--presets", "gpt2", "--dim", "32", "--heads", "2", "--seq", "8", "--depths", "2",
            "--batches", "", "--seq-lens", "", "--repeats", "1", "--out", str(tmp_path), "--no-progress",
            "--threads", "1"]
    assert sweep.main(args) == 1
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    sweep.validate_results(doc)
    status = {r["variant"]: (r["status"], r["error"]) for r in doc["rows"]}
    assert status["vanilla"] == ("ok", None) and status["revtriton-sequential"] == ("ok", None)
    assert status["checkpoint"][0] == "oom" and "simulated" in status["checkpoint"][1]
    assert status["revtriton-pareprop"] == ("error", "RuntimeError: kernel exploded (simulated)")
    assert "kernel exploded" in capsys.readouterr().err
    seq = next(r for r in doc["rows"] if r["variant"] == "revtriton-sequential")
    assert seq["time_vs_vanilla"] is not None and seq["time_vs_checkpoint"] is None  # no checkpoint figure


@pytest.mark.skipif(not interpreter_enabled(), reason="fused halves on CPU need TRITON_INTERPRET=1")
def test_fused_variant_counts_its_triton_launches():
    """The fused halves run (here on the interpreter) and every launch is counted, linearly in depth."""
    cfg = sweep.default_config("quick", torch.device("cpu"))
    cfg.warmup, cfg.repeats = 1, 1
    preset = PRESETS["gpt2"].scaled(dim=32, heads=2, tokens=8)
    launches = {}
    for depth in (1, 2):
        point = sweep.Point(preset, depth, 2, "revtriton-sequential", "fused")
        with force_triton():
            row = sweep.run_point(point, cfg, torch.device("cpu"), sweep.Distributed())
        assert row["status"] == "ok", row["error"]
        launches[depth] = row["launches_per_step"]
    assert launches[1] > 0 and launches[2] == 2 * launches[1], launches
