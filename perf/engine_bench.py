"""``python -m perf.engine_bench``: the engine's CPU benchmark against the anchor libraries (issues 2, 20).

Step time (forward + backward), bytes saved for backward and peak memory of one two-stream stack
run five ways: plain autograd (every activation stored, 1.00x), ``torch.utils.checkpoint`` per
block, RevTorch 0.2.4's ReversibleSequence (when ``revtorch`` is installed: an optional
dependency of this benchmark only), and revtriton's ReversibleStack with float and with exact
(int32) streams. The blocks are the same in all of them (the same modules, the same seed):
F = LayerNorm + causal attention, G = LayerNorm + MLP (4x, GELU), ``y1 = x1 + F(x2)``,
``y2 = x2 + G(y1)``, width 256 per stream, sequence 128, batch 4; the input (width 512) is split
into the two streams and the output is their concatenation, as RevTorch does it. The halves are
the pure-torch reference ops (the CPU path).

The variants are timed in interleaved rounds (one step of each per round, the order rotating),
so a busy machine slows them alike and the ratios come from one run; each row shows the median
and the fastest step (on a shared machine noise only ever adds time). Peak memory is measured
after the timing with ``revtriton.profiling.peak_memory`` (live tensor bytes on a CPU, no
profiler): the parameters' ``.grad`` buffers exist before the step (``zero_grad(set_to_none=
False)``), so the peak is the step's own, i.e. peak minus parameter gradients. The one-block
bound beside it is that of one block under plain autograd (its stored activations and the
backward's buffers): a per-block recompute cannot need less than one half of it at once.

Checkpointing recomputes less than a rebuild: torch's non-reentrant checkpoint stops each block's
recompute at the last tensor its backward saved (``early_stop``), so it never recomputes the MLP's
second GEMM (its output is not saved), while a reversible block needs G's whole output to rebuild
``x2 = y2 - G(y1)``. That GEMM is about 7% of a step here (1 thread, depth 12: 30 of 430 ms). The
row "no early stop" is torch's checkpoint recomputing whole blocks, the same work as a rebuild.

Bars (issue 20), on the medians: revtriton float <= checkpoint x 1.03 and <= RevTorch's time;
exact <= float x 1.04; revtriton's peak minus parameter gradients <= RevTorch's + 0.5 MiB. Time
ratios are printed on wall-clock time (the bars of ``--check``) and on process CPU time (user +
system of all threads), which other jobs on a shared machine disturb much less.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from revtriton import ReversibleBlock, ReversibleStack
from revtriton.profiling import peak_memory, saved_bytes

from .stacks import Preset, StoredActivationStack, make_blocks, make_halves

MIB = 2**20
FLOAT_VS_CHECKPOINT = 1.03  # revtriton float streams' time / checkpoint's
EXACT_VS_FLOAT = 1.04  # exact streams' time / float streams'
PEAK_SLACK_BYTES = MIB // 2  # revtriton's peak minus grads <= RevTorch's + this
# label: what it is (the table's first column)
VARIANTS = {
    "plain": "plain autograd",
    "checkpoint": "torch checkpoint per block",
    "checkpoint-whole": "torch checkpoint per block, no early stop",
    "revtorch": "RevTorch 0.2.4",
    "revtriton-float": "revtriton, float streams",
    "revtriton": "revtriton, exact streams",
}


# The host rows (issue 44): shapes so small that a step is all host work (Python, dispatch, autograd),
# so the rows compare each library's own per-block overhead.
HOST_DEPTH, HOST_DIM, HOST_HEADS, HOST_TOKENS = 24, 16, 2, 4
HOST_FLOAT_VS_REVTORCH = 1.05  # revtriton float streams' step / RevTorch's
HOST_EXACT_VS_FLOAT = 1.25  # exact streams' step / float streams'
HOST_TRANSFORMER_VS_PLAIN = 1.5  # revtriton's transformer halves: float streams' step / plain autograd's
HOST_DROP = 0.1  # the dropout / drop-path rate of the host rows whose halves draw
# (halves, label): what it is
HOST_VARIANTS = {
    ("generic", "plain"): "generic halves, plain autograd",
    ("generic", "checkpoint"): "generic halves, torch checkpoint per block",
    ("generic", "revtorch"): "generic halves, RevTorch 0.2.4",
    ("generic", "revtriton-float"): "generic halves, revtriton float streams",
    ("generic", "revtriton"): "generic halves, revtriton exact streams",
    ("transformer", "plain"): "transformer halves, plain autograd",
    ("transformer", "revtriton-float"): "transformer halves, revtriton float streams",
    ("transformer", "revtriton"): "transformer halves, revtriton exact streams",
    # Halves that draw random numbers (issue 45): nn.Dropout after each generic half (its draws routed to
    # the half's generator by the engine's dispatch mode), drop-path in revtriton's (the half asks for it).
    ("generic+dropout", "plain"): f"generic halves + dropout {HOST_DROP}, plain autograd",
    ("generic+dropout", "revtriton-float"): f"generic halves + dropout {HOST_DROP}, revtriton float streams",
    ("transformer+drop-path", "plain"): f"transformer halves + drop-path {HOST_DROP}, plain autograd",
    ("transformer+drop-path", "revtriton-float"): f"transformer halves + drop-path {HOST_DROP}, revtriton float streams",
}


def _ints(text):
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m perf.engine_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=_ints, default=None, help="default: 12,24 (--host: 24)")
    ap.add_argument("--dim", type=int, default=256, help="width of each stream (the input is twice this)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads of the transformer halves")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--warmup", type=int, default=None, help="default: 2 (--host: 5)")
    ap.add_argument("--repeats", type=int, default=None, help="default: 9 (--host: 60)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--no-revtorch", action="store_true", help="leave RevTorch out even when it is installed")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--check", action="store_true", help="exit 1 when a bar is missed")
    ap.add_argument("--host", action="store_true",
                    help=f"the host rows instead: depth {HOST_DEPTH}, width {HOST_DIM} per stream, {HOST_TOKENS} tokens, "
                         "batch 1, one thread (defaults: 5 warm-up steps, 60 repeats); and the recompute floor: "
                         "the transformer halves' rebuild couples batched and each followed by its backward")
    args = ap.parse_args(argv)
    if args.host:  # the host rows' own defaults, unless given
        args.depths = args.depths or [HOST_DEPTH]
        args.warmup = 5 if args.warmup is None else args.warmup
        args.repeats = 60 if args.repeats is None else args.repeats
        args.threads = args.threads or 1
    else:
        args.depths = args.depths or [12, 24]
        args.warmup = 2 if args.warmup is None else args.warmup
        args.repeats = 9 if args.repeats is None else args.repeats
    return args


def revtorch_module():
    """The ``revtorch`` package, or None when it is not installed."""
    try:
        import revtorch
    except ImportError:
        return None
    return revtorch


class RevTorchStack(nn.Module):
    """The same halves in RevTorch's ReversibleSequence (it splits the last dim, as configured here)."""

    def __init__(self, blocks, revtorch):
        super().__init__()
        self.sequence = revtorch.ReversibleSequence(nn.ModuleList(
            [revtorch.ReversibleBlock(block.f, block.g, split_along_dim=-1) for block in blocks]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sequence(x)


def preset_of(args) -> Preset:
    return Preset("engine", "vit", args.dim, args.heads, args.heads, args.seq, 4 * args.dim, True, "tokens",
                  activation="gelu")


def build(label: str, preset: Preset, depth: int, revtorch=None) -> nn.Module:
    torch.manual_seed(0)  # the same weights in every variant
    blocks = make_blocks(preset, depth, "reference")
    if label == "plain":
        return StoredActivationStack(blocks, streams="split")
    if label in ("checkpoint", "checkpoint-whole"):
        return StoredActivationStack(blocks, checkpoint_blocks=True, streams="split", early_stop=label == "checkpoint")
    if label == "revtorch":
        return RevTorchStack(blocks, revtorch)
    return ReversibleStack(blocks, exact=label == "revtriton", streams="split")


def step_of(model, x, grad):
    """One training step. ``x`` requires grad (RevTorch records its node only then), as the output of
    an embedding does; its gradient is made in every step."""
    def step():
        model.zero_grad(set_to_none=False)  # .grad buffers stay: the peak is the step's own
        x.grad = None
        model(x).backward(grad)
    return step


def interleaved_times(steps: dict, repeats: int) -> tuple[dict, dict]:
    """Wall-clock and process-CPU ms of each step, one of each per round, the order rotating."""
    labels = list(steps)
    times = {label: [] for label in labels}
    cpu_times = {label: [] for label in labels}
    for r in range(repeats):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            begin, cpu_begin = time.perf_counter(), time.process_time()
            steps[label]()
            cpu_times[label].append((time.process_time() - cpu_begin) * 1e3)
            times[label].append((time.perf_counter() - begin) * 1e3)
    return times, cpu_times


def warmed_and_timed(models: dict, x, grad, args) -> tuple[dict, dict]:
    """Each model's training step warmed up (``args.warmup`` times), then timed in interleaved
    rounds (:func:`interleaved_times`): wall-clock and CPU ms per key."""
    steps = {key: step_of(model, x, grad) for key, model in models.items()}
    for step in steps.values():
        for _ in range(max(1, args.warmup)):
            step()
    return interleaved_times(steps, args.repeats)


def bench_depth(depth: int, args, labels) -> dict:
    """{label: {"step_ms", "steps_ms", "peak_bytes", "saved_bytes"}} for one depth."""
    preset = preset_of(args)
    revtorch = revtorch_module()
    models = {label: build(label, preset, depth, revtorch) for label in labels}
    x = torch.randn(args.batch, args.seq, 2 * args.dim, requires_grad=True)
    grad = torch.randn_like(x)
    times, cpu_times = warmed_and_timed(models, x, grad, args)
    out = {}
    for label, model in models.items():
        saved = saved_bytes(lambda: model(x), model)
        out[label] = {"step_ms": statistics.median(times[label]), "steps_ms": times[label],
                      "cpu_ms": statistics.median(cpu_times[label]), "cpu_steps_ms": cpu_times[label],
                      "peak_bytes": int(peak_memory(step_of(model, x, grad))), "saved_bytes": int(saved)}
    return out


def generic_halves(dim: int):
    """The generic halves of the host rows: F = LayerNorm + Linear, G = LayerNorm + MLP (4x, GELU),
    plain torch modules the engine knows nothing about."""
    return (nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim)),
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)))


def host_blocks(halves: str, depth: int) -> list:
    """``generic``: :func:`generic_halves`; ``transformer``: revtriton's LayerNormAttention /
    LayerNormMLP as dispatched (on a CPU their ops' reference path, through the engine's fused
    couple), under plain autograd their forward (the same math). ``+dropout``: an ``nn.Dropout``
    after each generic half; ``+drop-path``: the transformer halves' drop-path (both HOST_DROP)."""
    kind, _, draws = halves.partition("+")
    preset = Preset("host", "vit", HOST_DIM, HOST_HEADS, HOST_HEADS, HOST_TOKENS, 4 * HOST_DIM, True, "tokens",
                    activation="gelu")
    make = (lambda: generic_halves(HOST_DIM)) if kind == "generic" else (lambda: make_halves(preset))
    blocks = []
    for _ in range(depth):
        f, g = make()
        if draws == "dropout":
            f, g = nn.Sequential(*f, nn.Dropout(HOST_DROP)), nn.Sequential(*g, nn.Dropout(HOST_DROP))
        elif draws == "drop-path":
            f.drop_path = g.drop_path = HOST_DROP
        blocks.append(ReversibleBlock(f, g))
    return blocks


def build_host(halves: str, label: str, depth: int, revtorch=None) -> nn.Module:
    torch.manual_seed(0)
    blocks = host_blocks(halves, depth)
    if label == "plain":
        return StoredActivationStack(blocks, streams="split")
    if label == "checkpoint":
        return StoredActivationStack(blocks, checkpoint_blocks=True, streams="split")
    if label == "revtorch":
        return RevTorchStack(blocks, revtorch)
    return ReversibleStack(blocks, exact=label == "revtriton", streams="split")


def bench_host(args, keys) -> dict:
    """{(halves, label): {"step_ms", "steps_ms", "cpu_ms", "cpu_steps_ms"}}, every variant timed in
    the same interleaved rounds."""
    revtorch = revtorch_module()
    depth = args.depths[0]
    models = {key: build_host(*key, depth, revtorch) for key in keys}
    x = torch.randn(1, HOST_TOKENS, 2 * HOST_DIM, requires_grad=True)
    grad = torch.randn_like(x)
    times, cpu_times = warmed_and_timed(models, x, grad, args)
    return {key: {"step_ms": statistics.median(times[key]), "steps_ms": times[key],
                  "cpu_ms": statistics.median(cpu_times[key]), "cpu_steps_ms": cpu_times[key]} for key in keys}


def interleaved_forwards(repeats: int, depth: int) -> dict:
    """What the transformer halves' forward calls cost when each one's backward runs right after it, as
    a reversible backward rebuilds them (rebuild G, its backward, rebuild F, its backward), against the
    same calls run one after the other with their backwards after them all (as plain autograd's forward
    runs them): ``{"batched_ms", "interleaved_ms"}``, medians of ``repeats`` rounds of the ``2 * depth``
    rebuild couples (sign -1, with grad), their own time only. The same calls on the same tensors: the
    difference is what each backward leaves of the caches for the next forward call."""
    blocks = host_blocks("transformer", depth)
    halves = [half for block in blocks for half in block.coupling_halves()]
    res = torch.randn(1, HOST_TOKENS, HOST_DIM)
    grad = torch.randn_like(res)

    def batched() -> float:
        spent, ports = 0.0, []
        for half in halves:
            x = res.detach().requires_grad_()
            begin = time.perf_counter()
            ports.append(half.couple(res, x, -1, None)[1])
            spent += time.perf_counter() - begin
        for port in reversed(ports):
            torch.autograd.backward(port, grad)
        return spent * 1e3

    def interleaved() -> float:
        spent = 0.0
        for half in halves:
            x = res.detach().requires_grad_()
            begin = time.perf_counter()
            port = half.couple(res, x, -1, None)[1]
            spent += time.perf_counter() - begin
            torch.autograd.backward(port, grad)
        return spent * 1e3

    rounds = {"batched_ms": [], "interleaved_ms": []}
    for r in range(repeats + 3):  # (three warm-up rounds)
        for name, run in (("batched_ms", batched), ("interleaved_ms", interleaved))[::1 if r % 2 else -1]:
            took = run()
            if r >= 3:
                rounds[name].append(took)
    return {name: statistics.median(times) for name, times in rounds.items()}


def host_verdicts(results: dict, key: str = "step_ms") -> list[tuple[str, bool]]:
    """(text, held) for issue 44's host bars, on the medians of ``key``."""
    t = {k: r[key] for k, r in results.items()}
    out = []
    fl, ex = t[("generic", "revtriton-float")], t[("generic", "revtriton")]
    if ("generic", "revtorch") in t:
        rt = t[("generic", "revtorch")]
        out.append((f"generic float {fl:.2f} ms <= RevTorch {rt:.2f} ms x {HOST_FLOAT_VS_REVTORCH}",
                    fl <= rt * HOST_FLOAT_VS_REVTORCH))
    out.append((f"generic exact {ex:.2f} ms <= float {fl:.2f} ms x {HOST_EXACT_VS_FLOAT}", ex <= fl * HOST_EXACT_VS_FLOAT))
    tf, tp = t[("transformer", "revtriton-float")], t[("transformer", "plain")]
    out.append((f"transformer float {tf:.2f} ms <= plain {tp:.2f} ms x {HOST_TRANSFORMER_VS_PLAIN}",
                tf <= tp * HOST_TRANSFORMER_VS_PLAIN))
    return out


def host_report(results: dict, args, depth: int, forwards: dict | None = None) -> tuple[str, bool]:
    lines = [f"host rows (CPU, {torch.get_num_threads()} threads): depth {depth}, width {HOST_DIM} per stream (input "
             f"{2 * HOST_DIM}, split), {HOST_TOKENS} tokens, batch 1; medians of {args.repeats} interleaved steps",
             "",
             "| variant | step ms | time / plain | us per block over plain | CPU ms | CPU / plain |",
             "|---|---|---|---|---|---|"]
    for key, r in results.items():
        plain = results[(key[0], "plain")]
        lines.append(f"| {HOST_VARIANTS[key]} | {r['step_ms']:.2f} | {r['step_ms'] / plain['step_ms']:.3f}x "
                     f"| {(r['step_ms'] - plain['step_ms']) * 1e3 / depth:.0f} | {r['cpu_ms']:.2f} "
                     f"| {r['cpu_ms'] / plain['cpu_ms']:.3f}x |")
    wall, cpu = host_verdicts(results), host_verdicts(results, "cpu_ms")
    checks = [f"{name}: " + "; ".join(f"{text}: {'PASS' if h else 'MISS'}" for text, h in held)
              for name, held in (("wall", wall), ("CPU", cpu))]
    if ("generic", "revtorch") not in results:
        checks.append("RevTorch not installed (pip install revtorch==0.2.4): its bar is left out")
    if forwards is not None:
        plain = results[("transformer", "plain")]["step_ms"]
        batched, interleaved = forwards["batched_ms"], forwards["interleaved_ms"]
        checks.append(f"recompute floor, transformer halves: their {2 * depth} rebuild couples take {batched:.2f} ms "
                      f"one after the other and {interleaved:.2f} ms each followed by its backward "
                      f"({interleaved / batched:.2f}x); plain autograd's step plus them: "
                      f"{(plain + batched) / plain:.2f}x and {(plain + interleaved) / plain:.2f}x plain")
    return "\n".join(lines + [""] + checks), all(h for _, h in wall)


def one_block_bound(args) -> int:
    """Peak minus parameter grads of one block under plain autograd (same shapes)."""
    model = build("plain", preset_of(args), 1)
    x = torch.randn(args.batch, args.seq, 2 * args.dim, requires_grad=True)
    step = step_of(model, x, torch.randn_like(x))
    step()
    return int(peak_memory(step))


def verdicts(by_label: dict, key: str = "step_ms") -> list[tuple[str, bool]]:
    """(text, held) for each of issue 20's bars at one depth, on the medians of ``key`` (wall or CPU time)."""
    plain = by_label["plain"][key]
    ratio = {label: r[key] / plain for label, r in by_label.items()}
    out = []
    fl, ex, ck = ratio["revtriton-float"], ratio["revtriton"], ratio["checkpoint"]
    out.append((f"float {fl:.3f}x <= checkpoint {ck:.3f}x x {FLOAT_VS_CHECKPOINT}", fl <= ck * FLOAT_VS_CHECKPOINT))
    if "checkpoint-whole" in ratio:  # the same recompute as a rebuild's (see the module doc)
        whole = ratio["checkpoint-whole"]
        out.append((f"float {fl:.3f}x <= checkpoint without early stop {whole:.3f}x", fl <= whole))
    if "revtorch" in by_label:
        out.append((f"float {fl:.3f}x <= RevTorch {ratio['revtorch']:.3f}x", fl <= ratio["revtorch"]))
    out.append((f"exact {ex:.3f}x <= float {fl:.3f}x x {EXACT_VS_FLOAT}", ex <= fl * EXACT_VS_FLOAT))
    return out


def memory_verdicts(by_label: dict) -> list[tuple[str, bool]]:
    if "revtorch" not in by_label:
        return []
    out = []
    limit = by_label["revtorch"]["peak_bytes"] + PEAK_SLACK_BYTES
    for label in ("revtriton-float", "revtriton"):
        peak = by_label[label]["peak_bytes"]
        out.append((f"{label} peak {peak / MIB:.2f} MiB <= RevTorch's + 0.5 = {limit / MIB:.2f} MiB", peak <= limit))
    return out


def malloc_settings() -> dict:
    """The glibc heap settings in the environment (``MALLOC_*_``): they change CPU timings (a heap
    trimmed back to the kernel faults its pages in again next step), so a result names them."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") and k.endswith("_")}


def report(results: dict, args, bound: int) -> tuple[str, bool]:
    """The table and the bars' verdicts. ``ok``: every bar holds on wall-clock medians (the issue's
    measure); the CPU-time verdicts (process time, which a busy shared machine disturbs less) are
    printed beside them."""
    lines = [f"engine benchmark (CPU, {torch.get_num_threads()} threads): width {args.dim} per stream (input "
             f"{2 * args.dim}, split), {args.heads} heads, causal, seq {args.seq}, batch {args.batch}, MLP "
             f"{4 * args.dim} GELU; medians of {args.repeats} interleaved steps (wall clock and process CPU time); "
             f"glibc heap: {' '.join(f'{k}={v}' for k, v in malloc_settings().items()) or 'defaults'}",
             "",
             "| depth | variant | step ms | time / plain | fastest / plain's | CPU ms | CPU / plain "
             "| saved for backward MiB | peak minus param grads MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    checks = []
    for depth, by_label in results.items():
        plain = by_label["plain"]
        for label, r in by_label.items():
            fastest, plain_fastest = min(r["steps_ms"]), min(plain["steps_ms"])
            lines.append(f"| {depth} | {VARIANTS[label]} | {r['step_ms']:.1f} | {r['step_ms'] / plain['step_ms']:.3f}x "
                         f"| {fastest / plain_fastest:.3f}x | {r['cpu_ms']:.1f} | {r['cpu_ms'] / plain['cpu_ms']:.3f}x "
                         f"| {r['saved_bytes'] / MIB:.2f} | {r['peak_bytes'] / MIB:.2f} |")
        wall, cpu, memory = verdicts(by_label), verdicts(by_label, "cpu_ms"), memory_verdicts(by_label)
        ok &= all(h for _, h in wall + memory)
        for name, held in (("wall", wall), ("CPU", cpu), ("memory", memory)):
            if held:
                checks.append(f"depth {depth} {name}: " + "; ".join(f"{text}: {'PASS' if h else 'MISS'}"
                                                                     for text, h in held))
    lines += ["", f"one-block bound (one block under plain autograd, peak minus param grads): {bound / MIB:.2f} MiB"]
    if "revtorch" not in next(iter(results.values()), {}):
        lines.append("RevTorch not installed (pip install revtorch==0.2.4): compared with checkpointing only")
    return "\n".join(lines + [""] + checks), ok


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with_revtorch = not args.no_revtorch and revtorch_module() is not None
    config = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "threads": torch.get_num_threads(), "torch_version": torch.__version__, "malloc": malloc_settings()}
    if args.host:
        keys = [key for key in HOST_VARIANTS if key[1] != "revtorch" or with_revtorch]
        depth = args.depths[0]
        results = bench_host(args, keys)
        forwards = interleaved_forwards(args.repeats, depth)
        text, ok = host_report(results, args, depth, forwards)
        record = {**config, "depth": depth, "results": {f"{h}/{label}": r for (h, label), r in results.items()},
                  "recompute_forwards": forwards}
    else:
        labels = [label for label in VARIANTS if label != "revtorch" or with_revtorch]
        results = {depth: bench_depth(depth, args, labels) for depth in args.depths}
        bound = one_block_bound(args)
        text, ok = report(results, args, bound)
        record = {**config, "one_block_bound_bytes": bound, "results": {str(d): r for d, r in results.items()}}
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
