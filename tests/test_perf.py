"""perf/: the quick sweep's output and schema, the memory-vs-depth plot, the stacks it compares,
the max-batch search, torchrun, autotune on CPU and gpu_check.sh without a GPU; users' own models
(dimensions, Hugging Face configs, timm), the CPU peak-memory meter, the installed revtriton.perf."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import csv
import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import perf.__main__ as perf_main
from perf import autotune, engine_bench, measure, models, schema, sweep
from perf.memory import LiveBytes, peak_memory
from revtriton.ops.dispatch import force_triton, interpreter_enabled
from perf.stacks import PRESETS, VARIANTS, ReferenceHalf, build_stack, make_halves

REPO = Path(__file__).resolve().parents[1]
REVERSIBLE = ("revtriton-sequential", "revtriton-pareprop")
COUPLED = tuple(v for v in VARIANTS if v != "prenorm-stored")  # the same two-stream function


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


def _run(args, timeout, env=None):
    # PYTHON: gpu_check.sh runs this interpreter (the test's venv), not whatever "python" is on PATH.
    return subprocess.run(args, cwd=REPO, env=dict(_env(), PYTHON=sys.executable, **(env or {})),
                          capture_output=True, text=True, timeout=timeout)


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
    assert len(cfg["depths"]) >= 2
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
        if row["variant"] == "coupled-stored":
            assert row["time_vs_vanilla"] == 1.0 and row["mem_vs_vanilla"] == 1.0
        if row["variant"] == "prenorm-stored":
            assert row["time_vs_prenorm"] == 1.0 and row["mem_vs_prenorm"] == 1.0
        assert row["time_vs_prenorm"] is not None and row["mem_vs_prenorm"] is not None
        # On a CPU PaReprop has one stream: no PaReprop-vs-sequential ratio, a note saying why.
        assert row["speedup_vs_sequential"] is None
        assert row["speedup_vs_sequential_note"] == ("n/a (CPU: one stream)" if row["variant"] in REVERSIBLE else None)
    # The printed Markdown table has every point and the ratio columns.
    lines = [line for line in quick["stdout"].splitlines() if line.startswith("|")]
    assert "t/coupled-stored" in lines[0] and "mem/ckpt" in lines[0] and "peak MiB" in lines[0]
    assert "t/prenorm" in lines[0] and "min / med / max" in lines[0]
    assert len(lines) == 2 + len(doc["rows"])


def test_quick_sweep_revtriton_memory_is_flat_and_below_vanilla(quick):
    doc = quick["doc"]
    shallow, deep = doc["config"]["depths"][:2]  # (quick: 6 and 12 blocks)
    assert deep == 2 * shallow
    for preset in doc["config"]["presets"]:
        vanilla, vanilla_deep = _peak(doc, preset, "coupled-stored", shallow), _peak(doc, preset, "coupled-stored", deep)
        assert vanilla_deep > 1.6 * vanilla, (preset, vanilla, vanilla_deep)  # stored activations grow
        for variant in REVERSIBLE:
            rev, rev_deep = _peak(doc, preset, variant, shallow), _peak(doc, preset, variant, deep)
            assert rev_deep < vanilla_deep, (preset, variant, rev_deep, vanilla_deep)
            assert abs(rev_deep - rev) <= 0.05 * rev, (preset, variant, rev, rev_deep)


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
        "spread out of order": lambda d: d["rows"][0].update(step_time_max_ms=d["rows"][0]["step_time_ms"] / 2),
    }
    for name, breaking in breakages.items():
        doc = copy.deepcopy(good)
        breaking(doc)
        with pytest.raises(ValueError, match="schema"):
            sweep.validate_results(doc)
        print("rejected:", name)


def test_quick_sweep_records_the_spread_of_step_times(quick):
    """min / median / max over the timed steps, in the rows and the printed table."""
    doc = quick["doc"]
    table = [line for line in quick["stdout"].splitlines() if line.startswith("| ")][1:]
    for row, line in zip(doc["rows"], table):
        assert row["step_time_repeats"] == doc["config"]["repeats"]
        assert 0 < row["step_time_min_ms"] <= row["step_time_ms"] <= row["step_time_max_ms"], row
        spread = " / ".join(sweep._fmt(row[k], "ms") for k in ("step_time_min_ms", "step_time_ms", "step_time_max_ms"))
        assert f"| {spread} |" in line


def test_cpu_table_labels_the_pareprop_ratio_and_cuda_rows_get_one(quick):
    """Only two CUDA streams let PaReprop overlap anything: on a CPU the column says so."""
    lines = [line.split(" | ") for line in quick["stdout"].splitlines() if line.startswith("| ")]
    column = lines[0].index("PaReprop vs seq")
    for cells in lines[2:]:
        want = "n/a (CPU: one stream)" if cells[1] in REVERSIBLE else "-"
        assert cells[column] == want, cells
    rows = [dict(r) for r in quick["doc"]["rows"]]
    sweep.add_ratios(rows, device_type="cuda")  # the same figures as if from a GPU
    for row in rows:
        if row["variant"] in REVERSIBLE:
            (seq,) = [r for r in rows if r["variant"] == "revtriton-sequential" and
                      all(r[k] == row[k] for k in ("preset", "depth", "batch", "seq_len", "halves"))]
            assert row["speedup_vs_sequential"] == pytest.approx(seq["step_time_ms"] / row["step_time_ms"])
        else:
            assert row["speedup_vs_sequential"] is None
    assert "n/a" not in sweep.markdown_table(rows).split("\n", 2)[2]


def test_old_results_with_vanilla_and_without_new_columns_stay_valid(quick, tmp_path):
    """Files written before the rename and the spread columns still validate and re-report."""
    old = copy.deepcopy(quick["doc"])
    for row in old["rows"]:
        for name in schema.OPTIONAL_COLUMNS:
            row.pop(name)
        if row["variant"] == "coupled-stored":
            row["variant"] = "vanilla"
    old["rows"] = [r for r in old["rows"] if r["variant"] != "prenorm-stored"]
    sweep.validate_results(old)
    sweep.add_ratios(old["rows"], device_type="cpu")  # vanilla rows are the coupled-stored baseline
    assert all(r["time_vs_vanilla"] is not None for r in old["rows"])
    table = sweep.markdown_table(old["rows"])
    assert "| vanilla |" in table and "n/a (CPU: one stream)" in table
    text = quick["json"].with_suffix(".csv").read_text().splitlines()
    with open(tmp_path / "old.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=schema.LEGACY_CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in csv.DictReader(text):
            writer.writerow({**row, "variant": "vanilla" if row["variant"] == "coupled-stored" else row["variant"]})
    rows = sweep.validate_csv(tmp_path / "old.csv")
    assert {r["variant"] for r in rows} >= {"vanilla"} and all(r["step_time_max_ms"] is None for r in rows)


def test_vanilla_is_an_alias_of_coupled_stored():
    cpu = torch.device("cpu")
    cfg = sweep.config_from_args(sweep.parse_args(["--variants", "vanilla,coupled-stored,prenorm-stored"]), cpu)
    assert cfg.variants == [["coupled-stored", "reference"], ["prenorm-stored", "reference"]]
    assert "vanilla" not in VARIANTS and sweep.VARIANT_ALIASES["vanilla"] == "coupled-stored"
    preset = PRESETS["gpt2"].scaled(dim=32, heads=2, tokens=4)
    x = torch.randn(2, 4, 32)
    torch.manual_seed(3)
    old = build_stack(preset, 2, "vanilla")
    torch.manual_seed(3)
    new = build_stack(preset, 2, "coupled-stored")
    assert type(old) is type(new) and torch.equal(old(x), new(x))
    assert sweep.variant_available("vanilla", "reference", cpu) and not sweep.variant_available("vanilla", "fused", cpu)


@pytest.mark.parametrize("family", list(PRESETS))
def test_prenorm_stored_is_a_standard_pre_norm_block_with_the_same_parameters(family):
    """prenorm-stored: x + F(x), then + G(.), one stream, built from the same halves (same seed: the
    same parameters, in the same order, as the coupled stacks of that width and depth)."""
    preset = PRESETS[family].scaled(dim=32, heads=4, tokens=6)
    torch.manual_seed(5)
    prenorm = build_stack(preset, 3, "prenorm-stored")
    for variant in COUPLED:
        torch.manual_seed(5)
        coupled = build_stack(preset, 3, variant, exact=False)
        assert sum(p.numel() for p in prenorm.parameters()) == sum(p.numel() for p in coupled.parameters())
        ours, theirs = list(prenorm.parameters()), list(coupled.parameters())  # in the same order
        assert len(ours) == len(theirs) and all(torch.equal(p, q) for p, q in zip(ours, theirs)), variant
    x = torch.randn(2, 6, 32, requires_grad=True)
    want = x
    for block in prenorm.blocks:
        want = want + block.f(want)  # attention half: norm + attention
        want = want + block.g(want)  # MLP half: norm + MLP
    out = prenorm(x)
    assert torch.equal(out, want)
    out.square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in prenorm.parameters())
    with pytest.raises(ValueError, match="reference halves"):
        build_stack(preset, 2, "prenorm-stored", "fused")


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
        vanilla = [m for _, m in series["coupled-stored"]]
        assert all(b > 1.6 * a for a, b in zip(vanilla, vanilla[1:])), vanilla
        for variant in REVERSIBLE:
            peaks = [m for _, m in series[variant]]
            assert max(peaks) <= 1.05 * min(peaks), (variant, peaks)
    throughput = doc["plots"]["throughput_vs_batch"]["series"]
    for series in throughput.values():
        for points in series.values():
            assert [b for b, _ in points] == sorted(doc["config"]["batches"])
    # Issue 38: every series visible (its own marker and line style: coupled-stored and prenorm-stored
    # memory lie on one another), each panel naming what it holds fixed.
    for name, held in (("memory_vs_depth", "batch"), ("throughput_vs_batch", "depth")):
        styles = doc["plots"][name]["styles"]
        assert set(styles) == set(VARIANTS) and len({tuple(s) for s in styles.values()}) == len(styles)
        for preset, title in doc["plots"][name]["titles"].items():
            assert title.startswith(preset) and f"{held} " in title and "seq " in title, title


# --------------------------------------------------------------------------------------------
# The stacks compared are the same model


def test_variants_compute_the_same_function_and_gradients():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    preset = PRESETS["llama"].scaled(dim=32, heads=4, tokens=6)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    results = {}
    for variant in COUPLED:
        torch.manual_seed(7)
        model = build_stack(preset, 3, variant, exact=False).double()
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        out.backward(torch.cos(out.detach()))
        results[variant] = (out.detach(), xi.grad, [p.grad for p in model.parameters()])
    ref_out, ref_dx, ref_grads = results["coupled-stored"]
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
    vanilla, rev = by_variant["coupled-stored"]["max_batch"], by_variant["revtriton-sequential"]["max_batch"]
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
        (0, "coupled-stored"), (0, "revtriton-sequential"), (1, "coupled-stored"), (1, "revtriton-sequential")]
    assert all(r["status"] == "ok" and r["peak_mem_bytes"] > 0 for r in doc["rows"])
    assert "per-rank extremes" in proc.stdout


# --------------------------------------------------------------------------------------------
# Engine benchmark, autotune, gpu_check.sh


def test_engine_bench_runs_and_reports_ratios(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert engine_bench.main(["--depths", "2,4", "--dim", "32", "--heads", "2", "--seq", "8", "--batch", "2",
                              "--warmup", "1", "--repeats", "2", "--json", str(out)]) == 0
    text, err = capsys.readouterr()
    assert "time / plain" in text and "CPU / plain" in text and "one-block bound" in text and "glibc heap:" in text
    assert text.count("wall: float") == 2 and text.count("CPU: float") == 2
    assert "STAGE:" not in err and "profiler" not in err.lower()  # live bytes, not the profiler
    results = json.loads(out.read_text())["results"]
    expected = set(engine_bench.VARIANTS) - ({"revtorch"} if engine_bench.revtorch_module() is None else set())
    for depth in ("2", "4"):
        assert set(results[depth]) == expected
        for r in results[depth].values():
            assert r["peak_bytes"] > 0 and r["cpu_ms"] > 0 and len(r["steps_ms"]) == 2
    assert results["4"]["plain"]["peak_bytes"] > results["2"]["plain"]["peak_bytes"]
    # the reversible stacks keep their final streams (and exact ones an 8-byte checksum a block): flat in depth
    assert results["4"]["revtriton"]["saved_bytes"] - results["2"]["revtriton"]["saved_bytes"] == 2 * 8
    assert results["4"]["revtriton-float"]["saved_bytes"] == results["2"]["revtriton-float"]["saved_bytes"]


def test_engine_bench_host_rows_time_every_variant_interleaved(tmp_path, capsys):
    """--host (issue 44): each variant of both half kinds timed in the same rounds, on one thread,
    with the three bars judged on wall and CPU time."""
    out = tmp_path / "host.json"
    assert engine_bench.main(["--host", "--depths", "2", "--warmup", "1", "--repeats", "3", "--json", str(out)]) == 0
    text, _ = capsys.readouterr()
    assert "host rows (CPU, 1 threads): depth 2" in text and "us per block over plain" in text
    assert text.count("wall: ") == 1 and text.count("CPU: ") == 1
    assert "exact" in text and "transformer float" in text and text.count("PASS") + text.count("MISS") >= 4
    record = json.loads(out.read_text())
    assert record["threads"] == 1 and record["depth"] == 2
    expected = {f"{h}/{label}" for h, label in engine_bench.HOST_VARIANTS}
    if engine_bench.revtorch_module() is None:
        expected = {k for k in expected if not k.endswith("/revtorch")}
    assert set(record["results"]) == expected
    for r in record["results"].values():
        assert len(r["steps_ms"]) == len(r["cpu_steps_ms"]) == 3 and r["step_ms"] > 0 and r["cpu_ms"] > 0
    # the recompute floor: the transformer halves' rebuild couples batched and each followed by its backward
    assert "recompute floor, transformer halves: their 4 rebuild couples" in text
    assert set(record["recompute_forwards"]) == {"batched_ms", "interleaved_ms"}
    assert all(v > 0 for v in record["recompute_forwards"].values())


def test_launchers_bench_stubs_every_launch_and_reports_us_per_launch(tmp_path, capsys):
    """perf.launchers (issue 44, step 5): each half's couple timed with its Triton launches counted
    and skipped, after a first real call pinned the Triton candidate; the launch stub put back."""
    from perf import launchers
    from revtriton.ops import dispatch

    real_launch = dispatch.launch
    out = tmp_path / "launchers.json"
    launchers.main(["--repeats", "2", "--json", str(out)])
    assert dispatch.launch is real_launch
    text, _ = capsys.readouterr()
    assert "| gpt2 | G | float |" in text and "| llama | F | rebuild+backward |" in text
    assert "forward couples: worst" in text and ("PASS" in text or "MISS" in text) and "alone the worst is" in text
    results = json.loads(out.read_text())["results"]
    assert set(results) == {f"{f}/{h}/{k}" for f in launchers.FAMILIES for h in "FG" for k in launchers.KINDS}
    for key, r in results.items():
        # forward: the norm, then the GEMMs (attention: QKV, the attention kernel, the projection)
        assert r["launches"] >= 3 and len(r["us_all"]) == 2, key
        assert r["us_per_launch"] == pytest.approx(r["us"] / r["launches"])
        assert r["us_per_launch_alone"] == pytest.approx(r["us_alone"] / r["launches"]) and r["us_alone"] > 0
    for f in launchers.FAMILIES:  # a backward launches more than its forward
        assert results[f"{f}/G/rebuild+backward"]["launches"] > results[f"{f}/G/float"]["launches"]


def test_lm_loss_bench_prints_both_losses_and_judges_the_bars(tmp_path, capsys):
    """perf.lm_loss (issue 36): model rows (a revified GPT-2 head, full logits and fused) and op rows."""
    from perf import lm_loss

    pytest.importorskip("transformers")
    out = tmp_path / "lm.json"
    assert lm_loss.main(["--depth", "1", "--batch", "1", "--tokens", "256", "--token-chunk", "64",
                         "--json", str(out)]) == 0
    text, _ = capsys.readouterr()
    assert "| 256 | full logits |" in text and "| 256 | fused |" in text and "0.5x the logits: " in text
    assert "| 256 | fused, token_chunk 64 |" in text
    rows = json.loads(out.read_text())["rows"]
    full, fused, headless = (next(r for r in rows if r["fused"] is f and r["token_chunk"] is None)
                             for f in (False, True, None))
    # the MLP by chunks of 64 rows: its [256, 3072] activations (3 MiB each) were the stack's peak
    chunked = next(r for r in rows if r["fused"] is None and r["token_chunk"] == 64)
    assert chunked["peak_past_parameter_gradients_bytes"] <= headless["peak_past_parameter_gradients_bytes"] - 2**22
    # the full-logits loss holds several logits-sized buffers at once; the fused one a few chunks
    assert full["peak_past_parameter_gradients_bytes"] > 2 * full["logits_bytes"]
    assert fused["peak_past_parameter_gradients_bytes"] < 0.5 * fused["logits_bytes"]
    # the whole peak also holds the tied weight's two gradient contributions (vocab x dim each), either loss
    assert fused["peak_bytes"] > fused["peak_past_parameter_gradients_bytes"] + 2 * 50257 * 768 * 4
    # the fused head adds at most a chunk's logits (8 MiB) to the stack's own peak
    assert fused["peak_past_parameter_gradients_bytes"] <= headless["peak_past_parameter_gradients_bytes"] + 2**23
    assert lm_loss.main(["--op", "--op-tokens", "64", "--op-dim", "16", "--dtype", "float32", "--repeats", "1"]) == 0
    text, _ = capsys.readouterr()
    assert text.count("| fused |") == 2 and "llama3 (128256)" in text


def test_checkpoint_without_early_stop_recomputes_each_block_whole():
    """The engine benchmark's explanation of checkpointing's lead: torch's checkpoint (early stop)
    recomputes each block up to the last tensor its backward saved, which leaves out the MLP's second
    GEMM (3 of a block's 4 Linear forwards in backward); without early stop it recomputes all 4, as a
    reversible rebuild must (G's whole output gives x2 = y2 - G(y1))."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountAddmm(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountAddmm.count += func is torch.ops.aten.addmm.default
            return func(*args, **(kwargs or {}))

    args = engine_bench.parse_args(["--dim", "32", "--heads", "2", "--seq", "8", "--batch", "2"])
    counts = {}
    for label in ("checkpoint", "checkpoint-whole"):
        model = engine_bench.build(label, engine_bench.preset_of(args), 3)
        x = torch.randn(2, 8, 64, requires_grad=True)
        out = model(x)
        CountAddmm.count = 0
        with CountAddmm():
            out.backward(torch.randn_like(out))
        counts[label] = CountAddmm.count
    assert counts == {"checkpoint": 3 * 3, "checkpoint-whole": 3 * 4}


def test_autotune_on_cpu_says_it_needs_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert autotune.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


def test_gpu_check_dry_run_prints_the_plan(tmp_path):
    out = tmp_path / "gpu"
    proc = _run(["bash", "perf/gpu_check.sh", str(out), "--dry-run"], timeout=30)
    assert proc.returncode == 0, proc.stderr
    for needle in ("pytest -m gpu", "perf.sweep --suite short", "perf.kernels", "--suite pareprop", str(out),
                   "  ok    gpu tests: collect"):
        assert needle in proc.stdout, needle
    # The GEMM-config test (many compiles) runs in its own step, after the measurements, not twice.
    steps = {line.split()[1]: line for line in proc.stdout.splitlines() if re.match(r"  [1-9]\d*\. ", line)}
    configs_test = "test_every_gemm_table_config_matches_the_reference_compiled"
    assert f"not {configs_test}" in steps["gpu-tests"] and f"-k {configs_test}" in steps["gemm-configs"]
    # The pytest steps collect only the files carrying the gpu mark (all of them: about 10 s of imports).
    assert "tests/test_gpu.py" in steps["gpu-tests"] and " tests;" not in steps["gpu-tests"]
    assert list(steps).index("gemm-configs") > list(steps).index("kernels")
    assert not out.exists()


def test_gpu_check_runs_the_named_steps_only(tmp_path):
    out = tmp_path / "gpu"
    proc = _run(["bash", "perf/gpu_check.sh", str(out), "--dry-run"], timeout=30,
                env={"GPU_CHECK_STEPS": "kernels,sweep"})
    assert proc.returncode == 0, proc.stderr
    plan = [line.split()[1] for line in proc.stdout.splitlines() if re.match(r"  [1-9]\d*\. ", line)]
    assert plan == ["sweep", "kernels"]  # the script's order, not the variable's
    assert "gpu tests: collect" not in proc.stdout  # no pytest step: the GPU tests are not collected
    bad = _run(["bash", "perf/gpu_check.sh", str(out), "--dry-run"], timeout=30, env={"GPU_CHECK_STEPS": "kernel"})
    assert bad.returncode == 2 and "unknown step 'kernel'" in bad.stderr


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
                    "python -m perf.autotune", "python -m perf.engine_bench", "revtriton-perf",
                    "python -m revtriton.perf", "--model", "--kv-heads", "--mlp swiglu", "timm:"):
        assert command in readme, command


def test_failing_points_are_recorded_and_fail_the_run(tmp_path, monkeypatch, capsys):
    real_build = measure.build_stack

    def build(preset, depth, variant, *args, **kwargs):
        if variant == "checkpoint":
            raise sweep.OutOfMemoryError("CUDA out of memory (simulated)")
        if variant == "revtriton-pareprop":
            raise RuntimeError("kernel exploded (simulated)")
        return real_build(preset, depth, variant, *args, **kwargs)

    monkeypatch.setattr(measure, "build_stack", build)
    args = ["--device", "cpu", "--presets", "gpt2", "--dim", "32", "--heads", "2", "--seq", "8", "--depths", "2",
            "--batches", "", "--seq-lens", "", "--repeats", "1", "--out", str(tmp_path), "--no-progress",
            "--threads", "1"]
    assert sweep.main(args) == 1
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    sweep.validate_results(doc)
    status = {r["variant"]: (r["status"], r["error"]) for r in doc["rows"]}
    assert status["coupled-stored"] == ("ok", None) and status["revtriton-sequential"] == ("ok", None)
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


# --------------------------------------------------------------------------------------------
# CPU peak memory without the profiler


def test_live_bytes_counts_a_known_allocation_pattern():
    old = torch.zeros(4096)  # allocated before the meter: neither counted nor subtracted
    with LiveBytes() as meter:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(2000, dtype=torch.float64)  # 16000
        assert (meter.live, meter.peak) == (20000, 20000)
        del a
        assert meter.live == 16000
        c = torch.empty(500, dtype=torch.int32)  # 2000: below the peak
        assert (meter.live, meter.peak) == (18000, 20000)
        view, reshaped = b[10:], b.view(2, 1000)  # views share the storage: nothing new
        b.add_(1)
        old.mul_(2)  # in place on an older storage: nothing new
        assert meter.live == 18000
        del b
        assert meter.live == 18000  # the view keeps the storage alive
        del view, reshaped
        assert meter.live == 2000
        d = old * 2  # a new 16384-byte result of an older tensor
        assert (meter.live, meter.peak) == (18384, 20000)
        e = torch.empty(0)
        e.resize_(10_000)  # grown in place: 40000 bytes
        assert (meter.live, meter.peak) == (58384, 58384)
        del old, d, c, e
        assert meter.live == 0  # everything it counted is freed; the older tensor was never counted
    assert peak_memory(lambda: torch.ones(3, 1000).sum()) == 12000 + 4  # the ones, then the 4-byte sum


def test_live_bytes_agrees_with_the_profiler_on_a_training_step():
    """The dispatch-mode meter sees what the allocator's events see, on every variant (CPU)."""
    from revtriton.profiling import profiler_peak_memory as profiler_peak

    torch.set_num_threads(1)  # as the sweep on a CPU: attention's scratch buffers are per thread
    preset = PRESETS["llama"].scaled(dim=64, heads=2, tokens=32)
    x, grad = torch.randn(4, 32, 64), torch.randn(4, 32, 64)
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = build_stack(preset, 3, variant)

        def step():
            model.zero_grad(set_to_none=False)
            model(x).backward(grad)

        step()
        ours, theirs = peak_memory(step), profiler_peak(step)
        # below by what ops allocate and free inside themselves (perf.memory's docstring)
        assert 0.95 * theirs <= ours <= theirs, (variant, ours, theirs)
        if variant == "coupled-stored":  # the peak at the end of forward: every byte seen
            assert ours == theirs


# --------------------------------------------------------------------------------------------
# Your own model: dimensions, Hugging Face configs, timm; exactly the requested points


_USER_COMMAND = ["--dim", "512", "--hidden", "1408", "--heads", "8", "--kv-heads", "2", "--mlp", "swiglu",
                 "--depths", "2", "4", "--batches", "1", "2", "--quick"]


def test_user_model_sweep_runs_exactly_the_requested_points(tmp_path, capfd):
    """Issue 20's command: its points and no others, a heartbeat per point, and nothing else on stderr
    (the CPU peak meter prints nothing, unlike the profiler)."""
    assert sweep.main(_USER_COMMAND + ["--device", "cpu", "--out", str(tmp_path), "--no-plots"]) == 0
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    sweep.validate_results(doc)
    assert doc["config"]["depths"] == [2, 4] and doc["config"]["batches"] == [1, 2]
    points = sorted((r["depth"], r["batch"], r["variant"]) for r in doc["rows"])
    assert points == sorted((d, b, v) for d in (2, 4) for b in (1, 2) for v in VARIANTS)
    for row in doc["rows"]:
        assert row["status"] == "ok", row
        assert (row["preset"], row["family"], row["dim"], row["hidden"], row["heads"], row["kv_heads"]) == (
            "custom", "llama", 512, 1408, 8, 2)
        assert row["seq_len"] == 32  # the quick suite's length
    err = capfd.readouterr().err.splitlines()
    assert all(line.startswith("perf.sweep: ") for line in err), err  # no profiler lines
    beats = [line for line in err if line.startswith("perf.sweep: [")]
    assert len(beats) == len(doc["rows"]) and beats[-1].startswith(f"perf.sweep: [{len(doc['rows'])}/")
    assert f"custom {VARIANTS[-1]} depth 4 batch 2 seq 32: ok" in beats[-1]


def test_explicit_axes_run_exactly_their_product():
    cpu = torch.device("cpu")

    def grid(*argv):
        cfg = sweep.config_from_args(sweep.parse_args(list(argv)), cpu)
        return cfg, {(p.preset.name, p.depth, p.batch, p.seq_len) for p in sweep.build_grid(cfg)}

    cfg, shapes = grid("--quick", "--presets", "gpt2", "--depths", "2,4", "--batches", "1")
    assert shapes == {("gpt2", 2, 1, 32), ("gpt2", 4, 1, 32)} and cfg.grid == "product"
    assert (cfg.base_depth, cfg.base_batch) == (2, 1)  # the plots' slice: within the sweep
    _, shapes = grid("--quick", "--presets", "gpt2,vit-b", "--depths", "6")  # no batch sweep added
    assert shapes == {("gpt2", 6, 4, 32), ("vit-b", 6, 4, 17)}
    _, shapes = grid("--quick", "--presets", "gpt2,vit-b", "--seq-lens", "16", "48", "--batches", "")
    assert shapes == {("gpt2", 6, 4, 16), ("gpt2", 6, 4, 48), ("vit-b", 6, 4, 17)}  # images: fixed length
    cfg, shapes = grid("--suite", "pareprop", "--batches", "8,16")  # a product suite keeps its depths
    assert {(d, b) for _, d, b, _ in shapes} == {(12, 8), (12, 16), (24, 8), (24, 16)}
    _, shapes = grid("--quick", "--presets", "llama")  # no axis given: the suite's axes, as before
    assert {(d, b) for _, d, b, _ in shapes} == {(6, 4), (12, 4), (6, 2)}


def test_user_model_options_and_their_errors(tmp_path, capsys):
    def user(*argv, dims_define_model=False):
        return models.model_from_args(sweep.parse_args(list(argv)), dims_define_model).preset

    p = user("--dim", "256", "--heads", "4", "--mlp", "gelu", "--no-causal")
    assert (p.family, p.hidden, p.kv_heads, p.activation, p.causal) == ("vit", 1024, 4, "gelu", False)
    p = user("--dim", "256", "--heads", "4", "--kv-heads", "1")
    assert (p.family, p.hidden, p.kv_heads, p.causal) == ("llama", 704, 1, True)  # SwiGLU: 8/3 x dim to 64
    assert user("--dim", "96", "--heads", "2", "--mlp", "gelu_tanh").family == "gpt2"
    assert models.model_from_args(sweep.parse_args(["--dim", "64", "--heads", "2"])) is None  # rescales presets
    f, g = make_halves(user("--dim", "64", "--heads", "4", "--kv-heads", "2", "--hidden", "96"))  # as described
    assert (type(f).__name__, f.heads, f.kv_heads, f.causal, type(g).__name__, g.up.out_features) == (
        "RMSNormAttention", 4, 2, True, "RMSNormSwiGLU", 96)
    f, g = make_halves(user("--dim", "64", "--heads", "4", "--mlp", "relu", "--no-causal"))
    assert (type(f).__name__, f.causal, type(g).__name__, g.activation) == (
        "LayerNormAttention", False, "LayerNormMLP", "relu")
    for argv, message in ((["--dim", "512", "--heads", "8", "--kv-heads", "2", "--mlp", "gelu"], "--mlp swiglu"),
                          (["--mlp", "swiglu"], "--dim and --heads"),
                          (["--dim", "100", "--heads", "8", "--mlp", "gelu"], "divide"),
                          (["--dim", "64", "--heads", "4", "--kv-heads", "3"], "divide"),
                          (["--model", str(tmp_path / "missing")], "never downloads")):
        with pytest.raises(models.ModelError, match=message):
            user(*argv)
        assert sweep.main(argv + ["--device", "cpu", "--out", str(tmp_path)]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="choose one"):
        sweep.config_from_args(sweep.parse_args(["--presets", "gpt2", "--mlp", "swiglu", "--dim", "64",
                                                 "--heads", "2"]), torch.device("cpu"))
    assert not list(tmp_path.glob("*.json"))


def test_autotune_takes_a_user_model(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert autotune.main(["--dim", "512", "--hidden", "1408", "--heads", "8", "--kv-heads", "2", "--mlp",
                          "swiglu"]) == 0
    out = capsys.readouterr().out
    assert "needs a CUDA device" in out and "dim 512, heads 8 (2 KV), hidden 1408, swiglu" in out
    assert autotune.main(["--dim", "512", "--heads", "8", "--kv-heads", "2", "--mlp", "gelu"]) == 2
    assert "--mlp swiglu" in capsys.readouterr().err
    assert autotune.main(["--presets", "gpt2", "--mlp", "swiglu", "--dim", "64", "--heads", "2"]) == 2


def test_hugging_face_configs_offline(tmp_path, monkeypatch, capfd):
    """Configs built here and saved (no download): their block shapes, and a sweep of one."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llama = tmp_path / "tiny-llama"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=3, max_position_embeddings=256).save_pretrained(llama)
    gpt2 = tmp_path / "tiny-gpt2"
    transformers.GPT2Config(n_embd=48, n_head=3, n_layer=2, n_positions=64).save_pretrained(gpt2)
    vit = tmp_path / "tiny-vit"
    transformers.ViTConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, image_size=32,
                           patch_size=8, num_hidden_layers=2).save_pretrained(vit)
    bert = tmp_path / "tiny-bert"
    transformers.BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                            hidden_act="relu").save_pretrained(bert)
    expected = {  # name: (family, dim, heads, kv_heads, hidden, activation, causal, tokens, unit, layers)
        llama: ("llama", 64, 4, 2, 160, None, True, 256, "tokens", 3),
        gpt2: ("gpt2", 48, 3, 3, 192, "gelu_tanh", True, 64, "tokens", 2),
        vit: ("vit", 32, 2, 2, 64, "gelu", False, 17, "images", 2),
        bert / "config.json": ("vit", 32, 4, 4, 64, "relu", False, 512, "tokens", 12),  # the JSON file itself
    }
    for where, want in expected.items():
        model = models.resolve(str(where))
        p = model.preset
        assert (p.family, p.dim, p.heads, p.kv_heads, p.hidden, p.activation, p.causal, p.tokens, p.unit,
                model.layers) == want, where
        assert p.name == "hf:" + (where.parent.name if where.suffix == ".json" else where.name)
    assert models.resolve("gpt2").preset.dim == 768  # a model type: its default config, offline
    args = ["--model", str(llama), "--depths", "2", "--batches", "1", "2", "--quick", "--device", "cpu",
            "--variants", "vanilla,revtriton-sequential", "--out", str(tmp_path / "out"), "--no-plots"]
    assert sweep.main(args) == 0
    (path,) = (tmp_path / "out").glob("*.json")
    doc = json.loads(path.read_text())
    sweep.validate_results(doc)
    assert sorted((r["depth"], r["batch"], r["variant"]) for r in doc["rows"]) == sorted(
        (2, b, v) for b in (1, 2) for v in ("coupled-stored", "revtriton-sequential"))
    assert {(r["preset"], r["dim"], r["heads"], r["kv_heads"], r["hidden"], r["seq_len"]) for r in doc["rows"]} == {
        ("hf:tiny-llama", 64, 4, 2, 160, 32)}
    assert doc["config"]["models"]["hf:tiny-llama"]["kv_heads"] == 2
    err = capfd.readouterr().err
    assert "model hf:tiny-llama: dim 64, heads 4 (2 KV), hidden 160" in err and "3 layers in the model" in err
    # the config's figures, overridden from the command line
    over = models.model_from_args(sweep.parse_args(["--model", str(llama), "--hidden", "96", "--seq", "48"]))
    assert (over.preset.hidden, over.preset.kv_heads, over.preset.tokens) == (96, 2, 48)


@pytest.mark.timm
def test_timm_model_shape():
    pytest.importorskip("timm")
    model = models.resolve("timm:vit_tiny_patch16_224")
    p = model.preset
    assert (p.family, p.dim, p.heads, p.hidden, p.tokens, p.unit, p.causal, model.layers) == (
        "vit", 192, 3, 768, 197, "images", False, 12)
    assert models.resolve("vit_tiny_patch16_224").preset == p  # a bare timm name
    with pytest.raises(models.ModelError, match="ViT"):
        models.resolve("timm:resnet18")


def test_timm_names_fail_clearly_without_timm(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed
    with pytest.raises(models.ModelError, match="needs timm"):
        models.resolve("timm:vit_tiny_patch16_224")


# --------------------------------------------------------------------------------------------
# perf outside the checkout: revtriton-perf, python -m revtriton.perf


def test_perf_command_dispatches(tmp_path, capsys):
    assert perf_main.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in perf_main.COMMANDS)
    assert perf_main.main(["bogus"]) == 2 and "unknown command" in capsys.readouterr().err
    for argv in (["sweep"], []):  # the sweep is the default command
        assert perf_main.main(argv + ["--quick", "--device", "cpu", "--presets", "gpt2", "--depths", "2",
                                      "--batches", "1", "--variants", "vanilla", "--no-plots", "--no-progress",
                                      "--out", str(tmp_path), "--tag", f"t{len(argv)}"]) == 0
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_sweep_never_overwrites_an_earlier_runs_files(tmp_path, capsys):
    """Issue 38: the same command twice (same device, date and tag) writes a second set of files
    beside the first, and its last line names every file it wrote."""
    argv = ["--quick", "--device", "cpu", "--presets", "gpt2", "--depths", "2", "--batches", "1",
            "--variants", "vanilla", "--no-progress", "--out", str(tmp_path), "--tag", "again"]
    assert sweep.main(argv) == 0
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    capsys.readouterr()
    assert sweep.main(argv) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert all(tmp_path.joinpath(name).read_bytes() == data for name, data in first.items())  # untouched
    (stem,) = {p.name[:-len(".json")] for p in tmp_path.glob("*.json")} - {n[:-len(".json")] for n in first
                                                                         if n.endswith(".json")}
    assert stem.endswith("-again-2")
    written = sorted(p for p in tmp_path.iterdir() if p.name.startswith(stem + ".") or p.name.startswith(stem + "-"))
    assert {p.suffix for p in written} == {".json", ".csv", ".md", ".png"}
    assert all(str(p) in last_line for p in written), last_line


def test_built_wheel_runs_the_sweep_outside_the_checkout(tmp_path):
    """The wheel ships perf as revtriton.perf with its console script; it runs from another folder."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building the wheel offline needs setuptools >= 77 (pyproject), found {setuptools.__version__}")
    dist, site, elsewhere = tmp_path / "dist", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    proc = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = dist.glob("revtriton-*.whl")
    proc = subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (site / "revtriton" / "perf" / "sweep.py").is_file() and (site / "bin" / "revtriton-perf").is_file()
    env = dict(os.environ, PYTHONPATH=str(site))  # the wheel's revtriton first; no checkout on the path
    env.pop("WORLD_SIZE", None)
    code = ("import sys, runpy, revtriton.perf.sweep as s; assert s.__file__.startswith(sys.argv[1]), s.__file__; "
            "sys.argv = ['revtriton.perf'] + sys.argv[2:]; runpy.run_module('revtriton.perf', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, str(site), "sweep", "--quick", "--device", "cpu", "--presets",
                           "llama", "--depths", "2", "--batches", "1", "--variants", "vanilla,revtriton-sequential",
                           "--no-plots"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (path,) = (elsewhere / "perf-results").glob("*.json")  # the default folder outside a checkout
    doc = json.loads(path.read_text())
    assert [(r["variant"], r["status"]) for r in doc["rows"]] == [("coupled-stored", "ok"),
                                                                  ("revtriton-sequential", "ok")]


def test_kernel_benchmark_reports_the_gemm_configs_the_autotuners_kept(monkeypatch, capsys):
    """perf.kernels lists, per tuning key, the config each GEMM autotuner kept (tile, stages and
    whether it walks the tiles persistently): the one thing about persistence a GPU run must say."""
    import triton

    from perf import kernels
    from revtriton.ops import gemm

    persistent = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "PERSISTENT": True}, num_warps=8,
                               num_stages=4)
    per_tile = triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "PERSISTENT": False}, num_warps=8,
                             num_stages=3)
    monkeypatch.setattr(gemm.gemm_kernels.fused_gemm_kernel, "cache", {(8192, 3072, 1024): persistent}, raising=False)
    monkeypatch.setattr(gemm.gemm_kernels.fused_gemm_dual_kernel, "cache", {(8192, 11008, 4096): per_tile},
                        raising=False)
    monkeypatch.setattr(gemm.gemm_kernels.fused_gemm_act_grad_kernel, "cache", {}, raising=False)
    tuned = kernels.tuned_gemm_configs()
    assert [(t["kernel"], t["key"], t["config"]["PERSISTENT"], t["config"]["num_stages"]) for t in tuned] == [
        ("fused_gemm_kernel", "8192, 3072, 1024", True, 4), ("fused_gemm_dual_kernel", "8192, 11008, 4096", False, 3)]
    kernels.print_tuned(tuned)
    out = capsys.readouterr().out
    assert "(1 of 2 persistent)" in out and "128x128x64 w8 s4 persistent" in out and "128x256x64 w8 s3  [" in out


def test_every_perf_option_has_a_description():
    """Issue 38: each option of a perf tool's --help says what it does (read from the source: every
    ``add_argument`` call gives ``help=``)."""
    import ast

    missing = []
    for path in sorted((REPO / "perf").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
                    and not any(k.arg == "help" for k in node.keywords)):
                missing.append(f"{path.name}:{node.lineno} {ast.unparse(node.args[0])}")
    assert missing == []


def test_chunked_variant_runs_the_sequential_stack_by_samples_and_peaks_lower(tmp_path):
    """revtriton-chunked (issue 36, opt-in on a CPU): the sequential stack with token_chunk at the point's
    sequence length; at 4 x 256 tokens, width 128, its MLP's [1024, 512] activations and the causal
    attention's per-sample work go a sample at a time: the step's peak falls well below the unchunked
    one's (11.3 -> 6.1 MiB when written)."""
    assert "revtriton-chunked" not in VARIANTS and "revtriton-chunked" in sweep.ALL_VARIANTS
    stack = build_stack(dataclasses.replace(PRESETS["gpt2"], tokens=96), 2, "revtriton-chunked")
    assert stack.token_chunk == 96 and stack.schedule == "sequential"
    argv = ["--quick", "--presets", "gpt2", "--dim", "128", "--heads", "4", "--seq", "256", "--depths", "2",
            "--batches", "4", "--variants", "revtriton-sequential,revtriton-chunked", "--no-plots", "--no-progress",
            "--out", str(tmp_path)]
    assert sweep.main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(next(tmp_path.glob("*.json")).read_text())["rows"]}
    assert rows["revtriton-chunked"]["status"] == "ok"
    assert rows["revtriton-chunked"]["peak_mem_bytes"] <= 0.7 * rows["revtriton-sequential"]["peak_mem_bytes"]
    assert not any(v == "revtriton-chunked" for v, _ in sweep.default_config("full", torch.device("cpu")).variants)
    assert ["revtriton-chunked", "fused"] in sweep.default_config("full", torch.device("cuda")).variants


def test_cuda_graphs_sweep_times_replays_of_every_variant(tmp_path, capsys, monkeypatch):
    """--cuda-graphs (issue 35) on a CPU with tests/test_graphs.py's stand-in graph: every variant,
    baselines included, is captured once after its warm-up and the timed steps are replays; the
    rows say so and carry the host time; the files are named apart from an eager run's."""
    from test_graphs import RerunGraphs

    backends = []
    monkeypatch.setattr(measure, "GRAPH_BACKEND", lambda: backends.append(RerunGraphs()) or backends[-1])
    variants = "coupled-stored,checkpoint,revtriton-sequential,revtriton-pareprop,prenorm-stored"
    argv = ["--quick", "--presets", "gpt2", "--depths", "2", "--batches", "2", "--variants", variants,
            "--warmup", "2", "--repeats", "3", "--no-plots", "--no-progress", "--out", str(tmp_path)]
    assert sweep.main(argv + ["--cuda-graphs"]) == 0
    doc = json.loads(next(tmp_path.glob("*-graphs.json")).read_text())
    assert [r["variant"] for r in doc["rows"]] == variants.split(",")
    assert all(r["status"] == "ok" and r["cuda_graphs"] is True and r["host_ms"] > 0 for r in doc["rows"])
    assert [(b.warm_ups, b.captures, b.replays) for b in backends] == [(2, 1, 4)] * 5  # 1 capture + 3 timed
    schema.validate_results(doc)
    monkeypatch.setattr(measure, "GRAPH_BACKEND", None)
    assert sweep.main(argv) == 0  # eager: its own files, rows say so
    eager = [p for p in tmp_path.glob("*.json") if not p.name.endswith("-graphs.json")]
    assert len(eager) == 1 and all(r["cuda_graphs"] is False for r in json.loads(eager[0].read_text())["rows"])
    with pytest.raises(SystemExit, match="--cuda-graphs needs a CUDA device"):
        sweep.config_from_args(sweep.parse_args(["--quick", "--cuda-graphs"]), torch.device("cpu"))
