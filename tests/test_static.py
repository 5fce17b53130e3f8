"""Static GPU performance model gates (perf/static.py), compiled for sm_90 / sm_80 on the CPU.

Every launch the fused halves make at the production shapes (perf/workloads.py) is compiled the
way a real launch would specialise it, for every autotune config of each arch, and judged by the
rules in perf/static.py (RULES). One subprocess compiles everything on all cores; results are
cached per compiled specialisation (~/.cache/revtriton/static), so a rerun only reads JSON.

Two kinds of gate test per rule:
- ``test_gate[rule]``: no kernel variant breaks the rule. A rule that today's kernels break (per
  the committed perf/results/static-<triton>.json) is marked xfail(strict) naming the issue that
  rebuilds them: it fails now (``--runxfail`` prints every variant with its number) and turns
  into a failure the day it passes, so the mark goes with the fix.
- ``test_failures_match_the_committed_results[rule]``: the variants breaking the rule are exactly
  the committed ones: a regression fails with the variant's name, config and number, and a fix
  fails until the results are rewritten.
"""
import json
import os
import re

import pytest

from perf.static import RULES, failures, owner
from revtriton import aot


@pytest.fixture(scope="module")  # (module: its tests then share one xdist worker, which compiles once: conftest)
def report():
    return aot.analyze_in_subprocess("perf.static")


def _baseline(triton_version):
    """perf/results/static-<triton>.json as committed: the failures the kernels are known to have."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf", "results",
                        f"static-{triton_version}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _known_failures():
    """{rule: failures} of the committed results of the installed triton (collection time: no compile)."""
    import triton

    baseline = _baseline(triton.__version__)
    return baseline["failures"] if baseline else {}


def _format(broken, limit=40):
    lines = [f"  {label}: {why}" for label, why in sorted(broken.items())]
    return "\n".join(lines[:limit] + ([f"  ... and {len(lines) - limit} more"] if len(lines) > limit else []))


def _gate_params():
    known = _known_failures()
    for rule in RULES:
        broken = known.get(rule)
        marks = []
        if broken:
            owners = sorted({owner(label) for label in broken})
            marks = [pytest.mark.xfail(strict=True, reason=f"{len(broken)} variants break {rule} today: "
                                                           + ", ".join(owners))]
        yield pytest.param(rule, marks=marks, id=rule)


@pytest.mark.parametrize("rule", list(_gate_params()))
def test_gate(report, rule):
    broken = failures(report, rule)
    assert not broken, f"{len(broken)} kernel variants break {rule}:\n{_format(broken)}"


@pytest.mark.parametrize("rule", RULES)
def test_failures_match_the_committed_results(report, rule):
    """A variant that breaks a rule it held (per perf/results/static-<triton>.json) fails with its
    name, config and number; one that was fixed fails too until the results are rewritten
    (``python -m perf.static --write``), so the committed tables always describe the code."""
    baseline = _baseline(report["triton"])
    if baseline is None:
        pytest.fail(f"no perf/results/static-{report['triton']}.json: run python -m perf.static --write")
    broken, known = failures(report, rule), baseline["failures"][rule]
    new = {label: why for label, why in broken.items() if label not in known}
    assert not new, f"{len(new)} kernel variants newly break {rule}:\n{_format(new)}"
    fixed = sorted(set(known) - set(broken))
    assert not fixed, f"{len(fixed)} variants no longer break {rule}: rewrite perf/results ({fixed[:5]} ...)"


def test_every_kernel_and_config_is_compiled(report):
    """Every kernel the halves launch, with every config of each arch's autotune list."""
    rows = [r for r in report["launches"] if r["model"] != "anchor"]
    assert {r["kernel"] for r in rows} == {
        "fused_gemm_kernel", "normalize_kernel", "scale_rows_kernel", "norm_bwd_kernel", "sum_partials_kernel",
        "qkv_rope_gemm_kernel", "attention_fwd_kernel", "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel"}
    from revtriton.kernels import configs

    for arch in (90, 80):
        tiles = {re.search(r"/(\d+x\d+x\d+w\d+s\d+)@", r["label"]).group(1)
                 for r in rows if r["kernel"] == "fused_gemm_kernel" and r["arch"] == arch}
        expected = {f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}w{c.num_warps}s{c.num_stages}"
                    for kind in ("regular", "dual", "act_grad") for c in configs.configs_for_arch(kind, arch)}
        assert tiles == expected, arch
    assert {r["key"] for r in rows} <= set(report["results"])  # every launch x config analysed


def test_specialisation_follows_the_shapes(report):
    """ViT's 41 x 197 = 8077 tokens is not a multiple of 16, GPT-2's 8192 is: the compiled couple
    GEMM differs exactly there (a hand-written spec marking only pointers would not see it)."""
    couple = {(r["model"], r["arch"]): r["label"] for r in report["launches"]
              if r["model"] != "anchor" and r["caller"] == "linear_couple" and r["half"] == "mlp"
              and r["mode"] == "exact"}
    assert "{M}" in couple[("vit_b", 90)]
    assert "{" not in couple[("gpt2", 90)].split("/")[0]
    # the weight-gradient GEMMs reduce over the tokens: K is the token count there
    dw = [r["label"] for r in report["launches"] if r["model"] == "vit_b" and r["caller"] == "linear_weight_grad"
          and r["half"] == "mlp"]
    assert dw and all("{K}" in label for label in dw)


def test_forward_and_rebuild_compile_the_same_kernel(report):
    """Exact streams need the engine's rebuild (sign -1, saving the pre-activation) to run the very
    kernel the forward ran (sign +1, no aux): same compiled specialisation for every launch and config."""
    by_phase = {}
    for r in report["launches"]:
        if r["model"] != "anchor" and r["phase"] in ("forward", "recompute"):
            by_phase.setdefault((r["model"], r["half"], r["mode"], r["index"], r["arch"], r["label"].split("/")[-1]),
                                {})[r["phase"]] = r["key"]
    assert by_phase
    differ = [k for k, v in by_phase.items() if v.get("forward") != v.get("recompute")]
    assert not differ, differ[:5]


def test_model_ranks_the_public_anchors(report):
    """Calibration (DESIGN.md section 7): tutorial-03-class matmul 0.24-0.44 with 64-deep K tiles,
    tutorial-06 TMA attention forward 0.52 at head dim 128 and about 1.03 at 64."""
    ratio = {}
    for r in report["launches"]:
        if r["model"] == "anchor":
            loops = report["results"][r["key"]]["loops"]
            ratios = [loop["ratio"] for loop in loops]
            ratio[r["anchor"]] = min(ratios) if "attention" in r["anchor"] else max(ratios)
    deep = [v for k, v in ratio.items() if k.startswith("tutorial03") and "x64w" in k]
    assert deep and all(0.2 <= v <= 0.45 for v in deep), ratio
    assert 0.45 <= ratio["tutorial06_attention_fwd/d128/128x128w8s3"] <= 0.6, ratio
    assert 0.9 <= ratio["tutorial06_attention_fwd/d64/128x128w8s3"] <= 1.15, ratio
    # the library's TMA GEMM main loops (128 x 256 tiles for light epilogues) issue no more per
    # tensor-core cycle than the tutorial's best one
    gemm = [min(loop["ratio"] for loop in res["loops"]) for res in report["results"].values()
            if res.get("kernel") == "fused_gemm_kernel" and res["arch"] == 90 and res.get("loops")]
    assert min(gemm) <= min(deep)


def _best_attention_ratio(report, model, kernel):
    """The steady-state loop ratio of the kernel's best sm_90 config at a production model."""
    ratios = [min(loop["ratio"] for loop in res["loops"]) for r in report["launches"]
              if r["model"] == model and r["kernel"] == kernel and r["arch"] == 90
              for res in [report["results"][r["key"]]] if res.get("loops")]
    assert ratios, (model, kernel)
    return min(ratios)


@pytest.mark.parametrize("model,head_dim", [("gpt2", 64), ("vit_b", 64), ("llama7b", 128), ("llama3_8b", 128)])
def test_attention_loops_meet_the_public_anchors(report, model, head_dim):
    """Issue 18: the forward's steady loop no worse than the tutorial-06 anchor at its head dim,
    and each backward pass (dq, dk/dv) at most 0.8."""
    anchor = {int(k): v for k, v in report["anchors"].items()}[head_dim]
    assert _best_attention_ratio(report, model, "attention_fwd_kernel") <= anchor + 0.01
    for kernel in ("attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel"):
        assert _best_attention_ratio(report, model, kernel) <= 0.8, kernel


def test_attention_is_predicted_within_12_of_flashattention2(report):
    """Issue 18: the attention core's predicted forward and backward within 1.2x of the same FLOPs
    at the roofline's FlashAttention-2 efficiency, at head dims 64 and 128."""
    rows = report["attention_vs_fa2"]
    assert {(a["model"], a["phase"]) for a in rows} >= {(m, p) for m in ("gpt2", "llama7b", "llama3_8b")
                                                          for p in ("forward", "backward")}
    slow = [a for a in rows if a["ratio"] > 1.2]
    assert not slow, slow


def test_fp32_configs_fit_in_shared_memory():
    """fp32 operands (no autocast) take the attention kernels' fp32 tables and the GEMMs' stage-fitted
    configs: every config the autotuner can pick there compiles for sm_90 and sm_80 within shared
    memory (an H200 refused the bf16 attention tiles at fp32: 448 KiB asked at head dim 80, 227 KiB there)."""
    rows = aot.analyze_in_subprocess("perf.static", ["--fp32-fit"])
    assert {r["kernel"] for r in rows} == {"qkv_rope_gemm_kernel", "attention_fwd_kernel", "attention_bwd_dq_kernel",
                                           "attention_bwd_dkdv_kernel", "fused_gemm_kernel"}
    assert {r["arch"] for r in rows} == {90, 80}
    too_big = [r for r in rows if r["error"] or r["shared"] > r["limit"]]
    assert not too_big, json.dumps(too_big, indent=1)


def test_attention_tables_follow_the_operand_width(monkeypatch):
    """The early prune keys the attention tables by the first operand's element size: 4-byte
    operands get the fp32 list on both archs, 2-byte ones the arch's own."""
    import torch

    from revtriton.ops import fused_attention as fa

    ka = fa._attention_kernels()
    monkeypatch.setattr(ka, "device_arch", lambda: 90)
    prune = ka.prune_by_table(lambda head_dim, arch, size: ka.FWD_CONFIGS[ka._table_key(head_dim, arch, size)])
    everything = ka._union(ka.FWD_CONFIGS)
    keys = lambda configs: [ka.config_key(c) for c in configs]  # noqa: E731
    for dtype, table in ((torch.float32, ("fp32", 128)), (torch.bfloat16, (90, 128)), (torch.float16, (90, 128))):
        kept = prune(everything, {"Q": torch.empty(1, dtype=dtype), "K": torch.empty(1)}, HEAD_DIM=80)
        assert keys(kept) == keys(ka.FWD_CONFIGS[table]), dtype
    assert ka._table_key(256, 80, 4) == ("fp32", 256) and ka._table_key(40, 80, 2) == (80, 64)


def test_packed_rows_take_their_own_forward_tiles_where_listed(monkeypatch):
    """The forward's prune (the GPU tables; the interpreter lists one config): packed rows (SEGMENTS)
    on sm_80 at head dim 128 get FWD_PACKED_ROWS_CONFIGS (the table's tiles spill there), everything
    else the table's; the register cap is part of the config key. The static model compiles the
    kernel's own prune (tests above)."""
    import torch

    from revtriton.ops import fused_attention as fa

    ka = fa._attention_kernels()
    prune = ka.prune_by_table(lambda head_dim, arch, size: ka.FWD_CONFIGS[ka._table_key(head_dim, arch, size)],
                              ka.FWD_PACKED_ROWS_CONFIGS)
    decorated = ka._union(ka.FWD_CONFIGS, ka.FWD_PACKED_ROWS_CONFIGS)
    keys = lambda configs: [ka.config_key(c) for c in configs]  # noqa: E731
    named = {"Q": torch.empty(1, dtype=torch.bfloat16)}
    for arch, segments, table in ((80, True, ka.FWD_PACKED_ROWS_CONFIGS[(80, 128)]),
                                  (80, False, ka.FWD_CONFIGS[(80, 128)]), (90, True, ka.FWD_CONFIGS[(90, 128)])):
        monkeypatch.setattr(ka, "device_arch", lambda arch=arch: arch)
        kept = prune(decorated, named, HEAD_DIM=128, SEGMENTS=segments)
        assert keys(kept) == keys(table), (arch, segments)
    assert all(c.maxnreg == ka.MAX_REGISTERS for c in ka.FWD_CONFIGS[(90, 128)])


def test_attention_register_cap_is_the_static_gate():
    """kernels/attention.py caps configs at the gate's bound (kernels cannot import revtriton.aot):
    one number in two places, held equal here."""
    from revtriton.ops import fused_attention as fa

    assert {fa._attention_kernels().MAX_REGISTERS} == set(aot.MAX_REGISTERS.values())


def test_gemm_prune_follows_the_operand_width_and_the_epilogue(monkeypatch):
    """The GEMM's early prune on sm_90: 128 x 256 output tiles go to light epilogues only (a forward
    GEMM with bias and GELU-tanh into bf16; not the couple's residual, a weight gradient or exact
    GELU's erf); fp32 operands get the stages that fit in shared memory (128 x 128 x 64 at 4 stages
    asks 256 KiB at 4 bytes: 3 stages), and every list keeps a config for them (the SwiGLU-gradient
    list's 16-bit tiles fit only with 2 stages)."""
    import torch

    from revtriton.kernels import configs as kc

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    def pruned(kind, operand, out, **flags):  # a list as the GPU sees it (the interpreter's kernels carry one)
        named = {"a_ptr": torch.empty(1, dtype=operand), "c_ptr": torch.empty(1, dtype=out)}
        return kc.prune_for_device(kc.configs_for_arch(kind, 90) + kc.configs_for_arch(kind, 80), named, **flags)

    def tiles(*args, **flags):
        return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages)
                for c in pruned(*args, **flags)}

    bf16, fp32 = torch.bfloat16, torch.float32
    forward = dict(HAS_BIAS=True, ACT=1, B_K_MAJOR=True)
    assert (128, 256, 64, 3) in tiles("regular", bf16, bf16, **forward)
    assert (128, 256, 64, 3) not in tiles("regular", bf16, torch.int32, RESIDUAL=2, B_K_MAJOR=True)
    assert (128, 256, 64, 3) not in tiles("regular", bf16, bf16, RESIDUAL=1, B_K_MAJOR=True)  # a bf16 float stream
    assert (128, 256, 64, 3) not in tiles("regular", bf16, fp32)  # a weight gradient
    assert (128, 256, 64, 3) not in tiles("regular", bf16, bf16, HAS_BIAS=True, ACT=2, B_K_MAJOR=True)
    assert (128, 128, 64, 4) in tiles("regular", bf16, bf16, **forward)
    at_fp32 = tiles("regular", fp32, fp32, **forward)
    assert (128, 128, 64, 3) in at_fp32 and (128, 128, 64, 4) not in at_fp32 and (128, 256, 64, 3) not in at_fp32
    assert (128, 128, 64, 3) in tiles("dual", bf16, bf16, DUAL_B=True, ACT=4, B_K_MAJOR=True)
    for kind, flags in (("regular", forward), ("dual", dict(DUAL_B=True)), ("act_grad", dict(ACT_BWD=4))):
        kept = pruned(kind, fp32, fp32, **flags)
        assert kept
        for c in kept:
            b_tiles = 2 if flags.get("DUAL_B") else 1
            stage = (c.kwargs["BLOCK_M"] + b_tiles * c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * 4
            assert c.num_stages >= 2 and stage * c.num_stages <= kc.MAX_SHARED[90], (kind, c)


def test_gemm_persistent_configs_serve_only_the_launches_they_compile_for(monkeypatch):
    """Persistent GEMM configs (one program per SM) on sm_90: kept for the forward GEMM, the weight
    gradient and the activation gradients; dropped where their tile loop broke 232 registers or
    spilled (a residual epilogue, a split of K, ALIGNED_8 widths) or changes nothing (split of K)."""
    import torch

    from revtriton.kernels import configs as kc

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))

    def persistent(kind, out, **flags):
        named = {"a_ptr": torch.empty(1, dtype=torch.bfloat16), "c_ptr": torch.empty(1, dtype=out)}
        kept = kc.prune_for_device(kc.configs_for_arch(kind, 90) + kc.configs_for_arch(kind, 80), named, **flags)
        assert kept and all(c.kwargs["USE_TMA"] for c in kept)  # the sm_90 list
        return [c for c in kept if c.kwargs["PERSISTENT"]]

    bf16, fp32 = torch.bfloat16, torch.float32
    assert persistent("regular", bf16, HAS_BIAS=True, ACT=1, B_K_MAJOR=True, SPLIT_K=1)
    assert persistent("regular", fp32, SPLIT_K=1)  # a weight gradient
    assert persistent("act_grad", bf16, ACT_BWD=4, SPLIT_K=1)
    assert not persistent("regular", torch.int32, HAS_BIAS=True, RESIDUAL=2, B_K_MAJOR=True, SPLIT_K=1)
    assert not persistent("regular", fp32, HAS_BIAS=True, RESIDUAL=1, B_K_MAJOR=True, SPLIT_K=1)
    assert not persistent("regular", fp32, SPLIT_K=4)
    assert not persistent("regular", bf16, HAS_BIAS=True, ACT=1, B_K_MAJOR=True, SPLIT_K=1, ALIGNED_8=True)
    assert not kc.GEMM_DUAL_CONFIGS_SM90[0].kwargs["PERSISTENT"] and not any(
        c.kwargs["PERSISTENT"] for c in kc.GEMM_CONFIGS_SM80 + kc.GEMM_DUAL_CONFIGS_SM80)


def test_waves_count_a_persistent_configs_tiles_not_its_programs():
    """A persistent GEMM config launches fewer programs than tiles (one per SM), but the model's
    waves count the output tiles it walks: those of the one-program-a-tile config of its shape."""
    import torch

    from perf import static
    from revtriton.kernels import configs as kc
    from revtriton.ops import gemm

    with aot.recording_launches() as launches:
        gemm.linear(torch.empty(8192, 768), torch.empty(3072, 768), None)
    persistent = next(c for c in kc.GEMM_CONFIGS_SM90 if c.kwargs["PERSISTENT"])
    per_tile = next(c for c in kc.GEMM_CONFIGS_SM90 if not c.kwargs["PERSISTENT"] and all(
        c.kwargs[k] == persistent.kwargs[k] for k in ("BLOCK_M", "BLOCK_N")))
    assert launches[0].grid_size(persistent.kwargs)[0] < 64 * 24  # its programs
    assert static.output_tiles(launches[0], persistent) == static.output_tiles(launches[0], per_tile) == 64 * 24
