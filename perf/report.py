"""Reporting of ``python -m perf.sweep``: ratio columns, the Markdown table, the plots and the
result files (JSON, CSV, Markdown; schema in perf.schema).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
import sys
from pathlib import Path

import torch

import revtriton

from .measure import triton_version
from .schema import CSV_COLUMNS, SCHEMA_VERSION, validate_results
from .stacks import canonical_variant

# What the PaReprop-vs-sequential column says where it has no ratio to show: PaReprop overlaps the
# two halves' recomputation on two CUDA streams; elsewhere its schedule runs on one stream, in order.
NO_STREAMS_NOTE = {"cpu": "n/a (CPU: one stream)"}


def add_ratios(rows: list[dict], *, device_type: str) -> None:
    """Fill the ratio columns from the coupled-stored / checkpoint / prenorm-stored / sequential
    rows at the same point (rows of older files may say ``vanilla``: the same as coupled-stored).

    ``speedup_vs_sequential`` only where PaReprop has two streams to overlap (``device_type``
    cuda); elsewhere revtriton rows get ``speedup_vs_sequential_note`` instead of a ratio.
    """
    def key(row):
        return (row["preset"], row["depth"], row["batch"], row["seq_len"], row["dtype"], row["rank"])

    by_point = {}
    for row in rows:
        if row["status"] == "ok":
            by_point[key(row) + (canonical_variant(row["variant"]), row["halves"])] = row
    for row in rows:
        if row["status"] != "ok":
            continue
        for baseline, column in (("coupled-stored", "vanilla"), ("checkpoint", "checkpoint"),
                                 ("prenorm-stored", "prenorm")):
            base = by_point.get(key(row) + (baseline, "reference"))
            if base is not None:
                row[f"time_vs_{column}"] = row["step_time_ms"] / base["step_time_ms"]
                row[f"mem_vs_{column}"] = row["peak_mem_bytes"] / max(1, base["peak_mem_bytes"])
        if not row["variant"].startswith("revtriton"):
            continue
        if device_type != "cuda":
            row["speedup_vs_sequential"] = None
            row["speedup_vs_sequential_note"] = NO_STREAMS_NOTE.get(device_type, f"n/a ({device_type}: one stream)")
            continue
        seq = by_point.get(key(row) + ("revtriton-sequential", row["halves"]))
        if seq is not None:
            row["speedup_vs_sequential"] = seq["step_time_ms"] / row["step_time_ms"]


# --------------------------------------------------------------------------------------------
# Output: JSON, CSV, Markdown, plots


def _label(row) -> str:
    return row["variant"] + ("/fused" if row["halves"] == "fused" else "")


def plot_series(rows, cfg, x: str, y: str, fixed: dict) -> dict:
    """{preset: {label: [[x, y], ...]}} of rank-0 ok rows whose other axes are at ``fixed``."""
    series = {}
    for row in rows:
        if row["status"] != "ok" or row["rank"] != 0 or row[y] is None:
            continue
        want = {k: (v(row) if callable(v) else v) for k, v in fixed.items()}
        if any(row[k] != v for k, v in want.items()):
            continue
        series.setdefault(row["preset"], {}).setdefault(_label(row), []).append([row[x], row[y]])
    for by_label in series.values():
        for points in by_label.values():
            points.sort()
    return series


def make_plots(rows, cfg, out_dir: Path, stem: str) -> dict:
    """Memory vs depth and throughput vs batch, one panel per preset; returns the plotted data."""
    base_seq = lambda row: cfg.base_seq.get(row["preset"], row["seq_len"])  # noqa: E731
    # The base depth / batch when the sweep has it (a product grid or overrides may not).
    depths = {r["depth"] for r in rows}
    batches = {r["batch"] for r in rows}
    depth = cfg.base_depth if cfg.base_depth in depths or not depths else min(depths)
    batch = cfg.base_batch if cfg.base_batch in batches or not batches else min(batches)
    specs = {
        "memory_vs_depth": ("depth", "peak_mem_bytes", {"batch": batch, "seq_len": base_seq},
                            "peak memory of a step (MiB)", 1 / 2**20),
        "throughput_vs_batch": ("batch", "throughput", {"depth": depth, "seq_len": base_seq}, None, 1.0),
    }
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("perf.sweep: matplotlib is not installed: no plots (pip install revtriton[perf])", file=sys.stderr)
        return {}
    from matplotlib.ticker import NullFormatter

    units = {row["preset"]: row["throughput_unit"] for row in rows}
    labels = sorted({_label(row) for row in rows})
    # Each label its own marker and line style, markers shrinking down the list: series that lie on
    # one another (coupled-stored and prenorm-stored memory) stay visible, a ring around a dot.
    styles = {label: (PLOT_MARKERS[i % len(PLOT_MARKERS)], PLOT_LINES[i % len(PLOT_LINES)],
                      max(3.0, 10.0 - 1.5 * i)) for i, label in enumerate(labels)}
    plots = {}
    for name, (x, y, fixed, ylabel, scale) in specs.items():
        series = plot_series(rows, cfg, x, y, fixed)
        if not series:
            continue
        file = f"{stem}-{name.replace('_', '-')}.png"
        fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4), squeeze=False)
        ordered = [(p, series[p]) for p in cfg.presets if p in series]
        titles = {}
        for ax, (preset, by_label) in zip(axes[0], ordered):
            xs = set()
            for label, pts in sorted(by_label.items()):
                marker, line, size = styles[label]
                ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], marker=marker, linestyle=line,
                        markersize=size, markerfacecolor="none" if size > 5 else None, label=label)
                xs.update(p[0] for p in pts)
            if x == "batch":
                ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(xs), [str(v) for v in sorted(xs)])
            ax.xaxis.set_minor_formatter(NullFormatter())  # no "2.8x10^0" between the named ticks
            seq = next(row["seq_len"] for row in rows if row["preset"] == preset and row[x] in xs
                       and all(row[k] == (v(row) if callable(v) else v) for k, v in fixed.items()))
            held = ", ".join(f"{'seq' if k == 'seq_len' else k} {seq if k == 'seq_len' else v}"
                             for k, v in fixed.items())
            titles[preset] = f"{preset} ({held})"
            ax.set_title(titles[preset])
            ax.set_xlabel(x)
            ax.set_ylabel(ylabel if y != "throughput" else f"throughput ({units.get(preset, 'samples/s')})")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"revtriton perf: {name.replace('_', ' ')}")
        fig.tight_layout()
        fig.savefig(out_dir / file, dpi=100)
        plt.close(fig)
        plots[name] = {"file": file, "x": x, "y": y, "series": series, "titles": titles,
                       "styles": {label: list(styles[label][:2]) for label in sorted(
                           {label for by_label in series.values() for label in by_label})}}
    return plots


PLOT_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
PLOT_LINES = ("-", "--", ":", "-.")


def _fmt(value, kind):
    if value is None:
        return "-"
    if kind == "ms":
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    if kind == "mib":
        return f"{value / 2**20:.1f}"
    if kind == "ratio":
        return f"{value:.2f}x"
    if kind == "rate":
        return f"{value:,.0f}"
    return str(value)


def _spread(row):
    """``min / median / max`` step ms over the repeats ("-" for rows of older files)."""
    spread = [row.get(k) for k in ("step_time_min_ms", "step_time_ms", "step_time_max_ms")]
    if any(v is None for v in spread):
        return "-"
    return " / ".join(_fmt(v, "ms") for v in spread)


def _cell(row, key, kind):
    if kind == "spread":
        return _spread(row)
    value = row.get(key)
    if value is None and key == "speedup_vs_sequential" and row.get("speedup_vs_sequential_note"):
        return row["speedup_vs_sequential_note"]  # e.g. n/a (CPU: one stream): no ratio to show
    return _fmt(value, kind)


# (title, row key, format). "coupled-stored" is the two-stream coupling under plain autograd
# (formerly "vanilla"; its ratio columns keep the JSON names time_vs_vanilla / mem_vs_vanilla);
# "prenorm" is a standard pre-norm block with stored activations.
TABLE_COLUMNS = [("preset", "preset", None), ("variant", "variant", None), ("halves", "halves", None),
                 ("depth", "depth", None), ("batch", "batch", None), ("seq", "seq_len", None),
                 ("step ms", "step_time_ms", "ms"), ("step ms min / med / max", "step_time_ms", "spread"),
                 ("host ms", "host_ms", "ms"),
                 ("throughput/s", "throughput", "rate"),
                 ("peak MiB", "peak_mem_bytes", "mib"), ("launches", "launches_per_step", None),
                 ("max batch", "max_batch", None), ("t/coupled-stored", "time_vs_vanilla", "ratio"),
                 ("mem/coupled-stored", "mem_vs_vanilla", "ratio"), ("t/ckpt", "time_vs_checkpoint", "ratio"),
                 ("mem/ckpt", "mem_vs_checkpoint", "ratio"), ("t/prenorm", "time_vs_prenorm", "ratio"),
                 ("mem/prenorm", "mem_vs_prenorm", "ratio"), ("PaReprop vs seq", "speedup_vs_sequential", "ratio"),
                 ("status", "status", None)]


def markdown_table(rows) -> str:
    lines = ["| " + " | ".join(title for title, _, _ in TABLE_COLUMNS) + " |",
             "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|"]
    for row in rows:
        if row["rank"] != 0:
            continue
        lines.append("| " + " | ".join(_cell(row, key, kind) for _, key, kind in TABLE_COLUMNS) + " |")
    return "\n".join(lines)


def rank_summary(rows) -> str:
    """Under torchrun: per point, the slowest rank's step time and the largest per-rank peak."""
    worst = {}
    for row in rows:
        if row["status"] != "ok":
            continue
        key = (row["preset"], _label(row), row["depth"], row["batch"], row["seq_len"])
        t, m = worst.get(key, (0.0, 0))
        worst[key] = (max(t, row["step_time_ms"]), max(m, row["peak_mem_bytes"]))
    lines = ["| preset | variant | depth | batch | seq | slowest rank ms | largest rank peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for (preset, label, depth, batch, seq), (t, m) in worst.items():
        lines.append(f"| {preset} | {label} | {depth} | {batch} | {seq} | {_fmt(t, 'ms')} | {_fmt(m, 'mib')} |")
    return "\n".join(lines)


def make_document(rows, cfg, device, world_size, created, wall_s, plots, complete) -> dict:
    return {
        "schema_version": SCHEMA_VERSION, "complete": complete, "created": created, "device": device,
        "torch_version": torch.__version__, "triton_version": triton_version(),
        "revtriton_version": revtriton.__version__, "python_version": platform.python_version(),
        "world_size": world_size, "config": dataclasses.asdict(cfg), "wall_s": round(wall_s, 3), "rows": rows,
        "plots": plots, "backend_choices": backend_choices(),
    }


def backend_choices() -> list[dict]:
    """The dispatcher's choices made in this process (under DDP, rank 0's: every rank uses them)."""
    from revtriton.ops import backend

    return [{k: d.get(k) for k in ("op", "key", "device", "choice", "source", "times_ms", "excluded")}
            for d in backend.decisions()]


def print_backend_choices(choices) -> None:
    for d in choices:
        timings = ", ".join(f"{c} {ms:.3f} ms" for c, ms in (d["times_ms"] or {}).items()) or "not timed"
        print(f"backend: {d['op']} [{d['key']}] on {d['device']}: {d['choice']} ({d['source']}; {timings})")


def write_results(doc: dict, out_dir: Path, stem: str) -> dict:
    """Validate ``doc`` and write ``stem``.json/.csv/.md under ``out_dir``; returns their paths."""
    validate_results(doc)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: out_dir / f"{stem}.{kind}" for kind in ("json", "csv", "md")}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, paths["json"])
    meta = {"device_name": doc["device"]["name"], "torch_version": doc["torch_version"],
            "triton_version": doc["triton_version"] or "", "date": doc["created"][:10]}
    with open(paths["csv"], "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in doc["rows"]:
            writer.writerow({**meta, **{k: ("" if v is None else str(v).lower() if isinstance(v, bool) else v)
                                        for k, v in row.items()}})
    paths["md"].write_text(markdown_table(doc["rows"]) + "\n")
    return paths

