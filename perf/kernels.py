"""``python -m perf.kernels``: microbenchmarks of the fused halves' kernels on a GPU.

For each case of the registry (:data:`CASES`; other modules add theirs with :func:`register`)
and each model dim (768 / 1024 / 4096, 8192 tokens, bf16), every operation (forward couple,
inverse couple, backward = recompute with grad + backward) runs as

* ``fused``: revtriton's Triton kernels (ops/fused_mlp.py),
* ``eager``: the same math in PyTorch eager (the reference path, ops/mlp.py),
* ``cublas``: cuBLAS GEMMs (``torch.addmm``) + PyTorch's fused elementwise ops (F.layer_norm,
  F.gelu, ...), i.e. the best unfused composition,

and each fused GEMM alone against ``torch.addmm`` / ``torch.mm`` of the same shape. Reported:
median ms of a call (``do_bench``: host cost included), the device time of the forward ops and
GEMMs replayed from a CUDA graph (``graph``: the kernels alone), the host time a call costs
(``host``, us: calls queued without a sync), TFLOP/s and GB/s (minimum traffic) next to two
ceilings measured in the same run (device-to-device copy bandwidth and a large bf16 matmul),
plus issue 12's bars (fused forward >= 1.3 x eager; each fused GEMM >= 0.9 x cuBLAS) on call
and on device time. The eager path's norms are torch's own kernels on
CUDA since the H200 run (perf/results/h200-2026-12-04/ timed the spelled-out formula).

``--dispatch`` adds, and ``--dispatch-only`` runs alone, the dispatcher's report (issue 19): for
each transformer half and shape (:data:`DISPATCH_SHAPES`, bf16 autocast, exact streams) the
candidate ``revtriton.ops.backend`` chose (measured now or read from its cache), the timings it
chose on, every candidate timed again here (forward + backward) and the chosen one's speed as a
fraction of the faster (bar: >= 0.98); ``--dispatch-only`` exits 1 when a bar is missed.

Results: ``perf/results/<device>-<date>-kernels.json`` and ``.csv`` (``-dispatch.json`` for
``--dispatch-only``). Without a CUDA GPU there is nothing to measure: it says so and exits 0.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DIMS = (768, 1024, 4096)
TOKENS = 8192
BAR_FORWARD_VS_EAGER = 1.3  # issue 12, must-hold 5
BAR_GEMM_VS_CUBLAS = 0.9


@dataclasses.dataclass
class Measurement:
    """One timed callable: ``fn()`` runs the op once; flops / bytes are per call (minimum traffic)."""
    fn: Callable[[], object]
    flops: float
    bytes: float


@dataclasses.dataclass
class BenchCase:
    """A registry entry: ``build(dim, tokens, device)`` -> {(op, impl): Measurement}.

    op names the operation ("forward", "inverse", "backward", "gemm1", ...); impl is "fused",
    "eager" or "cublas". Ratios are taken between impls of the same op.
    """
    name: str
    build: Callable[[int, int, torch.device], dict]
    dims: tuple = DIMS
    tokens: int = TOKENS


CASES: dict[str, BenchCase] = {}


def register(case: BenchCase) -> BenchCase:
    if case.name in CASES:
        raise ValueError(f"benchmark case {case.name!r} registered twice")
    CASES[case.name] = case
    return case


# ---------------------------------------------------------------- the norm+MLP cases

def _mlp_case(kind: str):
    def build(dim, tokens, device):
        from revtriton.ops import fused_mlp, mlp
        from revtriton.ops.streams import couple_output, to_fixed

        dt = torch.bfloat16
        swiglu = kind == "swiglu"
        hidden = (int(8 * dim / 3) + 255) // 256 * 256 if swiglu else 4 * dim
        x = torch.randn(tokens, dim, device=device, dtype=dt)
        res = to_fixed(torch.randn(tokens, dim, device=device), 16)
        gamma = torch.ones(dim, device=device, dtype=dt)
        beta = None if swiglu else torch.zeros(dim, device=device, dtype=dt)
        w1 = torch.randn(hidden, dim, device=device, dtype=dt) * dim ** -0.5
        wu = torch.randn(hidden, dim, device=device, dtype=dt) * dim ** -0.5 if swiglu else None
        b1 = None if swiglu else torch.zeros(hidden, device=device, dtype=dt)
        w2 = torch.randn(dim, hidden, device=device, dtype=dt) * hidden ** -0.5
        b2 = None if swiglu else torch.zeros(dim, device=device, dtype=dt)
        params = [gamma, wu, w1, w2] if swiglu else [gamma, beta, w1, b1, w2, b2]
        n_gemm = 3 if swiglu else 2
        gemm_flops = 2.0 * tokens * dim * hidden
        weight_bytes = 2.0 * n_gemm * dim * hidden
        # forward: read x (bf16) and res (int32), write the stream (int32), read the weights.
        fwd_bytes = tokens * dim * (2 + 4 + 4) + weight_bytes
        # backward: recompute + read the port gradient (fp32), write dx and the weight gradients.
        bwd_bytes = fwd_bytes + tokens * dim * (4 + 2) + weight_bytes

        def fused(sign):
            if swiglu:
                return fused_mlp.fused_swiglu_mlp_couple(res, x, sign, 16, gamma, w1, wu, w2)
            return fused_mlp.fused_norm_mlp_couple(res, x, sign, 16, gamma, beta, w1, b1, w2, b2, norm="layer",
                                                   activation="gelu_tanh")

        def eager_h(xx):
            if swiglu:
                return mlp.swiglu_mlp_reference(xx, gamma, w1, wu, w2)
            return mlp.norm_mlp_reference(xx, gamma, beta, w1, b1, w2, b2, norm="layer", activation="gelu_tanh")

        def cublas_h(xx):
            if swiglu:
                n = F.rms_norm(xx, (dim,), gamma, 1e-6)
                return torch.mm(F.silu(torch.mm(n, w1.t())) * torch.mm(n, wu.t()), w2.t())
            n = F.layer_norm(xx, (dim,), gamma, beta, 1e-6)
            return torch.addmm(b2, F.gelu(torch.addmm(b1, n, w1.t()), approximate="tanh"), w2.t())

        def eager(sign):
            return couple_output(res, eager_h(x), sign, 16)

        def cublas(sign):
            return couple_output(res, cublas_h(x), sign, 16)

        g = torch.randn(tokens, dim, device=device)

        def backward_of(couple):
            def run():
                xx = x.detach().requires_grad_(True)
                for p in params:
                    if p is not None:
                        p.requires_grad_(True)
                _, port = couple(xx)
                torch.autograd.backward(port, g)
                for p in params:
                    if p is not None:
                        p.grad = None
            return run

        def fused_couple_with(xx):
            if swiglu:
                return fused_mlp.fused_swiglu_mlp_couple(res, xx, -1, 16, gamma, w1, wu, w2)
            return fused_mlp.fused_norm_mlp_couple(res, xx, -1, 16, gamma, beta, w1, b1, w2, b2, norm="layer",
                                                   activation="gelu_tanh")

        out = {}
        for op, sign in (("forward", 1), ("inverse", -1)):
            out[(op, "fused")] = Measurement(lambda s=sign: fused(s), n_gemm * gemm_flops, fwd_bytes)
            out[(op, "eager")] = Measurement(lambda s=sign: eager(s), n_gemm * gemm_flops, fwd_bytes)
            out[(op, "cublas")] = Measurement(lambda s=sign: cublas(s), n_gemm * gemm_flops, fwd_bytes)
        bwd_flops = 3 * n_gemm * gemm_flops
        out[("backward", "fused")] = Measurement(backward_of(fused_couple_with), bwd_flops, bwd_bytes)
        out[("backward", "eager")] = Measurement(
            backward_of(lambda xx: couple_output(res, eager_h(xx), -1, 16)), bwd_flops, bwd_bytes)
        out[("backward", "cublas")] = Measurement(
            backward_of(lambda xx: couple_output(res, cublas_h(xx), -1, 16)), bwd_flops, bwd_bytes)

        # The fused GEMMs alone vs cuBLAS on the same shape.
        from revtriton.ops import gemm, norm_rows

        norm = "rms" if swiglu else "layer"
        n, _, _ = norm_rows.normalize(x, norm=norm, norm_weight=gamma, norm_bias=beta, out_dtype=x.dtype)
        act = "swiglu" if swiglu else "gelu_tanh"
        a1, _ = gemm.linear(n, w1, b1, activation=act, weight_up=wu)
        g1_flops = gemm_flops * (2 if swiglu else 1)
        g1_bytes = tokens * (dim + hidden) * 2 + 2.0 * dim * hidden * (2 if swiglu else 1)
        out[("gemm1", "fused")] = Measurement(lambda: gemm.linear(n, w1, b1, activation=act, weight_up=wu),
                                              g1_flops, g1_bytes)
        w1u = torch.cat([w1, wu]) if swiglu else w1
        out[("gemm1", "cublas")] = Measurement(lambda: torch.mm(n, w1u.t()), g1_flops, g1_bytes)
        g2_bytes = tokens * hidden * 2 + tokens * dim * 8 + 2.0 * dim * hidden
        out[("gemm2", "fused")] = Measurement(lambda: gemm.linear_couple(a1, w2, b2, res, 1, frac_bits=16),
                                              gemm_flops, g2_bytes)
        out[("gemm2", "cublas")] = Measurement(lambda: torch.mm(a1, w2.t()), gemm_flops, g2_bytes)
        # A weight gradient (K = tokens): the raw GEMM (split-K when it cannot fill the GPU) vs cuBLAS.
        dz = torch.randn(tokens, hidden, device=x.device, dtype=x.dtype)
        dw_bytes = tokens * (dim + hidden) * 2 + 4.0 * dim * hidden
        out[("dw1", "fused")] = Measurement(lambda: gemm.linear_weight_grad(dz, n), gemm_flops, dw_bytes)
        out[("dw1", "cublas")] = Measurement(lambda: torch.mm(dz.t(), n), gemm_flops, dw_bytes)
        return out

    return build


register(BenchCase("layernorm_mlp_gelu_tanh", _mlp_case("layer")))
register(BenchCase("rmsnorm_swiglu", _mlp_case("swiglu")))


# ---------------------------------------------------------------- timing and ceilings

def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


# Ops whose call is replayed from a CUDA graph too (no autograd inside): the device time alone.
GRAPH_OPS = ("forward", "inverse", "gemm1", "gemm2", "dw1")


def graph_ms(fn) -> float | None:
    """Median device time of ``fn`` replayed from a CUDA graph: no host cost between launches (an
    H200 machine measured 116-227 us of host time a fused GEMM call, perf/results/h200-2026-12-04-tma/).
    None if it cannot be captured."""
    from triton.testing import do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    except Exception as e:  # reported, not fatal: the eager timing still stands
        print(f"  (no CUDA graph: {type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def host_us(fn, calls: int = 50) -> float:
    """Host time per call: ``calls`` calls queued without a sync (the GPU runs behind), then one sync."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    return queued / calls * 1e6


def ceilings(device) -> dict:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul TFLOP/s measured now, on this device."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: torch.mm(a, b))
    return {"copy_GBps": 2 * (1 << 30) / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * n ** 3 / mm_ms / 1e9}


def run(case_names=None, dims=None, device="cuda") -> dict:
    device = torch.device(device)
    roof = ceilings(device)
    rows = []
    for case in CASES.values():
        if case_names and case.name not in case_names:
            continue
        for dim in dims or case.dims:
            measurements = case.build(dim, case.tokens, device)
            times = {}
            graph_times = {}
            for (op, impl), m in measurements.items():
                ms = bench_ms(m.fn)
                times[(op, impl)] = ms
                graph_times[(op, impl)] = graph_ms(m.fn) if op in GRAPH_OPS else None
                rows.append({"case": case.name, "dim": dim, "tokens": case.tokens, "op": op, "impl": impl,
                             "ms": ms, "graph_ms": graph_times[(op, impl)], "host_us": host_us(m.fn),
                             "TFLOPs": m.flops / ms / 1e9, "GBps": m.bytes / ms / 1e6,
                             "frac_of_matmul_ceiling": m.flops / ms / 1e9 / roof["bf16_matmul_TFLOPs"],
                             "frac_of_copy_ceiling": m.bytes / ms / 1e6 / roof["copy_GBps"]})
            for row in rows:
                if row["case"] == case.name and row["dim"] == dim:
                    for ref in ("eager", "cublas"):
                        base = times.get((row["op"], ref))
                        row[f"speedup_vs_{ref}"] = base / row["ms"] if base else None
                        base = graph_times.get((row["op"], ref))
                        row[f"graph_speedup_vs_{ref}"] = (base / row["graph_ms"] if base and row["graph_ms"]
                                                          else None)
            del measurements
            torch.cuda.empty_cache()
    bars = []
    for row in rows:
        if row["impl"] != "fused":
            continue
        # Each bar on call time (what an eager caller pays, host included) and on device time
        # (graph replays: the kernels themselves; a slow host shows in the first alone).
        if row["op"] == "forward":
            bar, ref, limit = f"forward >= {BAR_FORWARD_VS_EAGER} x eager", "eager", BAR_FORWARD_VS_EAGER
        elif row["op"].startswith("gemm") or row["op"] == "dw1":
            bar, ref, limit = f"{row['op']} >= {BAR_GEMM_VS_CUBLAS} x cuBLAS", "cublas", BAR_GEMM_VS_CUBLAS
        else:
            continue
        for timing, value in (("call", row.get(f"speedup_vs_{ref}")), ("device", row.get(f"graph_speedup_vs_{ref}"))):
            if value is not None:
                bars.append({"case": row["case"], "dim": row["dim"], "bar": f"{bar} ({timing} time)", "value": value,
                             "met": value >= limit})
    return {"device": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "ceilings": roof, "rows": rows, "bars": bars}


def tuned_gemm_configs() -> list[dict]:
    """What the GEMM autotuners kept, per tuning key (kernels/gemm.py GEMM_TUNE_KEY, then the
    argument dtypes): which tile, stages and tile walk (persistent or one program a tile) won on
    this GPU. The static model cannot rank persistence; this is where a run says."""
    from revtriton.ops import gemm

    kernels = gemm.gemm_kernels
    tuned = []
    for name in ("fused_gemm_kernel", "fused_gemm_dual_kernel", "fused_gemm_act_grad_kernel"):
        for key, config in getattr(getattr(kernels, name), "cache", {}).items():
            tuned.append({"kernel": name, "key": ", ".join(map(str, key)), "config": {
                **config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}})
    return tuned


def print_tuned(tuned: list[dict]):
    print(f"GEMM configs the autotuners kept ({sum(t['config'].get('PERSISTENT', False) for t in tuned)} of "
          f"{len(tuned)} persistent):")
    for t in tuned:
        c = t["config"]
        print(f"  {t['kernel']:27s} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"
              f"{' persistent' if c.get('PERSISTENT') else ''}  [{t['key']}]")


# ---------------------------------------------------------------- the dispatcher's choice (issue 19)

DISPATCH_SHAPES = ((4, 1024, 768),)  # (batch, tokens, dim)
BAR_CHOICE_VS_FASTEST = 0.98
_OP_OF_HALF = {"LayerNormMLP": "norm_mlp", "RMSNormSwiGLU": "swiglu_mlp", "LayerNormAttention": "norm_attention",
               "RMSNormAttention": "norm_attention"}


def dispatch_halves(dim: int) -> dict:
    from revtriton import LayerNormAttention, LayerNormMLP, RMSNormAttention, RMSNormSwiGLU

    heads = max(1, dim // 64)
    return {"layernorm_mlp": lambda: LayerNormMLP(dim, 4 * dim),
            "rmsnorm_swiglu": lambda: RMSNormSwiGLU(dim, (int(8 * dim / 3) + 255) // 256 * 256),
            "layernorm_attention": lambda: LayerNormAttention(dim, heads),
            "rmsnorm_attention_gqa": lambda: RMSNormAttention(dim, heads, kv_heads=max(1, heads // 4))}


def dispatch_report(shapes=DISPATCH_SHAPES, device="cuda", halves=None, exact: bool = True) -> list[dict]:
    """One row per (half, shape): the dispatcher's choice and timings, every candidate re-timed
    here (forward + backward of one couple under bf16 autocast) and chosen / fastest speed."""
    from revtriton.ops import backend
    from revtriton.ops.streams import to_fixed

    device = torch.device(device)
    rows = []
    for batch, tokens, dim in shapes:
        for name, make in dispatch_halves(dim).items():
            if halves and name not in halves:
                continue
            torch.manual_seed(0)
            half = make().to(device)
            x = torch.randn(batch, tokens, dim, device=device)
            k = 16 if exact else None
            res = to_fixed(torch.randn_like(x), 16) if exact else torch.randn_like(x)
            g = torch.randn_like(x)
            params = list(half.parameters())
            amp = torch.autocast(device.type, dtype=torch.bfloat16)

            def step():
                xx = x.detach().requires_grad_()
                with amp:
                    _, port = half.couple(res, xx, 1, k)
                torch.autograd.grad(port, [xx, *params], g)

            step()  # the first call chooses (measures, or reads the cache); pinned from here on
            with amp:
                args, options = half.operands(x)
                decision = backend.decision(_OP_OF_HALF[type(half).__name__], res, x, 1, k, *args, **options) or {}
            bench = {}
            for cand in decision.get("times_ms") or {}:
                with backend.use_backend(cand):
                    bench[cand] = bench_ms(step)
            ratio = min(bench.values()) / bench[decision["choice"]] if bench else None
            rows.append({"half": name, "batch": batch, "tokens": tokens, "dim": dim,
                         "op": decision.get("op"), "key": decision.get("key"), "choice": decision.get("choice"),
                         "source": decision.get("source"), "dispatch_ms": decision.get("times_ms"),
                         "excluded": decision.get("excluded"), "bench_ms": bench, "chosen_vs_fastest": ratio,
                         "met": ratio is None or ratio >= BAR_CHOICE_VS_FASTEST})
            torch.cuda.empty_cache()
    return rows


def print_dispatch(rows):
    print(f"dispatch (bar: chosen >= {BAR_CHOICE_VS_FASTEST} x the faster, forward + backward):")
    for r in rows:
        timings = ", ".join(f"{c} {ms:.3f}" for c, ms in (r["bench_ms"] or {}).items()) or "-"
        ratio = f"{r['chosen_vs_fastest']:.3f}" if r["chosen_vs_fastest"] is not None else "-"
        print(f"  {r['half']:24s} {r['batch']}x{r['tokens']}x{r['dim']}: {r['choice']} ({r['source']}); "
              f"dispatcher ms {r['dispatch_ms']}; re-timed ms {timings}; chosen/fastest {ratio} "
              f"{'met' if r['met'] else 'NOT met'}")


def write_results(result: dict, out_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    device = re.sub(r"[^A-Za-z0-9]+", "-", result["device"]).strip("-").lower()
    stem = out_dir / f"{device}-{result['date']}-kernels"
    json_path, csv_path = stem.with_suffix(".json"), stem.with_suffix(".csv")
    json_path.write_text(json.dumps(result, indent=1))
    with csv_path.open("w", newline="") as f:
        fields = sorted({k for row in result["rows"] for k in row}, key=lambda k: (k not in (
            "case", "dim", "tokens", "op", "impl"), k))
        writer = csv.DictWriter(f, fieldnames=["device"] + fields)
        writer.writeheader()
        for row in result["rows"]:
            writer.writerow({"device": result["device"], **row})
    return json_path, csv_path


def print_table(result: dict):
    roof = result["ceilings"]
    print(f"{result['device']}: copy {roof['copy_GBps']:.0f} GB/s, bf16 matmul {roof['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print("ms: a call (do_bench); graph: replayed from a CUDA graph (device time); host: host us a call")
    print(f"{'case':26s} {'dim':>5s} {'op':9s} {'impl':7s} {'ms':>8s} {'graph':>7s} {'host':>6s} {'TFLOP/s':>8s}"
          f" {'GB/s':>7s} {'vs eager':>8s} {'vs cuBLAS':>9s} {'graph vs cuBLAS':>15s}")

    def fmt(value, spec):
        return format(value, spec) if value else "-"

    for r in result["rows"]:
        print(f"{r['case']:26s} {r['dim']:5d} {r['op']:9s} {r['impl']:7s} {r['ms']:8.3f} "
              f"{fmt(r.get('graph_ms'), '.3f'):>7s} {fmt(r.get('host_us'), '.0f'):>6s} {r['TFLOPs']:8.1f} "
              f"{r['GBps']:7.0f} {fmt(r.get('speedup_vs_eager'), '.2f'):>8s} {fmt(r.get('speedup_vs_cublas'), '.2f'):>9s}"
              f" {fmt(r.get('graph_speedup_vs_cublas'), '.2f'):>15s}")
    for b in result["bars"]:
        print(f"bar {b['case']} d{b['dim']}: {b['bar']}: {b['value']:.2f} {'met' if b['met'] else 'NOT met'}")
    if result.get("dispatch"):
        print_dispatch(result["dispatch"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="fused-half kernel microbenchmarks (GPU)")
    parser.add_argument("--cases", nargs="*", default=None, help=f"subset of {sorted(CASES)}")
    parser.add_argument("--dims", nargs="*", type=int, default=None, help="model widths (default: each case's own)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"results folder (default {RESULTS_DIR})")
    parser.add_argument("--dispatch", action="store_true", help="add the dispatcher's choices (issue 19)")
    parser.add_argument("--dispatch-only", action="store_true",
                        help="only the dispatcher's choices; exit 1 if a chosen path is < 0.98 x the faster")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("perf.kernels measures Triton kernels on a CUDA GPU; none is available here, so there is nothing to "
              "measure (exit 0). Run it on a GPU machine.")
        return 0
    if args.dispatch_only:
        rows = dispatch_report()
        print_dispatch(rows)
        args.out.mkdir(parents=True, exist_ok=True)
        device = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-").lower()
        path = args.out / f"{device}-{datetime.date.today().isoformat()}-dispatch.json"
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "rows": rows}, indent=1))
        print(f"wrote {path}")
        return 0 if all(r["met"] for r in rows) else 1
    result = run(args.cases, args.dims)
    result["tuned_gemm_configs"] = tuned_gemm_configs()
    if args.dispatch:
        result["dispatch"] = dispatch_report()
    print_table(result)
    print_tuned(result["tuned_gemm_configs"])
    paths = write_results(result, args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
