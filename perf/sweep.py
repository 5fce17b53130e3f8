"""``python -m perf.sweep``: what revtriton buys on this device, as memory and speed sweeps.

For each preset (ViT-B-like, GPT-2-like, LLaMA-like; see perf/stacks.py), depth, batch and
sequence length, every variant (coupled-stored: the two-stream coupling under plain autograd with
its activations stored, formerly "vanilla"; checkpoint per block; revtriton sequential and PaReprop
backward, reference or fused halves; prenorm-stored: a standard pre-norm transformer block with
stored activations, the baseline most models train with) runs a training step (forward + backward)
and records:

* step time: median over ``repeats`` steps after ``warmup`` steps (CUDA events on a GPU), and the
  spread: the fastest and slowest of those steps; the host's share (``host_ms``: until the step's
  call returns, the device not waited for);
* ``--cuda-graphs``: each point's step (every variant, baselines included) captured in a CUDA graph
  (``revtriton.CapturedStep``) after the warm-up, the replays timed; memory is an eager step's;
* throughput: images/s (ViT) or tokens/s, and tokens/s for every preset;
* peak memory of a step above what was allocated when it started (parameters, their .grad
  buffers kept from the warm-up, the input): ``perf.memory.peak_memory`` (CUDA allocator
  statistics on a GPU, live tensor bytes counted by a dispatch mode on the CPU); on a GPU also
  the absolute ``torch.cuda.max_memory_allocated``;
* Triton launches per step (``revtriton.ops.dispatch.count_launches``);
* on a GPU, the largest batch whose step fits a memory budget;
* ratios against coupled-stored, checkpointing and prenorm-stored at the same point, and PaReprop
  against the sequential schedule where PaReprop has two CUDA streams to overlap (on a CPU it runs
  in order on one: the table says "n/a (CPU: one stream)" instead of a ratio);
* for ``fused`` halves (revtriton's halves as dispatched), which implementation each op got
  (``revtriton.ops.backend``: fused Triton or the cuBLAS + SDPA library path, measured on first
  use) and both timings: ``backend_choices`` in the JSON, printed after the table.

Results go to ``<out>/<device>-<date>[-<suite>].json`` and ``.csv`` (schema: ``RESULTS_SCHEMA``
in perf.schema, checked by :func:`validate_results`), a Markdown table is printed (and saved as ``.md``),
and two PNG plots are written: memory vs depth and throughput vs batch. A run never overwrites
another's files: ``-2``, ``-3``, ... follow the name when it is taken; the last line lists every file.

Under ``torchrun`` every rank runs the same points on its own GPU (the model wrapped in DDP),
rank 0 gathers the rows (one per rank and point) and writes the files.

Your own model instead of the presets: ``--model`` (a Hugging Face config or timm name) or its
dimensions (``--dim --heads --hidden --kv-heads --mlp``), see perf.models. Given ``--depths``,
``--batches`` or ``--seq-lens``, the sweep runs exactly their product (the base value of an axis
not given), nothing else.

The code: perf.models (user models), perf.stacks (the compared stacks), perf.measure (one point),
perf.memory (peak memory), perf.report (tables, plots, files), perf.schema (the results schema);
this module holds the suites, the grid and the command.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import measure
from .measure import (Distributed, OutOfMemoryError, Point, device_info, empty_row, init_distributed,  # noqa: F401
                      largest_batch, pick_device, run_point, time_steps, triton_version)
from .models import ModelError, UserModel, add_model_args, model_from_args
from .report import (_fmt, _label, add_ratios, backend_choices, make_document, make_plots,  # noqa: F401
                     markdown_table, plot_series, print_backend_choices, rank_summary, write_results)
from .schema import (COLUMNS, CSV_COLUMNS, CSV_META_COLUMNS, RESULTS_SCHEMA, ROW_SCHEMA, SCHEMA_VERSION,  # noqa: F401
                     STATUSES, read_csv, validate_csv, validate_results)
from .stacks import (ALL_VARIANTS, BASELINES, HALVES, OPT_IN_VARIANTS, PRESETS, VARIANT_ALIASES,  # noqa: F401
                     VARIANTS, Preset, build_stack, canonical_variant, variant_available)


def _default_out() -> Path:
    """perf/results in a source checkout; ./perf-results where perf is installed (revtriton.perf)."""
    here = Path(__file__).resolve().parent
    if (here.parent / "pyproject.toml").is_file() and (here.parent / "revtriton").is_dir():
        return here / "results"
    return Path("perf-results")


DEFAULT_OUT = _default_out()
PROG = f"python -m {__package__ or 'perf'}.sweep"

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
    cuda_graphs: bool = False  # each step captured in a CUDA graph and replayed (revtriton.CapturedStep)
    models: dict = field(default_factory=dict)  # name -> Preset fields of a user model (perf.models)

    def preset(self, name: str) -> Preset:
        """A preset or user model by name, at its own width (build_grid scales the presets)."""
        if name in self.models:
            return Preset(**self.models[name])
        return PRESETS[name]


SUITES = ("quick", "full", "short", "pareprop")


def default_config(suite: str, device: torch.device) -> SweepConfig:
    """Defaults per suite. On a CPU every suite but ``quick`` runs the reduced sweep (width 128)."""
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")
    cuda = device.type == "cuda"
    all_variants = [[v, "reference"] for v in VARIANTS] + [[v, "fused"] for v in VARIANTS if v not in BASELINES]
    if cuda:  # the opt-in ones where their time and memory are worth the sweep's minutes: a GPU, fused halves
        all_variants += [[v, "fused"] for v in OPT_IN_VARIANTS]
    variants = [pair for pair in all_variants if variant_available(pair[0], pair[1], device)]
    common = dict(suite=suite, presets=list(PRESETS), dim=None, heads=None, seq_lens=[], grid="axes",
                  variants=variants, dtype="bf16" if cuda else "fp32", exact=True, max_batch=cuda,
                  mem_budget_bytes=None, time_limit_s=None)
    real_seq = {name: p.tokens for name, p in PRESETS.items()}
    cpu_seq = {"vit-b": 65, "gpt2": 64, "llama": 64}  # 8x8 patches + class token; 64 tokens
    if suite == "quick":
        return SweepConfig(**{**common, "dim": 64, "heads": 2, "max_batch": False, "threads": None if cuda else 1},
                           base_seq={"vit-b": 17, "gpt2": 32, "llama": 32}, depths=[6, 12], batches=[2, 4],
                           base_depth=6, base_batch=4, warmup=1, repeats=2)
    if not cuda:
        # One thread: the shapes are small, and on a busy (CI) machine multi-threaded CPU timings
        # swing by 10x; --threads overrides.
        reduced = {**common, "dim": 128, "heads": 4, "threads": 1}
        if suite == "pareprop":
            return SweepConfig(**{**reduced, "presets": ["vit-b", "gpt2"], "grid": "product",
                                  "variants": [["coupled-stored", "reference"], ["prenorm-stored", "reference"],
                                               ["revtriton-sequential", "reference"],
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
        fused = [pair for pair in variants if pair[1] == "fused" and pair[0] not in OPT_IN_VARIANTS]
        return SweepConfig(**{**common, "presets": ["vit-b", "gpt2"], "grid": "product",
                              "variants": [["coupled-stored", "reference"], ["prenorm-stored", "reference"]] + fused},
                           base_seq=real_seq, depths=[12, 24], batches=[8, 16, 32], base_depth=12, base_batch=8,
                           warmup=3, repeats=10)
    return SweepConfig(**{**common, "seq_lens": [256, 512, 2048]}, base_seq=real_seq, depths=[6, 12, 24, 48],
                       batches=[16, 32, 64], base_depth=12, base_batch=8, warmup=3, repeats=10)



def build_grid(cfg: SweepConfig) -> list[Point]:
    """Every point of the sweep, grouped by preset and shape, variants innermost.

    ``grid == "product"``: depths x batches x lengths (``seq_lens`` for token models when given,
    else the base length), exactly; ``"axes"``: the depth sweep at the base batch and length, the
    batch sweep at the base depth, and the extra lengths at both bases.
    """
    points = []
    for name in cfg.presets:
        base = cfg.preset(name)
        base_seq = cfg.base_seq.get(name, base.tokens)
        shapes = []  # (depth, batch, seq_len)
        if cfg.grid == "product":
            seqs = cfg.seq_lens if cfg.seq_lens and base.unit == "tokens" else [base_seq]
            shapes += [(d, b, s) for d in cfg.depths for b in cfg.batches for s in seqs]
        else:
            shapes += [(d, cfg.base_batch, base_seq) for d in cfg.depths]
            shapes += [(cfg.base_depth, b, base_seq) for b in cfg.batches]
            if base.unit == "tokens":
                shapes += [(cfg.base_depth, cfg.base_batch, s) for s in cfg.seq_lens]
        for depth, batch, seq in sorted(set(shapes)):
            if name in cfg.models:  # a user model runs at its own width
                preset = dataclasses.replace(base, tokens=seq)
            else:
                preset = base.scaled(cfg.dim, cfg.heads, seq)
            # max_batch costs ~10 steps of growing size: searched at the base batch and length,
            # at the base depth and the deepest one.
            probe = (cfg.max_batch and batch == cfg.base_batch and seq == base_seq
                     and depth in (cfg.base_depth, max(cfg.depths)))
            for variant, halves in cfg.variants:
                points.append(Point(preset, depth, batch, variant, halves, probe))
    return points


# --------------------------------------------------------------------------------------------
# The command


class _IntList(argparse.Action):
    """``--depths 2 4``, ``--depths 2,4`` and ``--depths ""`` (none) alike."""

    def __call__(self, parser, namespace, values, option_string=None):
        out = []
        for value in values:
            for item in value.split(","):
                if item.strip():
                    try:
                        out.append(int(item))
                    except ValueError:
                        parser.error(f"{option_string}: not an integer: {item!r}")
        setattr(namespace, self.dest, out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, finishes in seconds (same as --suite quick)")
    ap.add_argument("--suite", choices=SUITES, default=None,
                    help="full (default; reduced on a CPU), short (gpu_check), pareprop (issue 5's benchmark), quick")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--presets", help=f"comma list of {','.join(PRESETS)}")
    ap.add_argument("--depths", nargs="*", action=_IntList,
                    help="depths, e.g. 6 12 24 or 6,12,24; with --batches / --seq-lens, exactly their product runs")
    ap.add_argument("--batches", nargs="*", action=_IntList, help="batch sizes (see --depths)")
    ap.add_argument("--seq-lens", nargs="*", action=_IntList, help="sequence lengths of token models (see --depths)")
    ap.add_argument("--base-batch", type=int, help="the batch of the depth sweep (default: the suite's)")
    ap.add_argument("--base-depth", type=int, help="the depth of the batch sweep (default: the suite's)")
    ap.add_argument("--seq", type=int, help="base sequence length for every preset / your model")
    ap.add_argument("--variants", help=f"comma list of {','.join(ALL_VARIANTS)} (variant/fused for fused halves; "
                                       f"old names: {', '.join(f'{a} = {v}' for a, v in VARIANT_ALIASES.items())})")
    ap.add_argument("--warmup", type=int, help="untimed steps per point (default: the suite's)")
    ap.add_argument("--repeats", type=int, help="timed steps per point (default: the suite's)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), help="bf16: autocast (default: the suite's)")
    ap.add_argument("--threads", type=int, help="CPU threads for torch (default on a CPU: 1)")
    ap.add_argument("--float-streams", action="store_true", help="revtriton with exact=False")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="capture each point's step in a CUDA graph and time its replays (every variant, the "
                         "stored-activation baselines too, so ratios compare like with like); CUDA only")
    ap.add_argument("--max-batch", action=argparse.BooleanOptionalAction, default=None,
                    help="search the largest batch that fits the budget (default: on a GPU)")
    ap.add_argument("--mem-budget-gb", type=float, help="budget for --max-batch (default: 90%% of the GPU)")
    ap.add_argument("--time-limit", type=float,
                    help="start no point after this many seconds (the rest: skipped; the first always runs)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"results folder (default {DEFAULT_OUT}: perf/results in a checkout, else ./perf-results)")
    ap.add_argument("--tag", default=None, help="suffix of the file names (default: the suite unless full)")
    ap.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar: one heartbeat line per point on stderr instead (also when stderr is "
                         "not a terminal or tqdm is missing)")
    add_model_args(ap)
    return ap.parse_args(argv)


def _reduced_seq(cfg: SweepConfig, preset: Preset) -> int:
    """A user model's base length in a suite that shrinks lengths (quick, and every suite on a CPU):
    the built-in preset of its kind's length there."""
    return cfg.base_seq["vit-b" if preset.unit == "images" else "gpt2"]


def config_from_args(args, device, user: UserModel | None = None) -> SweepConfig:
    suite = "quick" if args.quick else (args.suite or "full")
    cfg = default_config(suite, device)
    if user is None:
        try:
            user = model_from_args(args)
        except ModelError as err:
            raise SystemExit(f"perf.sweep: {err}") from None
    if user is not None:
        if args.presets:
            raise SystemExit("perf.sweep: --presets and a model of your own (--model, --hidden, --kv-heads, --mlp): "
                             "choose one")
        preset = user.preset
        if args.seq is None and cfg.dim is not None:  # this suite shrinks the presets: shrink the length alike
            preset = dataclasses.replace(preset, tokens=_reduced_seq(cfg, preset))
        cfg.presets, cfg.models = [preset.name], {preset.name: dataclasses.asdict(preset)}
        cfg.base_seq = {preset.name: preset.tokens}
        cfg.dim = cfg.heads = None  # its own width
    elif args.presets:
        names = [n for n in args.presets.split(",") if n]
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            raise SystemExit(f"perf.sweep: unknown presets {unknown}; choose from {list(PRESETS)} "
                             "(or your own model: --model, or --dim --heads --hidden --kv-heads --mlp)")
        cfg.presets = names
    overrides = ["base_batch", "base_depth", "warmup", "repeats", "dtype", "threads"]
    if user is None:
        overrides += ["dim", "heads"]
    for name in overrides:
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    if args.seq and user is None:
        cfg.base_seq = dict.fromkeys(PRESETS, args.seq)
    # Axes given on the command line: exactly their product runs (no base points added). An axis
    # not given is the suite's base value (the pareprop suite, a product already, keeps its own).
    if any(getattr(args, name) is not None for name in ("depths", "batches", "seq_lens")):
        product = cfg.grid == "product"
        cfg.grid = "product"
        for axis, base in (("depths", "base_depth"), ("batches", "base_batch")):
            given = getattr(args, axis)
            if given:
                setattr(cfg, axis, list(given))
                if getattr(args, base) is None and getattr(cfg, base) not in given:
                    setattr(cfg, base, given[0])  # the plots' slice and the max-batch probe
            elif not product or given is not None:
                setattr(cfg, axis, [getattr(cfg, base)])
        cfg.seq_lens = list(args.seq_lens or [])
    if args.variants:
        pairs = []
        for item in args.variants.split(","):
            variant, _, halves = item.partition("/")
            variant, halves = canonical_variant(variant), halves or "reference"
            if variant not in ALL_VARIANTS or halves not in HALVES:
                raise SystemExit(f"perf.sweep: unknown variant {item!r}; use {ALL_VARIANTS} with an optional /fused")
            if not variant_available(variant, halves, device):
                raise SystemExit(f"perf.sweep: {item} is not available on {device.type} (fused halves need CUDA)")
            if [variant, halves] not in pairs:  # vanilla and coupled-stored are one variant
                pairs.append([variant, halves])
        cfg.variants = pairs
    if args.float_streams:
        cfg.exact = False
    if args.cuda_graphs:
        if device.type != "cuda" and measure.GRAPH_BACKEND is None:
            raise SystemExit("perf.sweep: --cuda-graphs needs a CUDA device (a CUDA graph)")
        cfg.cuda_graphs = True
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


def heartbeat(i: int, total: int, elapsed: float, row: dict) -> str:
    """The line a finished point prints on stderr when there is no progress bar."""
    label = f"{row['preset']} {_label(row)} depth {row['depth']} batch {row['batch']} seq {row['seq_len']}"
    if row["status"] == "ok":
        result = f"ok, {_fmt(row['step_time_ms'], 'ms')} ms a step, peak {_fmt(row['peak_mem_bytes'], 'mib')} MiB"
    else:
        result = row["status"] + (f" ({row['error']})" if row["error"] else "")
    return f"perf.sweep: [{i}/{total}, {elapsed:.0f} s] {label}: {result}"


def run_sweep(points, cfg, device, ddp, progress=True, on_row=None, heartbeat_lines=False) -> list[dict]:
    """Measure every point (in order); points not started within the time limit are 'skipped'
    (the first point always runs).

    ``progress``: a tqdm bar on stderr when tqdm is installed and stderr is a terminal, else one
    heartbeat line per point; ``heartbeat_lines`` (progress off): the heartbeat lines alone.
    """
    tqdm = None
    if progress and sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:  # the progress bar is optional
            tqdm = None
    bar = tqdm(total=len(points), desc="perf.sweep", unit="pt", file=sys.stderr, dynamic_ncols=True) if tqdm else None
    beat = bar is None and (progress or heartbeat_lines)
    start, rows = time.monotonic(), []
    for i, point in enumerate(points, start=1):
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
        elif beat:
            print(heartbeat(i, len(points), time.monotonic() - start, row), file=sys.stderr, flush=True)
    if bar is not None:
        bar.close()
    return rows


def unique_stem(out_dir: Path, stem: str) -> str:
    """``stem``, or ``stem-2``, ``stem-3``, ...: the first that no earlier run's results use, so a
    sweep never overwrites another's files (every run writes ``<stem>.json``, ``.csv`` and ``.md``)."""
    candidate, n = stem, 1
    while any((out_dir / f"{candidate}.{kind}").exists() for kind in ("json", "csv", "md")):
        n += 1
        candidate = f"{stem}-{n}"
    return candidate


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        user = model_from_args(args)
    except ModelError as err:
        print(f"perf.sweep: {err}", file=sys.stderr)
        return 2
    requested = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ddp = init_distributed(requested)
    device = pick_device(requested, ddp)
    cfg = config_from_args(args, device, user)
    if cfg.cuda_graphs and ddp.active:
        print("perf.sweep: --cuda-graphs under torchrun is not supported yet (DDP's capture needs its own "
              "warm-up, PyTorch's CUDA-graph notes)", file=sys.stderr)
        return 2
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    info = device_info(device)
    created = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    tag = args.tag if args.tag is not None else ("" if cfg.suite == "full" else cfg.suite)
    if cfg.cuda_graphs and args.tag is None:
        tag = "-".join(t for t in (tag, "graphs") if t)
    if ddp.active:
        tag = "-".join(t for t in (tag, f"ws{ddp.world_size}") if t)
    out_dir = Path(args.out)
    stem = unique_stem(out_dir, "-".join(t for t in (info["slug"], created[:10], tag) if t))
    points = build_grid(cfg)
    if ddp.rank == 0:
        print(f"perf.sweep: {cfg.suite} sweep on {info['name']} ({device}), {len(points)} points, "
              f"torch {torch.__version__}, triton {triton_version()}, world size {ddp.world_size}", file=sys.stderr)
        if user is not None:
            ran = dataclasses.replace(user, preset=cfg.preset(cfg.presets[0]))  # at the suite's length
            print(f"perf.sweep: model {ran.describe()}", file=sys.stderr)
            for note in user.notes:
                print(f"perf.sweep: approximation: {note}", file=sys.stderr)
    begin = time.monotonic()

    def write_partial(rows):
        if ddp.rank == 0 and not ddp.active:
            partial = [dict(r) for r in rows]
            add_ratios(partial, device_type=device.type)
            write_results(make_document(partial, cfg, info, 1, created, time.monotonic() - begin, {}, False),
                          out_dir, stem)

    rows = run_sweep(points, cfg, device, ddp, progress=ddp.rank == 0 and not args.no_progress,
                     on_row=write_partial, heartbeat_lines=ddp.rank == 0)
    if ddp.active:
        import torch.distributed as dist

        gathered = [None] * ddp.world_size
        dist.all_gather_object(gathered, rows)
        rows = [row for part in gathered for row in part]
        rows.sort(key=lambda r: r["rank"])
        # Every rank past its last collective, and the points' DDP wrappers (their reducers hold
        # the group) gone, before the group goes: a rank that tore it down while another still
        # talked, or with a reducer alive, aborted at exit now and then ("terminate called without an
        # active exception", about 1 run in 10 on CPU with gloo).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        if ddp.rank != 0:
            return 0
    add_ratios(rows, device_type=device.type)
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
          f"{doc['wall_s']:.1f} s -> {paths['json']} {paths['csv']} {paths['md']}"
          + "".join(f" {out_dir / p['file']}" for p in plots.values()))
    for row in rows:
        if row["status"] == "error":
            print(f"error: {row['preset']} {_label(row)} depth {row['depth']} batch {row['batch']}: {row['error']}",
                  file=sys.stderr)
    return 1 if counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
