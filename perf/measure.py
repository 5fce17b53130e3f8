"""Measuring one point of ``python -m perf.sweep``: the device, the model and its training step,
step times, peak memory (perf.memory), Triton launches and the largest batch within a budget.

A point is one (preset, depth, batch, sequence length, variant, halves). :func:`run_point` builds
a fresh model (seed ``cfg.seed``) and input, runs ``cfg.warmup`` steps (the last one counts Triton
launches: autotuning is over by then) and ``cfg.repeats`` timed steps (CUDA events on a GPU,
``perf_counter`` on a CPU; the row keeps their median, min and max), then one step under
:func:`perf.memory.peak_memory`, and returns the row (schema: perf.schema.COLUMNS) with status ok,
oom or error.
"""
from __future__ import annotations

import contextlib
import gc
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from revtriton.engine.graphs import CapturedStep
from revtriton.ops.dispatch import count_launches

from .memory import peak_memory
from .schema import COLUMNS
from .stacks import BASELINES, Preset, build_stack

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
# The CUDA graphs of --cuda-graphs (None: CapturedStep's own). Tests put a stand-in here to run the
# captured path on a CPU.
GRAPH_BACKEND = None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(cfg, device):
    if cfg.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if cfg.dtype != "fp32":
        raise ValueError(f"dtype must be fp32 or bf16, got {cfg.dtype!r}")
    return contextlib.nullcontext()


def time_steps(step, repeats: int, device: torch.device, host: list | None = None) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``step`` (CUDA events on a GPU); ``host``, when
    given, gets each call's host milliseconds (until the call returns, the device not waited for)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            step()
            returned = time.perf_counter()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            step()
            returned = time.perf_counter()
            times.append((returned - begin) * 1e3)
        if host is not None:
            host.append((returned - begin) * 1e3)
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

    def __init__(self, point: Point, cfg, device: torch.device, ddp: Distributed):
        torch.manual_seed(cfg.seed)
        with device:  # initialise on the device: a deep model built on the host is slow to move
            model = build_stack(point.preset, point.depth, point.variant, point.halves, exact=cfg.exact)
        if ddp.active:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.model, self.cfg, self.device, self.point = model, cfg, device, point
        self.graphed = None
        self.set_batch(point.batch)

    def set_batch(self, batch: int):
        self.x = self.grad = self.graphed = None
        p = self.point.preset
        self.x = torch.randn(batch, p.tokens, p.dim, device=self.device)

    def eager_step(self, x=None):
        self.model.zero_grad(set_to_none=False)  # keep .grad buffers: a step's peak is then its own
        with _autocast(self.cfg, self.device):
            out = self.model(self.x if x is None else x)
        if self.grad is None or self.grad.shape != out.shape:
            self.grad = torch.randn_like(out)
        out.backward(self.grad)

    def step(self):
        """One step: eager, or (``cfg.cuda_graphs``) a call of the step captured in a CUDA graph
        (``warmup`` eager calls first, then the capture, then replays)."""
        if not getattr(self.cfg, "cuda_graphs", False):
            return self.eager_step()
        if self.graphed is None:
            backend = GRAPH_BACKEND() if GRAPH_BACKEND is not None else None
            self.graphed = CapturedStep(self.eager_step, warmup=max(1, self.cfg.warmup), _backend=backend)
        self.graphed(self.x)


def measure(point: Point, cfg, device: torch.device, ddp: Distributed) -> dict:
    """The figures of one point (raises OutOfMemoryError when it does not fit)."""
    bench = _Bench(point, cfg, device, ddp)
    launches = 0
    for _ in range(max(1, cfg.warmup)):
        with count_launches() as counter:
            bench.step()
        launches = sum(counter.values())  # the last warm-up step: autotuning is over by then
    graphs = bool(getattr(cfg, "cuda_graphs", False))
    if graphs:
        bench.step()  # the capture (and its replay): the timed calls are replays
    _sync(device)
    host = []
    times = time_steps(bench.step, max(1, cfg.repeats), device, host)
    # The step's own memory: an eager step (a replay allocates nothing; its graph's pool was taken at
    # capture, for the same tensors).
    peak = peak_memory(bench.eager_step, device)
    total = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    step_s = statistics.median(times) / 1e3
    tokens = point.batch * point.seq_len
    figures = {
        "step_time_ms": statistics.median(times), "step_time_min_ms": min(times), "step_time_max_ms": max(times),
        "step_time_repeats": len(times), "host_ms": statistics.median(host), "cuda_graphs": graphs,
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
            bench.eager_step()
            _sync(device)
            used = torch.cuda.max_memory_allocated(device)
        else:
            used = peak_memory(bench.eager_step, device)
        return used <= budget
    except OutOfMemoryError:
        return False
    finally:
        bench.x = bench.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def empty_row(point: Point, cfg, rank: int) -> dict:
    p = point.preset
    row = dict.fromkeys(COLUMNS)
    row.update(preset=p.name, family=p.family, variant=point.variant, halves=point.halves,
               exact=bool(cfg.exact and point.variant not in BASELINES), depth=point.depth, batch=point.batch,
               seq_len=point.seq_len, dim=p.dim, heads=p.heads, kv_heads=p.kv_heads, hidden=p.hidden, dtype=cfg.dtype,
               rank=rank, status="skipped", throughput_unit=f"{p.unit}/s",
               cuda_graphs=bool(getattr(cfg, "cuda_graphs", False)))
    return row


def run_point(point: Point, cfg, device: torch.device, ddp: Distributed) -> dict:
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

