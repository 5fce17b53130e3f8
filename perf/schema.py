"""The results schema of ``python -m perf.sweep`` (version 1) and its validators.

One row per (preset, depth, batch, seq_len, variant, halves, rank): :data:`COLUMNS` names every
column with its JSON type and meaning; :data:`RESULTS_SCHEMA` is the whole document as a JSON
Schema (a draft 2020-12 subset), checked by :func:`validate_results`; :func:`validate_csv` checks
a results CSV. perf/README.md documents the same columns.
"""
from __future__ import annotations

import csv
import math

from .stacks import ALL_VARIANTS, HALVES, VARIANT_ALIASES

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "error", "skipped")

# --------------------------------------------------------------------------------------------
# Results schema: one row per (preset, depth, batch, seq_len, variant, halves, rank).

# name: (JSON type or types, description). Figures are null when the point did not run ("oom",
# "error", "skipped") or do not apply (GPU-only figures on a CPU, ratios without a baseline).
COLUMNS = {
    "preset": ("string", "preset name (perf.stacks.PRESETS), or the user model's (perf.models)"),
    "family": ("string", "the halves' kind: vit or gpt2 (LayerNorm + attention, GELU MLP; bidirectional or causal), "
                         "llama (RMSNorm + RoPE grouped-query attention, SwiGLU)"),
    "variant": ("string", ("coupled-stored | checkpoint | revtriton-sequential | revtriton-pareprop | prenorm-stored "
                           "| revtriton-chunked (sequential, token_chunk at the preset's sequence length) "
                           "(older files: vanilla = coupled-stored)")),
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
    "step_time_max_ms": (["number", "null"], "slowest step, ms (with min and the median: the spread over repeats)"),
    "step_time_repeats": (["integer", "null"], "timed steps the median, min and max are over"),
    "host_ms": (["number", "null"], ("median host time of a step call, ms: from the call until it returns, without "
                                     "waiting for the device (on a GPU, step_time_ms near host_ms: the GPU waits on "
                                     "the host; on a CPU both are the step)")),
    "cuda_graphs": (["boolean", "null"], "the step captured in a CUDA graph and replayed (--cuda-graphs)"),
    "throughput": (["number", "null"], "samples of the preset's unit per second (see throughput_unit)"),
    "throughput_unit": ("string", "images/s (ViT) or tokens/s"),
    "tokens_per_s": (["number", "null"], "batch * seq_len / step time"),
    "peak_mem_bytes": (["integer", "null"], "peak bytes allocated by a step above those allocated at its start"),
    "peak_mem_total_bytes": (["integer", "null"], "GPU only: torch.cuda.max_memory_allocated over the step"),
    "launches_per_step": (["integer", "null"], "Triton kernel launches in one step (0 on the reference path)"),
    "max_batch": (["integer", "null"], "largest batch whose step fits mem_budget_bytes (GPU, or --mem-budget-gb)"),
    "mem_budget_bytes": (["integer", "null"], "the budget max_batch was searched under"),
    "time_vs_vanilla": (["number", "null"], "step time / coupled-stored's (formerly vanilla) at the same point"),
    "mem_vs_vanilla": (["number", "null"], "peak_mem_bytes / coupled-stored's (formerly vanilla) at the same point"),
    "time_vs_checkpoint": (["number", "null"], "step time / checkpoint's at the same point"),
    "mem_vs_checkpoint": (["number", "null"], "peak_mem_bytes / checkpoint's at the same point"),
    "time_vs_prenorm": (["number", "null"], "step time / prenorm-stored's (a standard pre-norm block) at the same point"),
    "mem_vs_prenorm": (["number", "null"], "peak_mem_bytes / prenorm-stored's at the same point"),
    "speedup_vs_sequential": (["number", "null"], ("revtriton-sequential's step time / this one's (same halves); "
                                                   "CUDA only: on a CPU PaReprop runs on one stream, i.e. sequentially")),
    "speedup_vs_sequential_note": (["string", "null"], ("why speedup_vs_sequential is null for a revtriton row, "
                                                        "e.g. 'n/a (CPU: one stream)'")),
}
# Columns added after schema version 1 first shipped: rows of older files may lack them (read as
# null); rows written now always have them.
OPTIONAL_COLUMNS = ("step_time_max_ms", "step_time_repeats", "time_vs_prenorm", "mem_vs_prenorm",
                    "speedup_vs_sequential_note", "host_ms", "cuda_graphs")
# Columns every CSV row repeats so a CSV file stands alone.
CSV_META_COLUMNS = ("device_name", "torch_version", "triton_version", "date")
CSV_COLUMNS = CSV_META_COLUMNS + tuple(COLUMNS)
LEGACY_CSV_COLUMNS = tuple(c for c in CSV_COLUMNS if c not in OPTIONAL_COLUMNS)  # files of older sweeps


def _json_type(types):
    return types if isinstance(types, str) else list(types)


ROW_SCHEMA = {
    "type": "object",
    "required": [name for name in COLUMNS if name not in OPTIONAL_COLUMNS],
    "additionalProperties": False,
    "properties": {name: {"type": _json_type(types), "description": text} for name, (types, text) in COLUMNS.items()},
}
ROW_SCHEMA["properties"]["variant"]["enum"] = list(ALL_VARIANTS) + list(VARIANT_ALIASES)  # old files: vanilla
ROW_SCHEMA["properties"]["halves"]["enum"] = list(HALVES)
ROW_SCHEMA["properties"]["status"]["enum"] = list(STATUSES)
for _name in ("depth", "batch", "seq_len", "dim", "heads", "kv_heads", "hidden"):
    ROW_SCHEMA["properties"][_name]["minimum"] = 1
for _name in ("rank", "peak_mem_bytes", "peak_mem_total_bytes", "launches_per_step", "max_batch",
              "step_time_repeats"):
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


def _spread_errors(row: dict, path: str) -> list[str]:
    """min <= median <= max where the row has all three (older rows have no max)."""
    spread = [row.get(k) for k in ("step_time_min_ms", "step_time_ms", "step_time_max_ms")]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in spread)
    if numbers and not spread[0] <= spread[1] <= spread[2]:
        return [f"{path}: step times not ordered min <= median <= max: {spread}"]
    return []


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
        errors.extend(_spread_errors(row, f"$.rows[{i}]"))
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
    """Rows of a results CSV, typed by :data:`COLUMNS` (checks the header). An older file's header
    (:data:`LEGACY_CSV_COLUMNS`, without the optional columns) is accepted: those read as null."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) not in (CSV_COLUMNS, LEGACY_CSV_COLUMNS):
            raise ValueError(f"{path}: header {reader.fieldnames} != {list(CSV_COLUMNS)}")
        rows = []
        for line, raw in enumerate(reader, start=2):
            try:
                rows.append({name: (raw[name] if name in CSV_META_COLUMNS else
                                    None if name not in raw else _csv_value(raw[name], COLUMNS[name][0]))
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
        errors.extend(_spread_errors(row, f"csv[{i}]"))
    if errors:
        raise ValueError(f"{path} does not follow the schema:\n  " + "\n  ".join(errors[:50]))
    return rows
