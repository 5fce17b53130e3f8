"""``python -m perf.autotune``: warm the on-disk autotune cache for a preset's shapes.

The fused GEMMs are autotuned per (power-of-two bucket of the token count, N, K bucket, variant
flags, dtypes), with ``cache_results=True``: the first run of a shape benchmarks every config and
writes the winner to Triton's cache (``$TRITON_CACHE_DIR``, default ``~/.triton/cache``); later
processes read it. This runs forward + backward of one reversible block of fused halves for each
preset, stream kind, dtype and token count (default: 8192 tokens a step, the production batch of
perf/workloads.py), so a sweep or a training run starts with every config already chosen.

Your own model instead of the presets: ``--model`` (a Hugging Face config or timm name) or its
dimensions (``--dim --heads --hidden --kv-heads --mlp``), as for ``perf.sweep`` (perf.models).

On a machine without CUDA there is nothing to tune: it checks the options, says so and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

from revtriton import ReversibleStack
from revtriton.ops.dispatch import count_launches

from .models import ModelError, add_model_args, model_from_args
from .stacks import PRESETS, make_blocks


def cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=f"python -m {__package__ or 'perf'}.autotune",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=None, help=f"comma list of {','.join(PRESETS)} (default: all)")
    ap.add_argument("--tokens", default="8192",
                    help="comma list of token counts per step to tune at (each power-of-two bucket tunes once)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--dtypes", default="bf16", help="comma list of bf16, fp32")
    ap.add_argument("--streams", default="exact,float", help="comma list of exact, float")
    add_model_args(ap)
    return ap.parse_args(argv)


def warm(preset, batch: int, dtype: str, exact: bool, device) -> tuple[float, int]:
    """Forward + backward of one fused block twice; returns (first run's seconds, launches of the second)."""
    torch.manual_seed(0)
    stack = ReversibleStack(make_blocks(preset, 1, "fused"), exact=exact).to(device)
    x = torch.randn(batch, preset.tokens, preset.dim, device=device, requires_grad=True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()

    def step():
        with amp:
            out = stack(x)
        out.backward(torch.ones_like(out))

    begin = time.perf_counter()
    step()
    torch.cuda.synchronize(device)
    first = time.perf_counter() - begin
    with count_launches() as counter:
        step()
    torch.cuda.synchronize(device)
    return first, sum(counter.values())


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        user = model_from_args(args, dims_define_model=True)
    except ModelError as err:
        print(f"perf.autotune: {err}", file=sys.stderr)
        return 2
    if user is not None:
        if args.presets:
            print("perf.autotune: --presets and a model of your own: choose one", file=sys.stderr)
            return 2
        shapes = {user.preset.name: user.preset}
        for note in user.notes:
            print(f"perf.autotune: approximation: {note}", file=sys.stderr)
    else:
        names = [n for n in (args.presets or ",".join(PRESETS)).split(",") if n]
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            print(f"perf.autotune: unknown presets {unknown}; choose from {list(PRESETS)}", file=sys.stderr)
            return 2
        shapes = {n: PRESETS[n].scaled(tokens=args.seq) if args.seq else PRESETS[n] for n in names}
    if not torch.cuda.is_available():
        what = f"model {user.describe()}" if user is not None else f"presets {', '.join(shapes)}"
        print("perf.autotune: needs a CUDA device (Triton autotunes on the GPU); on this machine the "
              f"reference path runs and there is nothing to tune ({what}).")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"perf.autotune on {torch.cuda.get_device_name(device)}; cache: {cache_dir()}")
    failures = 0
    for name, preset in shapes.items():
        for dtype in [d for d in args.dtypes.split(",") if d]:
            for streams in [s for s in args.streams.split(",") if s]:
                try:
                    seconds, launches = 0.0, 0
                    for tokens in [int(t) for t in args.tokens.split(",") if t]:
                        batch = max(1, round(tokens / preset.tokens))
                        spent, launches = warm(preset, batch, dtype, streams == "exact", device)
                        seconds += spent
                    print(f"  {name:6s} {dtype:4s} {streams:5s} streams: tuned in {seconds:6.1f} s, "
                          f"{launches} launches per block step")
                except Exception as err:  # report every shape, then fail
                    failures += 1
                    print(f"  {name:6s} {dtype:4s} {streams:5s} streams: FAILED {type(err).__name__}: {err}",
                          file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
