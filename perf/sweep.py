"""``python -m perf.sweep``: what revtriton buys on this device, as memory and speed sweeps.

For each preset (ViT-B-like, GPT-2-like, LLaMA-like; see perf/stacks.py), depth, batch and
sequence length, every variant (vanilla stored activations, checkpoint per block, revtriton
sequential and PaReprop backward; reference or fused halves) runs a training step
(forward + backward) and records:

* step time: median over ``repeats`` steps after ``warmup`` steps (CUDA events on a GPU);
* throughput: images/s (ViT) or tokens/s, and tokens/s for every preset;
* peak memory of a step above what was allocated when it started (parameters, their .grad
  buffers kept from the warm-up, the input): ``revtriton.profiling.peak_memory`` (CUDA allocator
  statistics on a GPU, the profiler's allocation events on the CPU); on a GPU also the absolute
  ``torch.cuda.max_memory_allocated``;
* Triton launches per step (``revtriton.ops.dispatch.count_launches``);
* on a GPU, the largest batch whose step fits a memory budget;
* ratios against vanilla, checkpointing and the sequential schedule at the same point;
* for ``fused`` halves (revtriton's halves as dispatched), which implementation each op got
  (``revtriton.ops.backend``: fused Triton or the cuBLAS + SDPA library path, measured on first
  use) and both timings: ``backend_choices`` in the JSON, printed after the table.

Results go to ``<out>/<device>-<date>[-<suite>].json`` and ``.csv`` (schema: ``RESULTS_SCHEMA``
below, checked by :func:`validate_results`), a Markdown table is printed (and saved as ``.md``),
and two PNG plots are written: memory vs depth and throughput vs batch.

Under ``torchrun`` every rank runs the same points on its own GPU (the model wrapped in DDP),
rank 0 gathers the rows (one per rank and point) and writes the files.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import revtriton
from revtriton.ops.dispatch import count_launches
from revtriton.profiling import peak_memory

from .stacks import BASELINES, HALVES, PRESETS, VARIANTS, Preset, build_stack, variant_available

SCHEMA_VERSION = 1
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
STATUSES = ("ok", "oom", "error", "skipped")

# --------------------------------------------------------------------------------------------
# Results schema: one row per (preset, depth, batch, seq_len, variant, halves, rank).

# name: (JSON type or types, description). Figures are null when the point did not run ("oom",
# "error", "skipped") or do not apply (GPU-only figures on a CPU, ratios without a baseline).
COLUMNS = {
    "preset": ("string", "preset name (perf.stacks.PRESETS)"),
    "family": ("string", "vit, gpt2 or llama"),
    "variant": ("string", "vanilla | checkpoint | revtriton-sequential | revtriton-pareprop"),
    "halves": ("string", "reference (PyTorch eager, SDPA) or fused (revtriton's Triton halves)"),
    "exact": ("boolean", "revtriton streams: int32 fixed point (true) or float (false); baselines: false"),
    "depth": ("integer", "number of blocks (one block = F attention half + G MLP half)"),
    "batch": ("integer", "samples per step"),
    "seq_len": ("integer", "tokens per sample"),
    "dim": ("integer", "model width"),
    "heads": ("integer", "attention heads"),
    "kv_heads": ("integer", "key/value heads (grouped-query attention when < heads)"),
    "hidden": ("integer", "MLP hidden width"),
    "dtype": ("string", "fp32, or bf16 (autocast, fp32 parameters and streams)"),
    "rank": ("integer", "process rank under torchrun (0 otherwise)"),
    "status": ("string", "ok | oom | error | skipped"),
    "error": (["string", "null"], "first line of the error when status is not ok"),
    "step_time_ms": (["number", "null"], "median step time (forward + backward), ms"),
    "step_time_min_ms": (["number", "null"], "fastest step, ms"),
    "throughput": (["number", "null"], "samples of the preset's unit per second (see throughput_unit)"),
    "throughput_unit": ("string", "images/s (ViT) or tokens/s"),
    "tokens_per_s": (["number", "null"], "batch * seq_len / step time"),
    "peak_mem_bytes": (["integer", "null"], "peak bytes allocated by a step above those allocated at its start"),
    "peak_mem_total_bytes": (["integer", "null"], "GPU only: torch.cuda.max_memory_allocated over the step"),
    "launches_per_step": (["integer", "null"], "Triton kernel launches in one step (0 on the reference path)"),
    "max_batch": (["integer", "null"], "largest batch whose step fits mem_budget_bytes (GPU, or --mem-budget-gb)"),
    "mem_budget_bytes": (["integer", "null"], "the budget max_batch was searched under"),
    "time_vs_vanilla": (["number", "null"], "step time / vanilla's at the same point"),
    "mem_vs_vanilla": (["number", "null"], "peak_mem_bytes / vanilla's at the same point"),
    "time_vs_checkpoint": (["number", "null"], "step time / checkpoint's at the same point"),
    "mem_vs_checkpoint": (["number", "null"], "peak_mem_bytes / checkpoint's at the same point"),
    "speedup_vs_sequential": (["number", "null"], "revtriton-sequential's step time / this one's (same halves)"),
}
# Columns every CSV row repeats so a CSV file stands alone.
CSV_META_COLUMNS = ("device_name", "torch_version", "triton_version", "date")
CSV_COLUMNS = CSV_META_COLUMNS + tuple(COLUMNS)


def _json_type(types):
    return types if isinstance(types, str) else list(types)


ROW_SCHEMA = {
    "type": "object",
    "required": list(COLUMNS),
    "additionalProperties": False,
    "properties": {name: {"type": _json_type(types), "description": text} for name, (types, text) in COLUMNS.items()},
}
ROW_SCHEMA["properties"]["variant"]["enum"] = list(VARIANTS)
ROW_SCHEMA["properties"]["halves"]["enum"] = list(HALVES)
ROW_SCHEMA["properties"]["status"]["enum"] = list(STATUSES)
for _name in ("depth", "batch", "seq_len", "dim", "heads", "kv_heads", "hidden"):
    ROW_SCHEMA["properties"][_name]["minimum"] = 1
for _name in ("rank", "peak_mem_bytes", "peak_mem_total_bytes", "launches_per_step", "max_batch"):
    ROW_SCHEMA["properties"][_name]["minimum"] = 0

PLOT_SCHEMA = {
    "type": "object",
    "required": ["file", "x", "y", "series"],
    "properties": {
        "file": {"type": "string", "description": "PNG file name, next to the JSON"},
        "x": {"type": "string"},
        "y": {"type": "string"},
        # {preset: {"variant[/fused]": [[x, y], ...]}}
        "series": {"type": "object"},
    },
}

RESULTS_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "revtriton perf sweep results",
    "type": "object",
    "required": ["schema_version", "complete", "created", "device", "torch_version", "triton_version",
                 "revtriton_version", "python_version", "world_size", "config", "wall_s", "rows", "plots"],
    "properties": {
        "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
        "complete": {"type": "boolean", "description": "false while the sweep is still writing partial results"},
        "created": {"type": "string", "description": "ISO 8601 local time the sweep started"},
        "device": {
            "type": "object",
            "required": ["type", "name", "slug", "count", "total_memory_bytes", "capability", "cpu_threads"],
            "properties": {
                "type": {"type": "string", "enum": ["cpu", "cuda"]},
                "name": {"type": "string"},
                "slug": {"type": "string", "description": "file-name form of the name"},
                "count": {"type": "integer", "minimum": 1},
                "total_memory_bytes": {"type": ["integer", "null"]},
                "capability": {"type": ["string", "null"], "description": "CUDA compute capability, e.g. 9.0"},
                "cpu_threads": {"type": "integer", "minimum": 1},
            },
        },
        "torch_version": {"type": "string"},
        "triton_version": {"type": ["string", "null"]},
        "revtriton_version": {"type": "string"},
        "python_version": {"type": "string"},
        "world_size": {"type": "integer", "minimum": 1},
        "config": {"type": "object", "description": "the SweepConfig the rows came from"},
        "wall_s": {"type": "number", "minimum": 0},
        "rows": {"type": "array", "items": ROW_SCHEMA},
        "plots": {"type": "object", "additionalProperties": PLOT_SCHEMA},
        "backend_choices": {"type": "array", "description": "ops.backend's choice per op and shape bucket: "
                            "op, key, device, choice, source, times_ms, excluded"},
    },
}

_PY_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
             "array": list, "null": type(None)}


def _schema_errors(value, schema, path, errors):
    """The subset of JSON Schema used above: type, enum, minimum, required, properties,
    additionalProperties, items."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        ok = any(isinstance(value, _PY_TYPES[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in types)
        if not ok:
            errors.append(f"{path}: expected {' or '.join(types)}, got {type(value).__name__} {value!r:.60}")
            return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
    if isinstance(value, float) and not math.isfinite(value):
        errors.append(f"{path}: non-finite number {value}")
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}: missing {key!r}")
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                _schema_errors(item, properties[key], f"{path}.{key}", errors)
            elif extra is False:
                errors.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                _schema_errors(item, extra, f"{path}.{key}", errors)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _schema_errors(item, schema["items"], f"{path}[{i}]", errors)


def validate_results(doc: dict) -> None:
    """Raise ValueError listing every way ``doc`` departs from :data:`RESULTS_SCHEMA`."""
    errors: list[str] = []
    _schema_errors(doc, RESULTS_SCHEMA, "$", errors)
    for i, row in enumerate(doc.get("rows", []) if isinstance(doc, dict) else []):
        if not isinstance(row, dict):
            continue
        figures = ("step_time_ms", "throughput", "tokens_per_s", "peak_mem_bytes", "launches_per_step")
        if row.get("status") == "ok":
            missing = [name for name in figures if row.get(name) is None]
            if missing:
                errors.append(f"$.rows[{i}]: status ok but {missing} are null")
        elif row.get("status") in ("oom", "error", "skipped") and row.get("step_time_ms") is not None:
            errors.append(f"$.rows[{i}]: status {row['status']} but step_time_ms is set")
    if errors:
        raise ValueError("results do not follow the schema:\n  " + "\n  ".join(errors[:50]))


def _csv_value(text: str, types):
    types = [types] if isinstance(types, str) else types
    if text == "" and "null" in types:
        return None
    if "boolean" in types:
        if text not in ("true", "false"):
            raise ValueError(f"not a boolean: {text!r}")
        return text == "true"
    if "integer" in types:
        return int(text)
    if "number" in types:
        return float(text)
    return text


def read_csv(path) -> list[dict]:
    """Rows of a results CSV, typed by :data:`COLUMNS` (checks the header)."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != CSV_COLUMNS:
            raise ValueError(f"{path}: header {reader.fieldnames} != {list(CSV_COLUMNS)}")
        rows = []
        for line, raw in enumerate(reader, start=2):
            try:
                rows.append({name: (raw[name] if name in CSV_META_COLUMNS else _csv_value(raw[name], COLUMNS[name][0]))
                             for name in CSV_COLUMNS})
            except ValueError as err:
                raise ValueError(f"{path}:{line}: {err}") from None
    return rows


def validate_csv(path) -> list[dict]:
    """Check a results CSV (header and every value's type) and return its rows."""
    rows = read_csv(path)
    errors: list[str] = []
    for i, row in enumerate(rows):
        _schema_errors({k: v for k, v in row.items() if k in COLUMNS}, ROW_SCHEMA, f"csv[{i}]", errors)
    if errors:
        raise ValueError(f"{path} does not follow the schema:\n  " + "\n  ".join(errors[:50]))
    return rows


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass
class SweepConfig:
    suite: str
    presets: list
    dim: int | None  # None: the preset's own width
    heads: int | None
    base_seq: dict  # preset -> sequence length of the depth and batch sweeps
    depths: list
    batches: list
    seq_lens: list  # extra lengths for token presets (the ViT's is fixed by the image size)
    base_depth: int
    base_batch: int
    grid: str  # "axes": depth, batch and length swept one at a time; "product": depths x batches
    variants: list  # [[variant, halves], ...]
    warmup: int
    repeats: int
    dtype: str
    exact: bool
    max_batch: bool
    mem_budget_bytes: int | None
    time_limit_s: float | None
    threads: int | None = None  # CPU: torch.set_num_threads (None: torch's default)
    seed: int = 0


SUITES = ("quick", "full", "short", "pareprop")


def default_config(suite: str, device: torch.device) -> SweepConfig:
    """Defaults per suite. On a CPU every suite but ``quick`` runs the reduced sweep (width 128)."""
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")
    cuda = device.type == "cuda"
    all_variants = [[v, "reference"] for v in VARIANTS] + [[v, "fused"] for v in VARIANTS if v not in BASELINES]
    variants = [pair for pair in all_variants if variant_available(pair[0], pair[1], device)]
    common = dict(suite=suite, presets=list(PRESETS), dim=None, heads=None, seq_lens=[], grid="axes",
                  variants=variants, dtype="bf16" if cuda else "fp32", exact=True, max_batch=cuda,
                  mem_budget_bytes=None, time_limit_s=None)
    real_seq = {name: p.tokens for name, p in PRESETS.items()}
    cpu_seq = {"vit-b": 65, "gpt2": 64, "llama": 64}  # 8x8 patches + class token; 64 tokens
    if suite == "quick":
        return SweepConfig(**{**common, "dim": 64, "heads": 2, "max_batch": False, "threads": None if cuda else 1},
                           base_seq={"vit-b": 17, "gpt2": 32, "llama": 32}, depths=[6, 12, 24], batches=[2, 4],
                           base_depth=12, base_batch=4, warmup=1, repeats=2)
    if not cuda:
        # One thread: the shapes are small, and on a busy (CI) machine multi-threaded CPU timings
        # swing by 10x; --threads overrides.
        reduced = {**common, "dim": 128, "heads": 4, "threads": 1}
        if suite == "pareprop":
            return SweepConfig(**{**reduced, "presets": ["vit-b", "gpt2"], "grid": "product",
                                  "variants": [["vanilla", "reference"], ["revtriton-sequential", "reference"],
                                               ["revtriton-pareprop", "reference"]]},
                               base_seq=cpu_seq, depths=[12, 24], batches=[2, 4], base_depth=12, base_batch=2,
                               warmup=1, repeats=3)
        if suite == "short":
            return SweepConfig(**{**reduced, "presets": ["vit-b", "gpt2"]}, base_seq=cpu_seq, depths=[12, 24],
                               batches=[4], base_depth=12, base_batch=4, warmup=1, repeats=3)
        return SweepConfig(**{**reduced, "seq_lens": [32, 128]}, base_seq=cpu_seq, depths=[6, 12, 24, 48],
                           batches=[2, 8], base_depth=12, base_batch=4, warmup=1, repeats=3)
    if suite == "short":
        return SweepConfig(**{**common, "presets": ["vit-b", "gpt2"], "max_batch": False}, base_seq=real_seq,
                           depths=[12, 24], batches=[8], base_depth=12, base_batch=8, warmup=2, repeats=5)
    if suite == "pareprop":
        fused = [pair for pair in variants if pair[1] == "fused"]
        return SweepConfig(**{**common, "presets": ["vit-b", "gpt2"], "grid": "product",
                              "variants": [["vanilla", "reference"]] + fused},
                           base_seq=real_seq, depths=[12, 24], batches=[8, 16, 32], base_depth=12, base_batch=8,
                           warmup=3, repeats=10)
    return SweepConfig(**{**common, "seq_lens": [256, 512, 2048]}, base_seq=real_seq, depths=[6, 12, 24, 48],
                       batches=[16, 32, 64], base_depth=12, base_batch=8, warmup=3, repeats=10)


@dataclass
class Point:
    preset: Preset  # already scaled to the point's width and length
    depth: int
    batch: int
    variant: str
    halves: str
    probe_max_batch: bool = False

    @property
    def seq_len(self) -> int:
        return self.preset.tokens


def build_grid(cfg: SweepConfig) -> list[Point]:
    """Every point of the sweep, grouped by preset and shape, variants innermost."""
    points = []
    for name in cfg.presets:
        base = PRESETS[name]
        base_seq = cfg.base_seq.get(name, base.tokens)
        shapes = []  # (depth, batch, seq_len)
        if cfg.grid == "product":
            shapes += [(d, b, base_seq) for d in cfg.depths for b in cfg.batches]
        else:
            shapes += [(d, cfg.base_batch, base_seq) for d in cfg.depths]
            shapes += [(cfg.base_depth, b, base_seq) for b in cfg.batches]
            if base.unit == "tokens":
                shapes += [(cfg.base_depth, cfg.base_batch, s) for s in cfg.seq_lens]
        for depth, batch, seq in sorted(set(shapes)):
            preset = base.scaled(cfg.dim, cfg.heads, seq)
            # max_batch costs ~10 steps of growing size: searched at the base batch and length,
            # at the base depth and the deepest one.
            probe = (cfg.max_batch and batch == cfg.base_batch and seq == base_seq
                     and depth in (cfg.base_depth, max(cfg.depths)))
            for variant, halves in cfg.variants:
                points.append(Point(preset, depth, batch, variant, halves, probe))
    return points


# --------------------------------------------------------------------------------------------
# Device and environment


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:48] or "unknown"


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        return {"type": "cuda", "name": name, "slug": _slug(name), "count": torch.cuda.device_count(),
                "total_memory_bytes": int(props.total_memory), "capability": f"{props.major}.{props.minor}",
                "cpu_threads": torch.get_num_threads()}
    name = _cpu_name()
    return {"type": "cpu", "name": name, "slug": "cpu-" + _slug(name), "count": 1, "total_memory_bytes": None,
            "capability": None, "cpu_threads": torch.get_num_threads()}


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def init_distributed(device_kind: str) -> Distributed:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Distributed()
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
    return Distributed(dist.get_rank(), dist.get_world_size(), local)


def pick_device(requested: str, ddp: Distributed) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("perf.sweep: --device cuda but torch sees no CUDA device")
        return torch.device("cuda", ddp.local_rank if ddp.active else torch.cuda.current_device())
    if requested != "cpu":
        raise SystemExit(f"perf.sweep: --device must be auto, cpu or cuda, got {requested!r}")
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# Measuring one point

OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(cfg: SweepConfig, device):
    if cfg.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if cfg.dtype != "fp32":
        raise ValueError(f"dtype must be fp32 or bf16, got {cfg.dtype!r}")
    return contextlib.nullcontext()


def time_steps(step, repeats: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``step`` (CUDA events on a GPU)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin) * 1e3)
    return times


def largest_batch(fits, start: int, limit: int = 1 << 16, max_probes: int = 12) -> int | None:
    """Largest batch b <= limit with ``fits(b)``, assuming fits is monotone (bigger never fits better).

    Doubles from ``start`` until a batch fails, then bisects to within 1/16 of the answer;
    None when not even batch 1 fits.
    """
    probes = 0

    def probe(b):
        nonlocal probes
        probes += 1
        return fits(b)

    if not probe(start):
        lo, hi = 0, start
    else:
        lo, hi = start, None
        while hi is None and lo < limit and probes < max_probes:
            candidate = min(lo * 2, limit)
            if probe(candidate):
                lo = candidate
            else:
                hi = candidate
        if hi is None:
            return lo
    while hi - lo > max(1, lo // 16) and probes < max_probes:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo or None


class _Bench:
    """A built model for one point, with its input and a training step."""

    def __init__(self, point: Point, cfg: SweepConfig, device: torch.device, ddp: Distributed):
        torch.manual_seed(cfg.seed)
        with device:  # initialise on the device: a deep model built on the host is slow to move
            model = build_stack(point.preset, point.depth, point.variant, point.halves, exact=cfg.exact)
        if ddp.active:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.model, self.cfg, self.device, self.point = model, cfg, device, point
        self.set_batch(point.batch)

    def set_batch(self, batch: int):
        self.x = self.grad = None
        p = self.point.preset
        self.x = torch.randn(batch, p.tokens, p.dim, device=self.device)

    def step(self):
        self.model.zero_grad(set_to_none=False)  # keep .grad buffers: a step's peak is then its own
        with _autocast(self.cfg, self.device):
            out = self.model(self.x)
        if self.grad is None or self.grad.shape != out.shape:
            self.grad = torch.randn_like(out)
        out.backward(self.grad)


def measure(point: Point, cfg: SweepConfig, device: torch.device, ddp: Distributed) -> dict:
    """The figures of one point (raises OutOfMemoryError when it does not fit)."""
    bench = _Bench(point, cfg, device, ddp)
    launches = 0
    for _ in range(max(1, cfg.warmup)):
        with count_launches() as counter:
            bench.step()
        launches = sum(counter.values())  # the last warm-up step: autotuning is over by then
    _sync(device)
    times = time_steps(bench.step, max(1, cfg.repeats), device)
    peak = peak_memory(bench.step, device)
    total = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    step_s = statistics.median(times) / 1e3
    tokens = point.batch * point.seq_len
    figures = {
        "step_time_ms": statistics.median(times), "step_time_min_ms": min(times),
        "throughput": (point.batch if point.preset.unit == "images" else tokens) / step_s,
        "tokens_per_s": tokens / step_s, "peak_mem_bytes": int(peak), "peak_mem_total_bytes": total,
        "launches_per_step": int(launches),
    }
    budget = cfg.mem_budget_bytes
    if point.probe_max_batch and not ddp.active:
        if budget is None and device.type == "cuda":
            budget = int(torch.cuda.get_device_properties(device).total_memory * 0.9)
        if budget is not None:
            figures["max_batch"] = largest_batch(lambda b: _fits(bench, b, budget), point.batch)
            figures["mem_budget_bytes"] = budget
    return figures


def _fits(bench: _Bench, batch: int, budget: int) -> bool:
    """Does one step at ``batch`` stay within ``budget``? (absolute on a GPU, the step's own peak on a CPU)"""
    device = bench.device
    try:
        bench.set_batch(batch)
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            bench.step()
            _sync(device)
            used = torch.cuda.max_memory_allocated(device)
        else:
            used = peak_memory(bench.step, device)
        return used <= budget
    except OutOfMemoryError:
        return False
    finally:
        bench.x = bench.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def empty_row(point: Point, cfg: SweepConfig, rank: int) -> dict:
    p = point.preset
    row = dict.fromkeys(COLUMNS)
    row.update(preset=p.name, family=p.family, variant=point.variant, halves=point.halves,
               exact=bool(cfg.exact and point.variant not in BASELINES), depth=point.depth, batch=point.batch,
               seq_len=point.seq_len, dim=p.dim, heads=p.heads, kv_heads=p.kv_heads, hidden=p.hidden, dtype=cfg.dtype,
               rank=rank, status="skipped", throughput_unit=f"{p.unit}/s")
    return row


def run_point(point: Point, cfg: SweepConfig, device: torch.device, ddp: Distributed) -> dict:
    row = empty_row(point, cfg, ddp.rank)
    try:
        row.update(measure(point, cfg, device, ddp))
        row["status"] = "ok"
    except Exception as err:  # a broken variant must not hide the others; the exit code reports it
        if ddp.active:
            raise  # under torchrun the other ranks would wait on this one forever
        if isinstance(err, OutOfMemoryError):
            row["status"], row["error"] = "oom", (str(err).splitlines() or ["out of memory"])[0][:300]
        else:
            row["status"], row["error"] = "error", f"{type(err).__name__}: {err}".splitlines()[0][:300]
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def add_ratios(rows: list[dict]) -> None:
    """Fill the ratio columns from the vanilla / checkpoint / sequential rows at the same point."""
    by_point = {}
    for row in rows:
        if row["status"] == "ok":
            key = (row["preset"], row["depth"], row["batch"], row["seq_len"], row["dtype"], row["rank"])
            by_point[key + (row["variant"], row["halves"])] = row
    for row in rows:
        if row["status"] != "ok":
            continue
        key = (row["preset"], row["depth"], row["batch"], row["seq_len"], row["dtype"], row["rank"])
        for baseline, column in (("vanilla", "vanilla"), ("checkpoint", "checkpoint")):
            base = by_point.get(key + (baseline, "reference"))
            if base is not None:
                row[f"time_vs_{column}"] = row["step_time_ms"] / base["step_time_ms"]
                row[f"mem_vs_{column}"] = row["peak_mem_bytes"] / max(1, base["peak_mem_bytes"])
        seq = by_point.get(key + ("revtriton-sequential", row["halves"]))
        if seq is not None and row["variant"].startswith("revtriton"):
            row["speedup_vs_sequential"] = seq["step_time_ms"] / row["step_time_ms"]


# --------------------------------------------------------------------------------------------
# Output: JSON, CSV, Markdown, plots


def _label(row) -> str:
    return row["variant"] + ("/fused" if row["halves"] == "fused" else "")


def plot_series(rows, cfg: SweepConfig, x: str, y: str, fixed: dict) -> dict:
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


def make_plots(rows, cfg: SweepConfig, out_dir: Path, stem: str) -> dict:
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
    plots = {}
    for name, (x, y, fixed, ylabel, scale) in specs.items():
        series = plot_series(rows, cfg, x, y, fixed)
        if not series:
            continue
        file = f"{stem}-{name.replace('_', '-')}.png"
        fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4), squeeze=False)
        ordered = [(p, series[p]) for p in cfg.presets if p in series]
        for ax, (preset, by_label) in zip(axes[0], ordered):
            xs = set()
            for label, pts in sorted(by_label.items()):
                ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], marker="o", label=label)
                xs.update(p[0] for p in pts)
            if x == "batch":
                ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(xs), [str(v) for v in sorted(xs)])
            ax.set_title(preset)
            ax.set_xlabel(x)
            ax.set_ylabel(ylabel if y != "throughput" else f"throughput ({PRESETS[preset].unit}/s)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"revtriton perf: {name.replace('_', ' ')}")
        fig.tight_layout()
        fig.savefig(out_dir / file, dpi=100)
        plt.close(fig)
        plots[name] = {"file": file, "x": x, "y": y, "series": series}
    return plots


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


TABLE_COLUMNS = [("preset", "preset", None), ("variant", "variant", None), ("halves", "halves", None),
                 ("depth", "depth", None), ("batch", "batch", None), ("seq", "seq_len", None),
                 ("step ms", "step_time_ms", "ms"), ("throughput/s", "throughput", "rate"),
                 ("peak MiB", "peak_mem_bytes", "mib"), ("launches", "launches_per_step", None),
                 ("max batch", "max_batch", None), ("t/vanilla", "time_vs_vanilla", "ratio"),
                 ("mem/vanilla", "mem_vs_vanilla", "ratio"), ("t/ckpt", "time_vs_checkpoint", "ratio"),
                 ("mem/ckpt", "mem_vs_checkpoint", "ratio"), ("vs seq", "speedup_vs_sequential", "ratio"),
                 ("status", "status", None)]


def markdown_table(rows) -> str:
    lines = ["| " + " | ".join(title for title, _, _ in TABLE_COLUMNS) + " |",
             "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|"]
    for row in rows:
        if row["rank"] != 0:
            continue
        lines.append("| " + " | ".join(_fmt(row[key], kind) for _, key, kind in TABLE_COLUMNS) + " |")
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


# --------------------------------------------------------------------------------------------
# The command


def _ints(text):
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m perf.sweep", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, finishes in seconds (same as --suite quick)")
    ap.add_argument("--suite", choices=SUITES, default=None,
                    help="full (default; reduced on a CPU), short (gpu_check), pareprop (issue 5's benchmark), quick")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--presets", help=f"comma list of {','.join(PRESETS)}")
    ap.add_argument("--depths", type=_ints, help="comma list, e.g. 6,12,24,48")
    ap.add_argument("--batches", type=_ints, help="comma list of batch sizes (swept at the base depth)")
    ap.add_argument("--seq-lens", type=_ints, help="comma list of extra sequence lengths (token presets)")
    ap.add_argument("--base-batch", type=int)
    ap.add_argument("--base-depth", type=int)
    ap.add_argument("--seq", type=int, help="base sequence length for every preset")
    ap.add_argument("--dim", type=int, help="override the model width")
    ap.add_argument("--heads", type=int, help="override the head count")
    ap.add_argument("--variants", help=f"comma list of {','.join(VARIANTS)} (variant/fused for fused halves)")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--dtype", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, help="CPU threads for torch (default on a CPU: 1)")
    ap.add_argument("--float-streams", action="store_true", help="revtriton with exact=False")
    ap.add_argument("--max-batch", action=argparse.BooleanOptionalAction, default=None,
                    help="search the largest batch that fits the budget (default: on a GPU)")
    ap.add_argument("--mem-budget-gb", type=float, help="budget for --max-batch (default: 90%% of the GPU)")
    ap.add_argument("--time-limit", type=float,
                    help="start no point after this many seconds (the rest: skipped; the first always runs)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default perf/results)")
    ap.add_argument("--tag", default=None, help="suffix of the file names (default: the suite unless full)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def config_from_args(args, device) -> SweepConfig:
    suite = "quick" if args.quick else (args.suite or "full")
    cfg = default_config(suite, device)
    if args.presets:
        names = [n for n in args.presets.split(",") if n]
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            raise SystemExit(f"perf.sweep: unknown presets {unknown}; choose from {list(PRESETS)}")
        cfg.presets = names
    for name in ("depths", "batches", "seq_lens", "base_batch", "base_depth", "dim", "heads", "warmup", "repeats",
                 "dtype", "threads"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    if args.seq:
        cfg.base_seq = dict.fromkeys(PRESETS, args.seq)
    if args.variants:
        pairs = []
        for item in args.variants.split(","):
            variant, _, halves = item.partition("/")
            halves = halves or "reference"
            if variant not in VARIANTS or halves not in HALVES:
                raise SystemExit(f"perf.sweep: unknown variant {item!r}; use {VARIANTS} with an optional /fused")
            if not variant_available(variant, halves, device):
                raise SystemExit(f"perf.sweep: {item} is not available on {device.type} (fused halves need CUDA)")
            pairs.append([variant, halves])
        cfg.variants = pairs
    if args.float_streams:
        cfg.exact = False
    if args.mem_budget_gb is not None:
        cfg.mem_budget_bytes = int(args.mem_budget_gb * 2**30)
        cfg.max_batch = True if args.max_batch is None else args.max_batch
    if args.max_batch is not None:
        cfg.max_batch = args.max_batch
    if cfg.max_batch and device.type != "cuda" and cfg.mem_budget_bytes is None:
        raise SystemExit("perf.sweep: --max-batch on a CPU needs --mem-budget-gb (there is no device memory size)")
    if args.time_limit is not None:
        cfg.time_limit_s = args.time_limit
    return cfg


def run_sweep(points, cfg, device, ddp, progress=True, on_row=None) -> list[dict]:
    """Measure every point (in order); points not started within the time limit are 'skipped'
    (the first point always runs)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = None
    bar = tqdm(total=len(points), desc="perf.sweep", unit="pt", file=sys.stderr, dynamic_ncols=True,
               disable=not progress) if tqdm else None
    start, rows = time.monotonic(), []
    for point in points:
        if bar is not None:
            bar.set_postfix_str(f"{point.preset.name} {point.variant}/{point.halves} d={point.depth} "
                                f"b={point.batch} s={point.seq_len}", refresh=False)
        # The first point always runs, so a sweep always has something to show.
        out_of_time = bool(rows) and cfg.time_limit_s is not None and time.monotonic() - start > cfg.time_limit_s
        if ddp.active:  # every rank must agree, or DDP would wait forever
            import torch.distributed as dist

            flag = [out_of_time]
            dist.broadcast_object_list(flag, src=0)
            out_of_time = flag[0]
        row = empty_row(point, cfg, ddp.rank) if out_of_time else run_point(point, cfg, device, ddp)
        if out_of_time:
            row["error"] = f"time limit {cfg.time_limit_s:g} s reached"
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    requested = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ddp = init_distributed(requested)
    device = pick_device(requested, ddp)
    cfg = config_from_args(args, device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    info = device_info(device)
    created = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    tag = args.tag if args.tag is not None else ("" if cfg.suite == "full" else cfg.suite)
    if ddp.active:
        tag = "-".join(t for t in (tag, f"ws{ddp.world_size}") if t)
    stem = "-".join(t for t in (info["slug"], created[:10], tag) if t)
    out_dir = Path(args.out)
    points = build_grid(cfg)
    if ddp.rank == 0:
        print(f"perf.sweep: {cfg.suite} sweep on {info['name']} ({device}), {len(points)} points, "
              f"torch {torch.__version__}, triton {triton_version()}, world size {ddp.world_size}", file=sys.stderr)
    begin = time.monotonic()

    def write_partial(rows):
        if ddp.rank == 0 and not ddp.active:
            partial = [dict(r) for r in rows]
            add_ratios(partial)
            write_results(make_document(partial, cfg, info, 1, created, time.monotonic() - begin, {}, False),
                          out_dir, stem)

    rows = run_sweep(points, cfg, device, ddp, progress=ddp.rank == 0 and not args.no_progress,
                     on_row=write_partial)
    if ddp.active:
        import torch.distributed as dist

        gathered = [None] * ddp.world_size
        dist.all_gather_object(gathered, rows)
        rows = [row for part in gathered for row in part]
        rows.sort(key=lambda r: r["rank"])
        dist.destroy_process_group()
        if ddp.rank != 0:
            return 0
    add_ratios(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = {} if args.no_plots else make_plots(rows, cfg, out_dir, stem)
    doc = make_document(rows, cfg, info, ddp.world_size, created, time.monotonic() - begin, plots, True)
    paths = write_results(doc, out_dir, stem)
    print(markdown_table(rows))
    print_backend_choices(doc["backend_choices"])
    if ddp.active:
        print("\nper-rank extremes:\n" + rank_summary(rows))
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    print(f"\n{len(rows)} rows ({', '.join(f'{n} {s}' for s, n in counts.items() if n)}) in "
          f"{doc['wall_s']:.1f} s -> {paths['json']} {paths['csv']}"
          + "".join(f" {out_dir / p['file']}" for p in plots.values()))
    for row in rows:
        if row["status"] == "error":
            print(f"error: {row['preset']} {_label(row)} depth {row['depth']} batch {row['batch']}: {row['error']}",
                  file=sys.stderr)
    return 1 if counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
