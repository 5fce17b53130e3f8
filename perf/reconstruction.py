"""``python -m perf.reconstruction``: how well scaled couplings invert, measured, vs depth (issue 14).

Stacks of ``ReversibleBlock(F, G, scale1=2**-s, swap=True)`` (the meft1 / meft2 pattern: one
scaled stream a block; ``--both`` scales both streams, the meft3 pattern) with small random MLP
halves (``LayerNormMLP``), at depths 1 .. 48:

* **Reconstruction error** of float streams, ``max |x - inverse(forward(x))|`` over both streams
  (x ~ N(0, 1)): ``forward_streams`` then the stack's ``inverse``. With ``anchor_every=K`` the
  backward rebuilds a block's input from the nearest anchor above it, through at most K blocks:
  measured the same way on chunks of K blocks (forward through each chunk, inverse back from its
  output), the largest error over the chunks (``--anchors``, default 1, 2 and 4). An unscaled
  float32 stack is the baseline. Exact streams have no such error: their stack refuses
  ``inverse()`` for scaled couplings (the bits the shift drops live only in the autograd graph),
  and the backward's rebuild is bitwise (a position-weighted checksum of every rebuilt input is compared
  with the forward's, or the backward raises).
* **Gradient error**: the input's and every parameter's gradient of ``sum(w * stack(x))``
  against plain autograd in float64 (the stored-activation twin of a float64 copy), as the
  largest ``max |g - g_ref| / max |g_ref|`` over those tensors; for exact streams against their
  stored-activation twin (``revtriton.to_stored_activations``, the same rounded model under plain
  autograd), where it must be 0 (bitwise equal), and against float64 plain autograd (the
  fixed-point model's own rounding, not a reconstruction error).
* **Bytes kept per block** for backward (``revtriton.profiling.saved_bytes``: every saved tensor,
  parameters excluded), as ``(kept(2D) - kept(D)) / D``, against the packed size of the bits the
  shift drops (``scale_bits / 8`` bytes per element per scaled stream) and against the
  stored-activation twin.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch

from revtriton import LayerNormMLP, ReversibleBlock, ReversibleStack, to_stored_activations
from revtriton.profiling import saved_bytes


def _ints(text):
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m perf.reconstruction", description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=_ints, default=[1, 2, 4, 8, 16, 32, 48], help="stack depths, e.g. 1,2,4")
    ap.add_argument("--scale-bits", type=int, default=6, help="coupling scale 2**-scale_bits")
    ap.add_argument("--both", action="store_true", help="scale both streams (meft3), not only the first")
    ap.add_argument("--anchors", type=_ints, default=[1, 2, 4], help="anchor_every values besides 0")
    ap.add_argument("--dim", type=int, default=64, help="width of each stream")
    ap.add_argument("--hidden", type=int, default=128, help="hidden units of the MLP halves")
    ap.add_argument("--batch", type=int, default=4, help="sequences in the input")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--frac-bits", type=int, default=16, help="exact streams' fractional bits")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the input")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return ap.parse_args(argv)


def make_blocks(depth, args, scaled=True):
    """``depth`` scaled couplings of random MLP halves (float32), the same weights for every caller."""
    torch.manual_seed(args.seed)
    scale = 2.0**-args.scale_bits if scaled else 1.0
    return [ReversibleBlock(LayerNormMLP(args.dim, args.hidden), LayerNormMLP(args.dim, args.hidden),
                            scale1=scale, scale2=scale if args.both else 1.0, swap=True) for _ in range(depth)]


def _max_diff(a, b):
    return float((a.double() - b.double()).abs().max())


@torch.no_grad()
def inverse_error(blocks, dtype, chunk, x):
    """Largest ``|input - inverse(forward(input))|`` of float stacks of ``chunk`` consecutive blocks
    (``chunk`` = depth: the whole stack), chained: each chunk starts where the last ended."""
    x1 = x2 = x.to(dtype)
    worst = 0.0
    for start in range(0, len(blocks), chunk):
        stack = ReversibleStack(blocks[start: start + chunk], exact=False)
        y1, y2 = stack.forward_streams(x1, x2)
        r1, r2 = stack.inverse(y1, y2)
        err = max(_max_diff(r1, x1), _max_diff(r2, x2))  # max() drops a nan that comes second
        if not (math.isfinite(_max_diff(r1, x1)) and math.isfinite(_max_diff(r2, x2))):
            return math.nan if math.isnan(_max_diff(r1, x1)) or math.isnan(_max_diff(r2, x2)) else math.inf
        worst = max(worst, err)
        x1, x2 = y1, y2
    return worst


def gradients(stack, x, weight):
    """(input grad, parameter grads) of ``sum(weight * stack(x))``."""
    stack.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    (stack(x) * weight).sum().backward()
    return [x.grad] + [p.grad for p in stack.parameters()]


def grad_error(grads, ref, relative=True):
    worst = 0.0
    for g, r in zip(grads, ref):
        diff = _max_diff(g, r)
        scale = float(r.double().abs().max()) if relative else 1.0
        if not math.isfinite(diff):
            return diff  # inf or nan: the rebuild overflowed
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def kept_bytes(stack, x):
    """Bytes one forward of ``stack`` (parameters requiring grad) keeps for backward."""
    return saved_bytes(lambda: stack(x), module=stack)


def measure_depth(depth, args, x, weight):
    blocks = make_blocks(depth, args)
    blocks64 = [copy.deepcopy(b).double() for b in blocks]
    row = {"depth": depth}
    ref = gradients(to_stored_activations(ReversibleStack(copy.deepcopy(blocks64), exact=False)), x.double(),
                    weight.double())  # plain autograd in float64
    for name, dtype, bs in (("f32", torch.float32, blocks), ("f64", torch.float64, blocks64)):
        for anchor in [0] + args.anchors:
            key = f"{name}_a{anchor}"
            # reconstruction through the whole stack (anchor 0) or through at most ``anchor`` blocks
            row[f"inv_{key}"] = inverse_error(bs, dtype, anchor or depth, x)
            stack = ReversibleStack(bs, exact=False, anchor_every=anchor)
            row[f"grad_{key}"] = grad_error(gradients(stack, x.to(dtype), weight.to(dtype)), ref)
    row["inv_f32_unscaled"] = inverse_error(make_blocks(depth, args, scaled=False), torch.float32, depth, x)
    # exact streams: the engine's backward (rebuild from the output, bits kept) vs the stored twin
    exact = ReversibleStack(blocks, exact=True, frac_bits=args.frac_bits)
    twin = to_stored_activations(ReversibleStack(copy.deepcopy(blocks), exact=True, frac_bits=args.frac_bits))
    g_exact = gradients(exact, x, weight)
    row["grad_exact_vs_twin"] = grad_error(g_exact, gradients(twin, x, weight), relative=False)
    row["grad_exact_vs_f64"] = grad_error(g_exact, ref)
    return row


def measure_memory(depth, args, x):
    """Bytes kept for backward by stacks of ``depth`` blocks (exact, float, twins)."""
    out = {}
    blocks = make_blocks(depth, args)
    out["exact"] = kept_bytes(ReversibleStack(blocks, exact=True, frac_bits=args.frac_bits), x)
    out["exact_unscaled"] = kept_bytes(ReversibleStack(make_blocks(depth, args, scaled=False), exact=True,
                                                       frac_bits=args.frac_bits), x)
    for anchor in [0] + args.anchors:
        out[f"float_a{anchor}"] = kept_bytes(ReversibleStack(blocks, exact=False, anchor_every=anchor), x)
    out["stored_exact"] = kept_bytes(to_stored_activations(ReversibleStack(blocks, exact=True,
                                                                           frac_bits=args.frac_bits)), x)
    out["stored_float"] = kept_bytes(to_stored_activations(ReversibleStack(blocks, exact=False)), x)
    return out


def _fmt(v, width=10):
    if v is None:
        return f"{'-':>{width}}"
    if not math.isfinite(v):
        return f"{'nan' if math.isnan(v) else 'inf':>{width}}"
    if v == 0:
        return f"{'0':>{width}}"
    return f"{v:>{width}.2e}"


def report(rows, memory, args, seconds):
    s, anchors = args.scale_bits, [0] + args.anchors
    pattern = "both streams scaled (meft3)" if args.both else "first stream scaled, swap (meft1/meft2)"
    columns = [(f"{name} anchor {a}" if a else name, f"{key}_a{a}") for name, key in (("float32", "f32"),
                                                                                     ("float64", "f64"))
               for a in anchors]
    lines = [f"scaled couplings: scale 2**-{s}, {pattern}; halves LayerNormMLP({args.dim}, {args.hidden}) x2; "
             f"streams [{args.batch}, {args.tokens}, {args.dim}]; exact frac_bits {args.frac_bits}; "
             f"torch threads {torch.get_num_threads()}; {seconds:.0f} s", "",
             "reconstruction error max |x - inverse(forward(x))|, float streams, x ~ N(0, 1); 'anchor K': through at "
             "most K blocks, as the backward's rebuild with anchor_every=K",
             "(exact streams: the backward's rebuild is bitwise, checksummed; inverse() refuses exact scaled "
             "couplings)",
             "",
             "| depth | " + " | ".join(label for label, _ in columns) + " | float32 unscaled |",
             "|---" * (len(columns) + 2) + "|"]
    for r in rows:
        cells = [_fmt(r[f"inv_{key}"]).strip() for _, key in columns] + [_fmt(r["inv_f32_unscaled"]).strip()]
        lines.append(f"| {r['depth']} | " + " | ".join(cells) + " |")
    lines += ["", "gradient error: max over x and every parameter of max |g - g_ref| / max |g_ref|, g_ref from plain "
              "autograd in float64; 'exact vs twin': max |g - g_twin| against the stored-activation twin (0 = bitwise)",
              "",
              "| depth | " + " | ".join(label for label, _ in columns) + " | exact vs twin | exact vs float64 |",
              "|---" * (len(columns) + 3) + "|"]
    for r in rows:
        cells = [_fmt(r[f"grad_{key}"]).strip() for _, key in columns]
        cells += [_fmt(r["grad_exact_vs_twin"]).strip(), _fmt(r["grad_exact_vs_f64"]).strip()]
        lines.append(f"| {r['depth']} | " + " | ".join(cells) + " |")
    (d1, m1), (d2, m2) = sorted(memory.items())
    elements = args.batch * args.tokens * args.dim
    scaled_streams = 2 if args.both else 1
    packed = s / 8 * elements * scaled_streams
    lines += ["", f"bytes kept for backward per block, (kept(depth {d2}) - kept(depth {d1})) / {d2 - d1}; "
              f"a stream is {elements:,} elements ({4 * elements:,} bytes as int32 / float32)", "",
              f"| stack | bytes per block | / packed dropped bits | total kept at depth {d2} |", "|---|---|---|---|"]
    labels = {"exact": "exact, scaled (reversible)", "exact_unscaled": "exact, unscaled (reversible)"}
    labels.update({f"float_a{a}": f"float32, scaled (reversible){f', anchor_every={a}' if a else ''}"
                   for a in anchors})
    labels.update({"stored_exact": "exact twin (stored activations)",
                   "stored_float": "float32 twin (stored activations)"})
    per_block = {}
    for key, label in labels.items():
        per_block[key] = (m2[key] - m1[key]) / (d2 - d1)
        lines.append(f"| {label} | {per_block[key]:,.0f} | {per_block[key] / packed:.3f} | {m2[key]:,} |")
    lines.append("")
    lines.append(f"packed dropped bits: {s}/8 bytes x {elements:,} elements x {scaled_streams} scaled stream(s) = "
                 f"{packed:,.0f} bytes per block; exact scaled keeps {per_block['exact']:,.0f} "
                 f"({per_block['exact'] / packed:.3f}x), {per_block['exact'] / per_block['stored_float']:.4f}x the "
                 f"float32 twin's {per_block['stored_float']:,.0f}")
    return "\n".join(lines), per_block


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The unanchored float stacks measured here are what ReversibleStack warns about: that is the point.
    warnings.filterwarnings("ignore", message="revtriton: float streams with scaled couplings")
    begin = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch, args.tokens, args.dim)
    x = torch.randn(shape, generator=gen)
    weight = torch.randn(shape, generator=gen)
    rows = [measure_depth(depth, args, x, weight) for depth in args.depths]
    big = max(args.depths)
    memory = {d: measure_memory(d, args, x) for d in (big // 2, big)}
    text, per_block = report(rows, memory, args, time.perf_counter() - begin)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()},
                                         "torch_version": torch.__version__, "rows": rows,
                                         "kept_bytes": {str(d): m for d, m in memory.items()},
                                         "kept_bytes_per_block": per_block}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
