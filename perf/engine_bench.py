"""``python -m perf.engine_bench``: the engine's CPU benchmark (issue 2).

Step time (forward + backward) and peak memory of a reversible stack against the same blocks
under plain autograd (stored activations) and under ``torch.utils.checkpoint`` per block.
Default shape: width 256, 4 heads, sequence 128, batch 4, F = LayerNorm + attention,
G = LayerNorm + MLP (hidden 1024), depths 12 and 24, reference halves (the CPU path).

The variants are timed in interleaved rounds (one step of each per round, the order rotating),
so a busy machine slows them alike and the ratios come from one run. The bar (on the medians):
revtriton's step time <= 1.30 x plain, and its peak memory below checkpointing's. The fastest
step of each is shown too: on a shared machine, noise only ever adds time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from revtriton.profiling import peak_memory

from .stacks import Preset, build_stack

TIME_BAR = 1.30  # revtriton step time / plain step time
VARIANTS = {  # label: (perf.stacks variant, exact streams)
    "plain": ("vanilla", False),
    "checkpoint": ("checkpoint", False),
    "revtriton": ("revtriton-sequential", True),
    "revtriton-float": ("revtriton-sequential", False),
}


def _ints(text):
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m perf.engine_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=_ints, default=[12, 24])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--check", action="store_true", help="exit 1 when a bar is missed")
    return ap.parse_args(argv)


def bench_depth(depth: int, args) -> dict:
    """{label: {"step_ms": median, "steps_ms": [...], "peak_bytes": int}} for one depth."""
    preset = Preset("engine", "vit", args.dim, args.heads, args.heads, args.seq, 4 * args.dim, False, "tokens")
    models = {}
    for label, (variant, exact) in VARIANTS.items():
        torch.manual_seed(0)  # the same weights in every variant
        models[label] = build_stack(preset, depth, variant, "reference", exact=exact)
    x = torch.randn(args.batch, args.seq, args.dim)
    grad = torch.randn_like(x)

    def step_of(model):
        def step():
            model.zero_grad(set_to_none=False)  # .grad buffers stay: the peak is the step's own
            model(x).backward(grad)
        return step

    steps = {label: step_of(model) for label, model in models.items()}
    for step in steps.values():
        for _ in range(max(1, args.warmup)):
            step()
    times = {label: [] for label in steps}
    labels = list(steps)
    for r in range(args.repeats):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label in order:
            begin = time.perf_counter()
            steps[label]()
            times[label].append((time.perf_counter() - begin) * 1e3)
    return {label: {"step_ms": statistics.median(times[label]), "steps_ms": times[label],
                    "peak_bytes": int(peak_memory(steps[label]))} for label in steps}


def report(results: dict, args) -> tuple[str, bool]:
    lines = [f"engine benchmark (CPU, {torch.get_num_threads()} threads): width {args.dim}, {args.heads} heads, "
             f"seq {args.seq}, batch {args.batch}, median of {args.repeats} interleaved steps",
             "",
             "| depth | variant | step ms | time / plain | fastest step ms | fastest / plain's | peak MiB "
             "| mem / plain | mem / checkpoint |",
             "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    verdicts = []
    for depth, by_label in results.items():
        plain, ckpt = by_label["plain"], by_label["checkpoint"]
        for label, r in by_label.items():
            fastest, plain_fastest = min(r["steps_ms"]), min(plain["steps_ms"])
            lines.append(f"| {depth} | {label} | {r['step_ms']:.1f} | {r['step_ms'] / plain['step_ms']:.2f}x | "
                         f"{fastest:.1f} | {fastest / plain_fastest:.2f}x | "
                         f"{r['peak_bytes'] / 2**20:.1f} | {r['peak_bytes'] / plain['peak_bytes']:.3f}x | "
                         f"{r['peak_bytes'] / ckpt['peak_bytes']:.3f}x |")
        rev = by_label["revtriton"]
        t_ratio = rev["step_ms"] / plain["step_ms"]
        m_ratio = rev["peak_bytes"] / ckpt["peak_bytes"]
        t_ok, m_ok = t_ratio <= TIME_BAR, m_ratio < 1.0
        ok &= t_ok and m_ok
        verdicts.append(f"depth {depth}: revtriton time / plain = {t_ratio:.2f}x (bar <= {TIME_BAR:.2f}x): "
                        f"{'PASS' if t_ok else 'MISS'}; peak / checkpoint = {m_ratio:.3f}x (bar < 1): "
                        f"{'PASS' if m_ok else 'MISS'}")
    return "\n".join(lines + [""] + verdicts), ok


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {depth: bench_depth(depth, args) for depth in args.depths}
    text, ok = report(results, args)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()},
                                         "threads": torch.get_num_threads(), "torch_version": torch.__version__,
                                         "results": {str(d): r for d, r in results.items()}}, indent=1) + "\n")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
