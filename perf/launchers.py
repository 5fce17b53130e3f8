"""``python -m perf.launchers``: the fused halves' host work per Triton launch, the launch itself
stubbed out (issue 44, step 5).

On a GPU a fused GEMM call cost about 150-240 us of host time against cuBLAS's 30-50
(perf/results/h200-2026-12-04-tma), while Triton's own JIT launch costs about 9-27 us. The rest is
ours: the op's dispatch (``ops.backend.choose``: its key and pinned choice), the argument checks,
the output allocations and the launchers' argument lists. That Python runs the same on any CPU,
so it is measured here with every ``dispatch.launch`` replaced by a counter: what remains is the
host work before the launches (not Triton's own launch path, nor its autotuner's config lookup).

Each case is one call of a revtriton half as the engine makes it (``couple_half``: F = the
attention half, G = the MLP half of the GPT-2 and LLaMA families), at a shape already tuned: a
first call with real launches (the Triton interpreter on a CPU) pins the Triton candidate
(``ops.backend.use_timer`` with a timer that prefers it) and runs the autotuners; then the timed
calls. Rows: the float and the exact (int32 stream) forward couples, under ``torch.no_grad`` as
in the engine (a stack's forward runs its halves inside its autograd Function's forward, where
grad is off: no half keeps a graph), and the float rebuild with its backward (sign -1 with grad,
as the engine's backward runs it: the fused autograd Function, its gradient launches, autograd's
own work).
Shapes are small (width 64, 16 tokens) so that the CPU's torch ops (allocations, views, the few
reductions outside the kernels) cost what their dispatch costs, as on a GPU.

Each case is timed twice: interleaved (every round runs every case once, in a shuffled order: a
call finds its caches as the other halves' calls left them, as in a model) and alone (its calls one
after the other, warm, as timeit has it). Interleaved costs about twice as much on the 2-core
development machine.

Bar (issue 44): at most 20 us of host work per launch (median, one thread) for the forward couples,
judged on the interleaved figure.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: its kernels run on the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from revtriton.halves.base import couple_half  # noqa: E402
from revtriton.ops import backend, dispatch  # noqa: E402

from .stacks import PRESETS, make_halves  # noqa: E402

US_PER_LAUNCH = 20.0  # the bar on the forward couples (issue 44)
FAMILIES = ("gpt2", "llama")
DIM, HEADS, TOKENS = 64, 4, 16
KINDS = ("float", "exact", "rebuild+backward")
ALONE_WARMUP = 20  # calls before a case's alone timing (its caches warm again after the other cases')


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m perf.launchers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200, help="timed calls per case (interleaved rounds)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default=None, help="cuda when there is one, else cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--check", action="store_true", help="exit 1 when the bar is missed")
    return ap.parse_args(argv)


def _prefer_triton(run, *, op, candidate):
    """A stand-in device timer for ops.backend: the Triton candidate is the faster one."""
    return 1.0 if candidate == "triton" else 2.0


@contextlib.contextmanager
def stubbed_launches():
    """Every ``dispatch.launch`` counted and skipped (outputs stay as allocated). Yields the count."""
    count = [0]

    def launch(kernel, grid, *args, **meta):
        count[0] += 1

    real, dispatch.launch = dispatch.launch, launch
    try:
        yield count
    finally:
        dispatch.launch = real


def cases(device: torch.device) -> dict:
    """{(family, half, kind): call} with each call one couple of a half (and its backward)."""
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        preset = PRESETS[family].scaled(dim=DIM, heads=HEADS, tokens=TOKENS)
        halves = [h.to(device) for h in make_halves(preset)]
        x = torch.randn(1, TOKENS, DIM, device=device)
        x_leaf = x.clone().requires_grad_()
        res = torch.randn_like(x)
        fixed = torch.randint(-2**20, 2**20, x.shape, dtype=torch.int32, device=device)
        grad = torch.randn_like(x)
        for name, half in zip(("F", "G"), halves):
            def forward(half=half, res=res, frac_bits=None):
                with torch.no_grad():
                    return couple_half(half, res, x, 1, frac_bits)

            def rebuild_and_backward(half=half):
                stream, _ = couple_half(half, res, x_leaf, -1, None)
                stream.backward(grad)

            out[(family, name, "float")] = forward
            out[(family, name, "exact")] = functools.partial(forward, res=fixed, frac_bits=16)
            out[(family, name, "rebuild+backward")] = rebuild_and_backward
    return out


def bench(args) -> dict:
    """{(family, half, kind): {"us", "launches", "us_per_launch", "us_all"}}."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cpu = device.type == "cpu"
    calls = cases(device)
    forced = dispatch.force_triton() if on_cpu else contextlib.nullcontext()
    with forced, backend.use_timer(_prefer_triton):
        for call in calls.values():  # real launches: the choice pinned, the autotuners run
            call()
        with stubbed_launches() as count:
            launches = {}
            for key, call in calls.items():
                count[0] = 0
                call()
                launches[key] = count[0]
                if not launches[key]:
                    raise RuntimeError(f"{key}: no Triton launch (the Triton candidate was not chosen)")
            times = {key: [] for key in calls}
            keys = list(calls)
            # Each round in another order: a call right after a backward (its frees) runs slower,
            # and in a fixed cycle that would always be the same case. The collector off while
            # timing, as timeit has it (a collection would land in whichever call comes next).
            order = random.Random(0)
            collecting = gc.isenabled()
            gc.disable()
            try:
                for _ in range(args.repeats):
                    gc.collect()
                    order.shuffle(keys)
                    for key in keys:
                        begin = time.perf_counter()
                        calls[key]()
                        times[key].append((time.perf_counter() - begin) * 1e6)
                # Alone: each case's calls one after the other (warm caches, as timeit has it): what the
                # Python costs by itself; the interleaved figure adds what the other halves' calls evict.
                alone = {}
                for key in keys:
                    gc.collect()
                    for _ in range(ALONE_WARMUP):
                        calls[key]()
                    ts = []
                    for _ in range(args.repeats):
                        begin = time.perf_counter()
                        calls[key]()
                        ts.append((time.perf_counter() - begin) * 1e6)
                    alone[key] = statistics.median(ts)
            finally:
                if collecting:
                    gc.enable()
    return {key: {"us": statistics.median(ts), "launches": launches[key],
                  "us_per_launch": statistics.median(ts) / launches[key], "us_all": ts,
                  "us_alone": alone[key], "us_per_launch_alone": alone[key] / launches[key]}
            for key, ts in times.items()}


def report(results: dict, args) -> tuple[str, bool]:
    lines = [f"the halves' host work with Triton launches stubbed ({args.threads} threads): width {DIM}, "
             f"{TOKENS} tokens, medians of {args.repeats} calls interleaved with the other cases' and of "
             f"{args.repeats} one after the other (alone)", "",
             "| family | half | call | us per call | launches | us per launch | alone: us per call | us per launch |",
             "|---|---|---|---|---|---|---|---|"]
    for (family, half, kind), r in results.items():
        lines.append(f"| {family} | {half} | {kind} | {r['us']:.1f} | {r['launches']} | {r['us_per_launch']:.1f} "
                     f"| {r['us_alone']:.1f} | {r['us_per_launch_alone']:.1f} |")
    forward = {key: r for key, r in results.items() if key[2] != "rebuild+backward"}
    worst_key = max(forward, key=lambda key: forward[key]["us_per_launch"])
    worst = forward[worst_key]["us_per_launch"]
    alone_key = max(forward, key=lambda key: forward[key]["us_per_launch_alone"])
    held = worst <= US_PER_LAUNCH
    lines += ["", f"forward couples: worst {worst:.1f} us per launch ({' '.join(worst_key)}) <= {US_PER_LAUNCH:.0f}: "
              f"{'PASS' if held else 'MISS'} (the bar is judged interleaved; alone the worst is "
              f"{forward[alone_key]['us_per_launch_alone']:.1f}, {' '.join(alone_key)})"]
    return "\n".join(lines), held


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = bench(args)
    finally:
        torch.set_num_threads(threads)
    text, held = report(results, args)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "torch_version": torch.__version__, "device": str(args.device or "auto"),
                  "results": {"/".join(key): r for key, r in results.items()}}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if held or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
