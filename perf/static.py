"""Static GPU performance model: ``python -m perf.static`` (CPU only, no GPU needed).

For every launch the fused halves make at the production shapes (perf/workloads.py), and every
autotune config the arch would try, compile the specialisation a real launch builds for sm_90
and sm_80 (revtriton/aot.py), read it (revtriton/sass.py), and judge it:

    rule                 what must hold (per compiled kernel x config)
    compiles             triton.compile + ptxas succeed
    registers            <= 232 registers a thread
    no_spill             no local memory, no stack frame
    shared_memory        <= 227 KiB (sm_90), <= 163 KiB (sm_80)
    pipelined            every dot loop loads its tiles asynchronously (cp.async / TMA), none synchronously
    wgmma_overlap        sm_90 GEMMs: some warpgroup-MMA wait leaves >= 1 MMA in flight (pendings >= 1)
    no_mma_sync          sm_90: every dot is a wgmma (no fallback to mma.sync)
    no_warp_replication  warps along M x 16 <= the rows of each dot's tile
    issue_ratio          sm_90: issue-model ratio <= 0.8 (GEMMs: every main loop; attention: the
                         steady-state loop, i.e. the cheapest of its main loops; the attention
                         forward against the tutorial-06 anchor at its head dim instead)

Each result also gets a predicted time per launch on H100 / H200 (:func:`kernel_efficiency`): the
launch's FLOPs at the efficiency perf.roofline assumes for cuBLAS / FlashAttention-2, lowered by
the ratio above its bar, by un-pipelined loads and by wave quantisation, against its bytes at HBM
bandwidth, plus the launch cost; the config the model ranks fastest is the one the autotuner is
assumed to keep. Output: a table on stdout; with
``--write``, perf/results/static-<triton version>.md and .json. ``--json`` prints everything as
JSON (tests read it). It is a model: a GPU measurement, when one is lent, replaces it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

from revtriton import aot

from . import roofline, workloads

RULES = ("compiles", "registers", "no_spill", "shared_memory", "pipelined", "wgmma_overlap", "no_mma_sync",
         "no_warp_replication", "issue_ratio")
MAX_ISSUE_RATIO = 0.8
GEMM_KERNELS = ("fused_gemm_kernel", "qkv_rope_gemm_kernel", "anchor_matmul_kernel")
ATTENTION_KERNELS = ("attention_fwd_kernel", "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel",
                     "anchor_attention_fwd_kernel")


GPUS = (roofline.H100, roofline.H200)  # sm_90: the arch whose compilation the issue model reads
# Kernel names of the fused path's Triton launches in perf.roofline's op lists (the other ops there
# are torch-side: weight casts, the engine's passes, small reductions).
TRITON_OPS = {"normalize", "gemm1_act", "gemm1_swiglu", "gemm2_couple", "scale_grad", "dh_act_bwd", "dw2", "dw1",
              "dn_input_grad", "norm_bwd", "reduce_partials", "qkv_rope_gemm", "attention_fwd", "proj_couple",
              "do_input_grad", "dw_proj", "attention_bwd_dq", "attention_bwd_dkdv", "dn_qkv_input_grad", "dw_qkv",
              "db_qkv_col_sums"}


def kernel_kind(kernel_name: str) -> str:
    if kernel_name in GEMM_KERNELS:
        return "gemm"
    if kernel_name in ATTENTION_KERNELS:
        return "attention"
    return "row"


# ---------------------------------------------------------------- collecting the compile jobs

_NON_FLAGS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "BLOCK_FIXED", "BLOCK_STREAM", "DOT_DTYPE", "INPUT_PRECISION",
              "A_K_MAJOR", "B_K_MAJOR",
              "DOT_PRECISION"}


def variant_label(job: aot.CompileJob, fn) -> str:
    """kernel[switches]<pointer dtypes>(unit strides){integer args not divisible by 16}/tile w warps
    s stages (r register cap)@sm arch: what tells two compiled specialisations apart, readably."""
    flags = []
    for name in fn.arg_names:
        if job.signature.get(name) != "constexpr" or name in _NON_FLAGS or name.startswith("stride"):
            continue
        value = job.constexprs.get((fn.arg_names.index(name),))
        if value is None or value is False or value == 0:
            continue
        flags.append(name if value is True else f"{name}={value}")
    odd = [name for i, name in enumerate(fn.arg_names)
           if job.signature.get(name) == "i32" and not name.startswith("stride") and job.attrs.get((i,)) == []]
    operands = [job.signature[n][1:] for n in fn.arg_names if job.signature.get(n, "").startswith("*")][:4]
    unit = [n[len("stride_"):] for n in fn.arg_names if n.startswith("stride") and job.signature.get(n) == "constexpr"]
    cfg = job.config
    tile = "x".join(str(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_FIXED", "BLOCK_STREAM") if k in cfg)
    return (f"{fn.__name__}[{','.join(flags)}]<{','.join(operands)}>({','.join(unit)})" +
            (f"{{{','.join(odd)}}}" if odd else "") +
            f"/{tile}w{cfg['num_warps']}s{cfg['num_stages']}" + (f"r{cfg['maxnreg']}" if "maxnreg" in cfg else "")
            + f"@sm{job.arch}")


def output_tiles(launch, config) -> int:
    """The launch's work items: its programs, or for a persistent GEMM config (one program per SM,
    each walking several tiles) the output tiles its programs walk, which is what waves count."""
    return math.prod(launch.grid_size(dict(config.kwargs, PERSISTENT=False) if config.kwargs.get("PERSISTENT")
                                      else config.kwargs))


def library_jobs(models=None):
    """(row, job, fn) for every launch x arch x config of the library at the given models."""
    for m, half, exact, phase, index, launch in workloads.all_launches(models):
        fn = aot.jit_function(launch.kernel)
        for arch in aot.ARCHS:
            for config in aot.configs_for_arch(launch, arch):
                job = aot.compile_job(launch, config, arch)
                row = {"model": m.name, "half": half, "mode": "exact" if exact else "float", "phase": phase,
                       "index": index, "kernel": fn.__name__, "caller": launch.caller, "arch": arch, "key": job.key,
                       "head_dim": m.head_dim,
                       "label": variant_label(job, fn), "tiles": output_tiles(launch, config),
                       "flops": launch_flops(m, launch), "bytes": launch_bytes(launch)}
                yield row, job, fn


def anchor_jobs():
    from . import anchors

    for name, launch, config in anchors.anchor_launches():
        job = aot.compile_job(launch, config, 90)
        yield {"model": "anchor", "anchor": name, "kernel": aot.jit_function(launch.kernel).__name__, "arch": 90,
               "key": job.key, "label": name, "tiles": math.prod(launch.grid_size(config.kwargs)),
               "flops": 0, "bytes": 0}, job, aot.jit_function(launch.kernel)


def collect():
    """Every (job, fn) to compile: the library's launches and the calibration anchors."""
    for _, job, fn in list(library_jobs()) + list(anchor_jobs()):
        yield job, fn


def fp32_collect():
    """(job, fn) of the attention kernels and GEMMs at fp32 operands (perf.workloads.FP32_MODELS), float streams."""
    for row, job, fn in library_jobs(workloads.FP32_MODELS):
        if row["mode"] == "float" and row["kernel"] in ATTENTION_KERNELS + ("qkv_rope_gemm_kernel", "fused_gemm_kernel"):
            yield job, fn


def fp32_fit(workers: int | None = None) -> list[dict]:
    """Each attention kernel and GEMM x config x arch the autotuner can pick for fp32 operands: its
    shared memory against the arch's limit (an H200 refused 448 KiB for the bf16 attention tiles at fp32)."""
    results = aot.analyze_all(fp32_collect, workers)
    return [{"kernel": r["kernel"], "arch": r["arch"], "config": r["config"], "error": r["error"],
             "shared": r.get("shared"), "limit": aot.MAX_SHARED[r["arch"]]} for r in results.values()]


# ---------------------------------------------------------------- per-launch work

def launch_flops(m: workloads.Model, launch: aot.Launch) -> float:
    """Tensor-core FLOPs the launch executes (0 for row kernels)."""
    name, args = launch.kernel_name, launch.named_args()
    if name == "fused_gemm_kernel":
        meta = launch.meta
        return 2.0 * args["M"] * args["N"] * args["K"] * (2 if meta.get("DUAL_B") else 1) * (
            2 if meta.get("SECOND_K") else 1)
    if name == "qkv_rope_gemm_kernel":
        return 2.0 * args["M"] * args["N"] * args["K"]
    pairs = m.batch * m.heads * m.seq * m.seq * (0.5 if m.causal else 1.0)
    if name == "attention_fwd_kernel":
        return 4.0 * pairs * m.head_dim  # QK^T and PV
    if name == "attention_bwd_dq_kernel":
        return 6.0 * pairs * m.head_dim  # QK^T, dP, dQ
    if name == "attention_bwd_dkdv_kernel":
        return 8.0 * pairs * m.head_dim  # QK^T, dV, dP, dK
    return 0.0


def launch_bytes(launch: aot.Launch) -> float:
    """Bytes of every tensor argument, each read or written once (a per-launch minimum)."""
    import torch

    seen, total = set(), 0
    for arg in launch.args:  # a tensor passed twice (an unused-pointer placeholder) counts once
        if isinstance(arg, torch.Tensor) and arg.numel() > 1 and id(arg) not in seen:
            seen.add(id(arg))
            total += arg.numel() * arg.element_size()
    return float(total)


# ---------------------------------------------------------------- gates

def judged_ratio(result: dict) -> float | None:
    """The issue-model ratio a kernel is judged by (None: no tensor main loop)."""
    ratios = [loop["ratio"] for loop in result.get("loops") or []]
    if not ratios:
        return None
    return min(ratios) if kernel_kind(result["kernel"]) == "attention" else max(ratios)


def anchor_ratios(rows: list, results: dict) -> dict:
    """{head dim: issue ratio} of the tutorial-06-class attention forward anchors (128 x 128 tiles)."""
    out = {}
    for row in rows:
        m = re.match(r"tutorial06_attention_fwd/d(\d+)/128x128", row.get("anchor", ""))
        if m and not results[row["key"]].get("error"):
            out[int(m.group(1))] = judged_ratio(results[row["key"]])
    return out


def ratio_limit(kernel: str, head_dim: int | None, anchors: dict) -> float:
    """The issue-ratio gate: MAX_ISSUE_RATIO, except the attention forward, whose two dependent
    dots and softmax make the public anchor at the same head dim the bar (0.52 at 128, ~1.03 at 64)."""
    if kernel == "attention_fwd_kernel" and head_dim in anchors:
        return anchors[head_dim]
    return MAX_ISSUE_RATIO


def gate(result: dict, limit: float = MAX_ISSUE_RATIO) -> dict:
    """{rule: None (holds / not applicable) or 'why it fails, with the number'}; ``limit`` is the
    issue-ratio bar for this kernel (:func:`ratio_limit`)."""
    if result.get("error"):
        return {**{r: None for r in RULES}, "compiles": result["error"].splitlines()[0][:200]}
    arch, kind = result["arch"], kernel_kind(result["kernel"])
    out = {r: None for r in RULES}
    if result["registers"] > aot.MAX_REGISTERS[arch]:
        out["registers"] = f"{result['registers']} registers > {aot.MAX_REGISTERS[arch]}"
    if result["local"] or result["stack"]:
        out["no_spill"] = f"local {result['local']} B, stack {result['stack']} B"
    if result["shared"] > aot.MAX_SHARED[arch]:
        out["shared_memory"] = f"{result['shared'] // 1024} KiB shared > {aot.MAX_SHARED[arch] // 1024}"
    if kind == "row":
        return out
    ttgir = result["ttgir"]
    bad_loops = [loop for loop in ttgir["dot_loops"] if not (loop["async_loads"] > 0 and loop["sync_tile_loads"] == 0)]
    if bad_loops or not ttgir["dot_loops"]:
        out["pipelined"] = ("no dot loop found" if not ttgir["dot_loops"] else
                            "; ".join(f"{loop['sync_tile_loads']} synchronous tile loads, {loop['async_loads']} async"
                                      for loop in bad_loops))
    replicated = [d for d in ttgir["dots"] if d["mma_version"] in (2, 3) and d["warps_m"] * 16 > d["rows"]]
    if replicated:
        d = replicated[0]
        out["no_warp_replication"] = f"{len(replicated)} dots, e.g. warps_m {d['warps_m']} x 16 > {d['rows']} rows"
    if arch >= 90:
        if result["mma_sync"] or any(d["mma_version"] == 2 for d in ttgir["dots"]):
            out["no_mma_sync"] = f"{sum(d['mma_version'] == 2 for d in ttgir['dots'])} dots on mma.sync"
        if kind == "gemm" and not any(p >= 1 for p in ttgir["wait_pendings"]):
            out["wgmma_overlap"] = f"wgmma waits pendings {sorted(set(ttgir['wait_pendings']))}"
        ratio = judged_ratio(result)
        if ratio is None:
            out["issue_ratio"] = "no tensor-core main loop found in the SASS"
        elif ratio > limit:
            out["issue_ratio"] = f"ratio {ratio:.2f} > {limit:.2f}"
    return out


# ---------------------------------------------------------------- prediction

# Efficiency of a kernel that passes the gates: the roofline's cuBLAS / FA2-class assumptions
# (perf.roofline.Efficiency), so a fused kernel that is "as good as the anchors" is predicted as
# fast as the library path. What the static model sees lowers it:
#   GEMM loop ratio r > MAX_ISSUE_RATIO: x MAX_ISSUE_RATIO / r (issue-bound: instructions, not
#   tensor cores, set the pace); attention: x anchor ratio / r, the anchor being the tutorial-06
#   forward at the same head dim (0.52 at 128, 1.03 at 64; backward passes against MAX_ISSUE_RATIO);
#   a loop whose tiles are loaded synchronously (not pipelined): x UNPIPELINED (load latency is
#   not hidden; an assumption, to be replaced by a GPU measurement);
#   wave quantisation: x tiles / (ceil(tiles / SMs) x SMs).
UNPIPELINED = 0.6
# Measured (one H200, 2026-12-04, perf/results/h200-2026-12-04-tma/: device time, CUDA-graph
# replays): the TMA GEMMs that pass every gate ran at 0.63-0.90x cuBLAS on the same shapes (GEMM1,
# GEMM2, dW1 of both MLP halves, 768 / 1024 / 4096 wide, 8192 tokens), lower the less work a launch
# has: a fixed cost per launch that cuBLAS hides (pipeline fill and an epilogue that no other tile
# overlaps). Fitted to those 18 points: FUSED_GEMM_VS_CUBLAS * flops / (flops + FUSED_GEMM_FIXED_FLOP)
# (rms error 0.06; a constant 0.77 fits with 0.09). The gates are necessary, not sufficient. The
# flash attention kernels measured 0.95-1.35x SDPA's flash backend (head dims 64, 80, 128): no such
# factor for them.
FUSED_GEMM_VS_CUBLAS = 0.86
FUSED_GEMM_FIXED_FLOP = 8.0e9


def kernel_efficiency(row: dict, result: dict, gpu, anchors: dict) -> float:
    """Predicted fraction of dense tensor peak for one launch with one config."""
    base = roofline.default_efficiency(gpu)
    kind = kernel_kind(result["kernel"])
    ratio = judged_ratio(result) or float("inf")
    if kind == "attention" and result["kernel"].startswith("attention_fwd"):
        eff = base.attention_fwd * min(1.0, anchors.get(row.get("head_dim"), MAX_ISSUE_RATIO) / ratio)
    elif kind == "attention":
        eff = base.attention_bwd * min(1.0, MAX_ISSUE_RATIO / ratio)
    else:
        flops = row.get("flops") or 0.0
        eff = (base.gemm * FUSED_GEMM_VS_CUBLAS * flops / (flops + FUSED_GEMM_FIXED_FLOP)
               * min(1.0, MAX_ISSUE_RATIO / ratio))
    if any(loop["async_loads"] == 0 or loop["sync_tile_loads"] for loop in result["ttgir"]["dot_loops"]):
        eff *= UNPIPELINED
    waves = math.ceil(row["tiles"] / gpu.sms)
    return eff * row["tiles"] / (waves * gpu.sms)


def predict_us(row: dict, result: dict, gpu, anchors: dict) -> float | None:
    """Predicted time of one launch with one config (None when it did not compile)."""
    if result.get("error"):
        return None
    base = roofline.default_efficiency(gpu)
    memory = row["bytes"] / (gpu.bandwidth * base.memory)
    compute = row["flops"] / (gpu.peak_flops * kernel_efficiency(row, result, gpu, anchors)) if row["flops"] else 0.0
    return (max(memory, compute) + base.launch_overhead_s) * 1e6


def best_configs(rows: list, results: dict, gpu, anchors: dict) -> dict:
    """{(model, half, mode, phase, index): (row, predicted us)} with the config the model ranks fastest
    (the one the autotuner is assumed to keep)."""
    best = {}
    for row in rows:
        if row["arch"] != 90 or row["model"] == "anchor":
            continue
        t = predict_us(row, results[row["key"]], gpu, anchors)
        k = (row["model"], row["half"], row["mode"], row["phase"], row["index"])
        if t is not None and (k not in best or t < best[k][1]):
            best[k] = (row, t)
    return best


def roofline_shape(m: workloads.Model):
    return roofline.Shape(m.name, m.dim, m.hidden, m.heads, m.kv_heads, m.head_dim, m.batch, m.seq, m.causal,
                          m.norm, m.activation, m.norm == "layer", m.rope)


def predictions(rows: list, results: dict, anchors: dict) -> list:
    """Per production model, half, mode and phase, per GPU: fused (the static model's kernel times
    plus the roofline's torch-side ops of the fused path) vs unfused (perf.roofline's eager path)."""
    out = []
    for gpu in GPUS:
        kernel_us = {}
        for (model, half, mode, phase, _), (row, t) in best_configs(rows, results, gpu, anchors).items():
            kernel_us.setdefault((model, half, mode, phase), []).append(t)
        for (model, half, mode, phase), times in sorted(kernel_us.items()):
            m = workloads.MODELS[model]
            if not m.production:
                continue
            shape, exact = roofline_shape(m), mode == "exact"
            fused_ops = roofline.half_ops(shape, half, phase, "fused", exact=exact)
            torch_side = [op for op in fused_ops if op.name not in TRITON_OPS]
            if len(fused_ops) - len(torch_side) != len(times):
                raise RuntimeError(f"{model} {half} {phase}: perf.roofline lists {len(fused_ops) - len(torch_side)} "
                                   f"Triton launches, the library made {len(times)}")
            fused = sum(times) + roofline.phase_time(torch_side, gpu) * 1e6
            unfused = roofline.phase_time(roofline.half_ops(shape, half, phase, "unfused", exact=exact), gpu) * 1e6
            out.append({"gpu": gpu.name, "model": model, "half": half, "mode": mode, "phase": phase,
                        "kernels_us": sum(times), "fused_us": fused, "unfused_us": unfused,
                        "speedup": unfused / fused})
    return out


def attention_against_fa2(rows: list, results: dict, anchors: dict) -> list:
    """Per GPU, production model and phase: the attention core's predicted time (forward: one
    launch; backward: the dq and dk/dv passes) over its FlashAttention-2-class roofline time (the
    same FLOPs at the roofline's FA2 efficiency, its bytes at HBM bandwidth, plus launch costs)."""
    out = []
    for gpu in GPUS:
        base = roofline.default_efficiency(gpu)
        sums = {}
        for (model, half, mode, phase, _), (row, t) in best_configs(rows, results, gpu, anchors).items():
            if kernel_kind(row["kernel"]) != "attention" or mode != "exact" or phase == "recompute":
                continue
            if not workloads.MODELS[model].production:
                continue
            eff = base.attention_fwd if phase == "forward" else base.attention_bwd
            fa2 = (max(row["bytes"] / (gpu.bandwidth * base.memory), row["flops"] / (gpu.peak_flops * eff))
                   + base.launch_overhead_s) * 1e6
            predicted, bound = sums.get((model, phase), (0.0, 0.0))
            sums[(model, phase)] = (predicted + t, bound + fa2)
        for (model, phase), (predicted, bound) in sorted(sums.items()):
            out.append({"gpu": gpu.name, "model": model, "head_dim": workloads.MODELS[model].head_dim,
                        "phase": phase, "predicted_us": predicted, "fa2_us": bound, "ratio": predicted / bound})
    return out


def format_attention(report: dict) -> str:
    lines = [f"{'gpu':9s} {'model':10s} {'head dim':>8s} {'phase':9s} {'predicted':>9s} {'FA2-class':>9s} "
             f"{'ratio':>6s}"]
    for a in report["attention_vs_fa2"]:
        lines.append(f"{a['gpu']:9s} {a['model']:10s} {a['head_dim']:8d} {a['phase']:9s} {a['predicted_us']:9.1f} "
                     f"{a['fa2_us']:9.1f} {a['ratio']:5.2f}x")
    return "\n".join(lines)


# ---------------------------------------------------------------- the run

def build(workers: int | None = None) -> dict:
    """Compile and judge everything; returns a JSON-able report."""
    import triton

    start = time.time()
    rows = [row for row, _, _ in library_jobs()] + [row for row, _, _ in anchor_jobs()]
    results = aot.analyze_all(collect, workers)
    anchors = anchor_ratios(rows, results)
    head_dims = {row["key"]: row.get("head_dim") for row in rows}
    gates = {key: gate(r, ratio_limit(r["kernel"], head_dims.get(key), anchors)) for key, r in results.items()}
    return {"triton": triton.__version__, "seconds": round(time.time() - start, 1), "rules": list(RULES),
            "max_issue_ratio": MAX_ISSUE_RATIO, "launches": rows, "results": results, "gates": gates,
            "anchors": {str(k): v for k, v in anchors.items()}, "predicted": predictions(rows, results, anchors),
            "attention_vs_fa2": attention_against_fa2(rows, results, anchors)}


def variants(report: dict) -> dict:
    """{label: key} of every distinct compiled library kernel (first label wins for shared keys)."""
    out = {}
    for row in report["launches"]:
        if row["model"] != "anchor":
            out.setdefault(row["label"], row["key"])
    return out


def failures(report: dict, rule: str) -> dict:
    """{label: why} of the library's compiled kernels that break ``rule``."""
    return {label: report["gates"][key][rule] for label, key in variants(report).items()
            if report["gates"][key][rule] is not None}


# Which issue rebuilds which kernels (named in the tables and the tests' xfail reasons).
OWNERS = ((r"^attention_.*SEGMENTS",
           "packed rows (a coverage layout: the forward and the one-loop dk/dv pass mask every block; perf/README)"),
          (r"^attention_", "issue 18 (attention rebuild)"),
          (r"^(fused_gemm_kernel|qkv_rope_gemm_kernel|normalize|scale_rows|norm_bwd|sum_partials)",
           "issue 12 (GEMM path)"))


def owner(label: str) -> str:
    return next((who for pattern, who in OWNERS if re.search(pattern, label)), "unowned")


def summary(report: dict) -> dict:
    """What perf/results/static-<triton>.json keeps: per compiled variant its numbers and broken
    rules, the failures per rule (the baseline tests/test_static.py compares a fresh run with),
    the anchors and the predictions."""
    kernels = {}
    for label, key in variants(report).items():
        r = report["results"][key]
        kernels[label] = {"error": r.get("error")} if r.get("error") else {
            "registers": r["registers"], "stack": r["stack"], "local": r["local"], "shared": r["shared"],
            "occupancy": r["occupancy"], "ratios": [round(loop["ratio"], 3) for loop in r["loops"]],
            "broken": {rule: why for rule, why in report["gates"][key].items() if why}}
    return {"triton": report["triton"], "rules": report["rules"], "anchors": report["anchors"],
            "failures": {rule: failures(report, rule) for rule in RULES}, "kernels": kernels,
            "predicted": report["predicted"], "attention_vs_fa2": report["attention_vs_fa2"]}


def format_kernels(report: dict) -> str:
    lines = [f"{'kernel variant':88s} {'REG':>4s} {'SMEM':>5s} {'occ':>3s} {'loops: instr / ratio':>22s}  broken rules"]
    for label, key in sorted(variants(report).items()):
        r = report["results"][key]
        if r.get("error"):
            lines.append(f"{label:88s} ERROR {r['error'].splitlines()[0][:80]}")
            continue
        loops = " ".join(f"{loop['instructions']}/{loop['ratio']:.2f}" for loop in r["loops"]) or "-"
        broken = ", ".join(rule for rule, why in report["gates"][key].items() if why)
        lines.append(f"{label:88s} {r['registers']:4d} {r['shared'] // 1024:4d}K {r['occupancy']:3d} {loops:>22s}  "
                     f"{broken}")
    return "\n".join(lines)


def format_anchors(report: dict) -> str:
    lines = []
    for row in report["launches"]:
        if row["model"] == "anchor":
            r = report["results"][row["key"]]
            lines.append(f"{row['anchor']:48s} ratio {judged_ratio(r) or float('nan'):.2f}  reg {r.get('registers')}")
    return "\n".join(lines)


def format_halves(report: dict) -> str:
    """Predicted us per half and phase, fused vs the eager PyTorch path, and the speed-up."""
    lines = [f"{'gpu':9s} {'model':10s} {'half':9s} {'mode':5s} {'phase':9s} {'kernels':>9s} {'fused':>9s} "
             f"{'eager':>9s} {'speed-up':>8s}"]
    for p in report["predicted"]:
        lines.append(f"{p['gpu']:9s} {p['model']:10s} {p['half']:9s} {p['mode']:5s} {p['phase']:9s} "
                     f"{p['kernels_us']:9.1f} {p['fused_us']:9.1f} {p['unfused_us']:9.1f} {p['speedup']:7.2f}x")
    return "\n".join(lines)


def family(label: str) -> str:
    """A variant label without its config: kernel[switches]<dtypes>(unit strides){odd ints}."""
    return label.split("/")[0]


def format_summary(report: dict) -> str:
    """Per rule: how many compiled variants break it, by kernel family, with the issue that owns them."""
    total = len(variants(report))
    lines = [f"{total} compiled kernel variants (library, sm_90 + sm_80), triton {report['triton']}"]
    for rule in RULES:
        broken = failures(report, rule)
        lines.append(f"  {rule:20s} broken by {len(broken):3d} / {total}")
        by_family = {}
        for label, why in sorted(broken.items()):
            by_family.setdefault((family(label), label.rsplit("@", 1)[1]), []).append(f"{label.split('/')[1]}: {why}")
        for (fam, arch), whys in sorted(by_family.items()):
            lines.append(f"      {arch} {fam}  [{owner(fam)}]")
            lines.extend(f"          {w}" for w in whys)
    return "\n".join(lines)


def format_launches(report: dict, gpu=roofline.H100, mode: str = "exact") -> str:
    """Every launch of the production halves with the config the model ranks fastest on ``gpu``:
    tiles, waves on its SMs, the judged ratio and the predicted time."""
    anchors = {int(k): v for k, v in report["anchors"].items()}
    lines = [f"{'model':10s} {'half':9s} {'phase':9s} {'launch':20s} {'kernel variant (config)':44s} {'tiles':>6s} "
             f"{'waves':>5s} {'w.eff':>5s} {'ratio':>5s} {'TFLOP/s':>7s} {'us':>8s}"]
    best = best_configs(report["launches"], report["results"], gpu, anchors)
    for (model, half, m, phase, index), (row, t) in sorted(best.items(), key=lambda kv: (
            kv[0][0], kv[0][1], workloads.PHASES.index(kv[0][3]), kv[0][4])):
        if m != mode or not workloads.MODELS[model].production:
            continue
        waves = math.ceil(row["tiles"] / gpu.sms)
        ratio = judged_ratio(report["results"][row["key"]])
        tflops = row["flops"] / (t * 1e-6) / 1e12 if row["flops"] else 0.0
        lines.append(f"{model:10s} {half:9s} {phase:9s} {row['caller'][:20]:20s} "
                     f"{row['kernel'][:-7] + '/' + row['label'].split('/')[1].split('@')[0]:44s} {row['tiles']:6d} "
                     f"{waves:5d} {row['tiles'] / (waves * gpu.sms):5.2f} "
                     f"{(f'{ratio:.2f}' if ratio is not None else '-'):>5s} {tflops:7.0f} {t:8.1f}")
    return "\n".join(lines)


def to_markdown(report: dict) -> str:
    return "\n\n".join([
        f"# Static GPU performance model (triton {report['triton']})",
        "Generated by `python -m perf.static --write` on a CPU (no GPU): compiled for sm_90 / sm_80 as a real "
        "launch at the production shapes would compile, read from TTGIR and SASS. Predictions, not measurements.",
        "## Gates\n\n```\n" + format_summary(report) + "\n```",
        "## Calibration anchors (sm_90 issue-model ratio)\n\n```\n" + format_anchors(report) + "\n```",
        "## Predicted time per half and phase (sum of launches, best config each)\n\n```\n" + format_halves(report)
        + "\n```",
        "## Attention core against FlashAttention-2-class time (predicted over the same FLOPs at the roofline's "
        "FA2 efficiency; forward: one launch, backward: dq + dk/dv passes)\n\n```\n" + format_attention(report)
        + "\n```",
        "## Roofline per half and phase (perf.roofline: FLOPs, minimum bytes, bound and estimate; exact "
        "streams; the production shapes)\n\n"
        + roofline.markdown(roofline.table([roofline_shape(m) for m in workloads.PRODUCTION])),
        "## Launches at the production shapes (H100, exact streams, the config the model ranks fastest)\n\n"
        "```\n" + format_launches(report) + "\n```",
        "## Every compiled kernel variant\n\n```\n" + format_kernels(report) + "\n```",
    ]) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--write", action="store_true", help="write perf/results/static-<triton>.md and .json")
    parser.add_argument("--workers", type=int, default=None, help="compile processes (default: all cores)")
    parser.add_argument("--fp32-fit", action="store_true",
                        help="only the attention kernels' and GEMMs' fp32 configs: shared memory per arch (with --json: JSON)")
    args = parser.parse_args(argv)
    if args.fp32_fit:
        rows = fp32_fit(args.workers)
        if args.json:
            print(json.dumps(rows))
        for r in [] if args.json else sorted(rows, key=lambda r: (r["kernel"], r["arch"])):
            print(f"{r['kernel']:28s} sm_{r['arch']} {r['config']}: "
                  + (r["error"] or f"{r['shared'] // 1024} KiB shared of {r['limit'] // 1024}"))
        return 0
    report = build(args.workers)
    if args.json:
        print(json.dumps(report))
        return 0
    print(format_summary(report))
    print(format_anchors(report))
    print(format_halves(report))
    if args.write:
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"static-{report['triton']}")
        with open(out + ".md", "w") as f:
            f.write(to_markdown(report))
        with open(out + ".json", "w") as f:
            json.dump(summary(report), f, indent=1, sort_keys=True)
        print(f"wrote {out}.md and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
