"""perf.roofline: hand-checked FLOPs, bytes, launches and times (pure arithmetic, no GPU, < 1 s)."""
from __future__ import annotations

import dataclasses
import io
import json
from contextlib import redirect_stdout

import pytest

from perf import roofline as rl
from perf.roofline import H100, H200, SHAPES, Op

M = 8192  # every production shape runs 8192 tokens


def _one(ops, name):
    found = [op for op in ops if op.name == name]
    assert len(found) == 1, f"{name}: {[op.name for op in ops]}"
    return found[0]


def _gemm_flops(ops):
    return sum(op.flops for op in ops if op.kind == "gemm")


def test_shapes_are_the_production_ones():
    assert {s.tokens for s in SHAPES.values()} == {M}
    vit, gpt, llama, llama3 = SHAPES["vit_b"], SHAPES["gpt2"], SHAPES["llama7b"], SHAPES["llama3_8b"]
    assert (vit.dim, vit.hidden, vit.heads, vit.head_dim, vit.causal) == (768, 3072, 12, 64, False)
    assert (gpt.seq, gpt.batch, gpt.causal, gpt.mlp, gpt.bias) == (1024, 8, True, "gelu_tanh", True)
    assert (SHAPES["vit_l"].dim, SHAPES["vit_l"].hidden, SHAPES["vit_l"].heads) == (1024, 4096, 16)
    assert (llama.hidden, llama.norm, llama.mlp, llama.bias, llama.rope, llama.seq) == (11008, "rms", "swiglu", False,
                                                                                        True, 4096)
    assert (llama3.hidden, llama3.heads, llama3.kv_heads, llama3.head_dim, llama3.seq) == (14336, 32, 8, 128, 8192)
    assert llama3.qkv_width == (32 + 2 * 8) * 128 == 6144


@pytest.mark.parametrize("path", rl.PATHS)
def test_mlp_forward_flops_by_hand(path):
    # two GEMMs of 2 * tokens * 768 * 3072 FLOPs each
    ops = rl.half_ops("vit_b", "mlp", "forward", path)
    assert rl.total_flops(ops) == 77_309_411_328 == 2 * 2 * 8192 * 768 * 3072
    # SwiGLU: gate, up and down = three such GEMMs
    assert rl.total_flops(rl.half_ops("llama7b", "mlp", "forward", path)) == 3 * 2 * 8192 * 4096 * 11008


def test_elementwise_bytes_by_hand():
    gelu = _one(rl.unfused_ops(SHAPES["vit_b"], "mlp", "forward"), "gelu_tanh")
    assert (gelu.kind, gelu.flops, gelu.bytes) == ("elementwise", 0, 100_663_296)  # 8192 * 3072 * (2 + 2)
    value = _one(rl.half_ops("vit_b", "mlp", "forward", "fused"), "engine.value")
    assert value.bytes == 50_331_648 and value.engine  # int32 read + fp32 write of 8192 x 768
    cast = _one(rl.fused_ops(SHAPES["vit_b"], "mlp", "forward"), "cast.w1")
    assert cast.bytes == 3072 * 768 * (4 + 2)


def test_fused_mlp_forward_bytes_by_hand():
    # normalize: x fp32, gamma, beta -> n bf16, mean, rstd; GEMM1: n bf16, W1 bf16, b1 fp32 -> act bf16;
    # GEMM2: act, W2 bf16, b2 fp32, res int32 -> stream int32.
    d, h = 768, 3072
    expected = (M * d * 4 + 2 * d * 4 + M * d * 2 + 2 * M * 4
                + M * d * 2 + h * d * 2 + h * 4 + M * h * 2
                + M * h * 2 + d * h * 2 + d * 4 + M * d * 4 + M * d * 4)
    ops = rl.fused_ops(SHAPES["vit_b"], "mlp", "forward", master_fp32=False)
    assert rl.total_bytes(ops) == expected
    assert rl.launch_count(ops) == 3


def test_recompute_saves_only_the_preactivation():
    for name in ("vit_b", "llama3_8b"):
        s = SHAPES[name]
        fwd, rec = (rl.total_bytes(rl.fused_ops(s, "mlp", p)) for p in ("forward", "recompute"))
        width = 2 * s.hidden if s.mlp == "swiglu" else s.hidden
        assert rec - fwd == M * width * 2, name
        # attention saves x, stats, qkv, o, lse: all written by the forward anyway
        assert rl.total_bytes(rl.fused_ops(s, "attention", "recompute")) == \
            rl.total_bytes(rl.fused_ops(s, "attention", "forward"))


def test_causal_attention_halves_the_core_flops():
    gpt2 = SHAPES["gpt2"]
    core = _one(rl.fused_ops(gpt2, "attention", "forward"), "attention_fwd")
    assert core.flops == 12_884_901_888  # 4 * 8 batch * 12 heads * 1024^2 * 64 / 2
    full = dataclasses.replace(gpt2, causal=False)
    assert _one(rl.fused_ops(full, "attention", "forward"), "attention_fwd").flops == 2 * core.flops
    assert _one(rl.unfused_ops(full, "attention", "forward"), "sdpa_flash_fwd").flops == 2 * core.flops


def test_gqa_changes_kv_bytes_not_flops():
    gqa = SHAPES["llama3_8b"]
    mha = dataclasses.replace(gqa, kv_heads=gqa.heads)
    for path, name in (("fused", "attention_fwd"), ("unfused", "sdpa_flash_fwd")):
        a = _one(rl.half_ops(gqa, "attention", "forward", path), name)
        b = _one(rl.half_ops(mha, "attention", "forward", path), name)
        assert a.flops == b.flops
        assert b.bytes - a.bytes == 2 * M * (32 - 8) * 128 * 2  # k and v, 24 fewer heads, bf16
    # the QKV GEMM is narrower under GQA: (32 + 16) * 128 instead of 96 * 128 columns
    a = _one(rl.fused_ops(gqa, "attention", "forward"), "qkv_rope_gemm")
    assert a.flops == 2 * M * 4096 * 6144


def test_attention_backward_matmul_counts():
    s = SHAPES["vit_b"]
    fwd = rl.attention_core_flops(s, 2)
    bwd = rl.fused_ops(s, "attention", "backward")
    assert _one(bwd, "attention_bwd_dq").flops * 2 == 3 * fwd  # QK^T, dP, dQ
    assert _one(bwd, "attention_bwd_dkdv").flops * 2 == 4 * fwd  # QK^T, dV, dP, dK
    assert _one(rl.unfused_ops(s, "attention", "backward"), "sdpa_flash_bwd").flops * 2 == 5 * fwd


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("half", rl.HALVES)
@pytest.mark.parametrize("path", rl.PATHS)
def test_backward_gemm_flops_twice_forward(shape, half, path):
    fwd = _gemm_flops(rl.half_ops(shape, half, "forward", path))
    bwd = _gemm_flops(rl.half_ops(shape, half, "backward", path))
    # exactly: every weight and input gradient is one GEMM of the forward's size (no GEMV folds)
    assert bwd == 2 * fwd


@pytest.mark.parametrize("exact", [True, False])
def test_unfused_moves_more_bytes_everywhere(exact):
    for shape in SHAPES:
        for half in rl.HALVES:
            for phase in rl.PHASES:
                fused = rl.total_bytes(rl.half_ops(shape, half, phase, "fused", exact=exact))
                unfused = rl.total_bytes(rl.half_ops(shape, half, phase, "unfused", exact=exact))
                assert unfused > fused, (shape, half, phase)
                # and the same FLOPs outside the attention backward (7 vs 5 matmuls)
                if not (half == "attention" and phase == "backward"):
                    assert rl.total_flops(rl.half_ops(shape, half, phase, "fused")) == \
                        rl.total_flops(rl.half_ops(shape, half, phase, "unfused")), (shape, half, phase)


def test_exact_couple_costs_eager_more_than_float():
    s = SHAPES["gpt2"]
    e = M * 768
    exact = rl.total_bytes(rl.unfused_ops(s, "mlp", "forward", exact=True))
    floaty = rl.total_bytes(rl.unfused_ops(s, "mlp", "forward", exact=False))
    # quantize_reference + int add: (2+4) + 4*8 + (4+4) + 12 = 58 bytes/element vs one add, 4+2+4
    assert exact - floaty == (58 - 10) * e
    # the fused couple does it in the GEMM epilogue: same bytes either way
    assert rl.total_bytes(rl.half_ops(s, "mlp", "forward", "fused", exact=True, engine=False)) == \
        rl.total_bytes(rl.half_ops(s, "mlp", "forward", "fused", exact=False, engine=False))
    # the engine's value / guard / checksum passes exist only for int32 streams
    assert not [op for op in rl.half_ops(s, "mlp", "forward", "fused", exact=False) if op.engine]
    assert len([op for op in rl.half_ops(s, "mlp", "forward", "fused", exact=True) if op.engine]) == 3


def test_launch_counts_match_the_fused_ops_docs():
    s = SHAPES["llama7b"]  # no biases: no column-sum passes
    count = lambda half, phase: rl.launch_count(rl.fused_ops(s, half, phase, master_fp32=False))  # noqa: E731
    assert count("mlp", "forward") == 3       # normalize, GEMM1, GEMM2
    assert count("mlp", "backward") == 7      # scale g, dH, dW2, dW1, dN, norm_bwd, one reduction
    assert count("attention", "forward") == 4  # normalize, QKV, attention, out-proj
    # scale g, dO, dW_proj, delta, attention bwd, dN, norm_bwd, dW_qkv, one reduction
    assert count("attention", "backward") == 9
    vit = SHAPES["vit_b"]  # biases: db_qkv column sums; dW_proj 768 x 768 splits K (36 tiles < 66)
    assert rl.launch_count(rl.fused_ops(vit, "attention", "backward", master_fp32=False)) == 10
    assert {op.kind for op in rl.fused_ops(s, "attention", "forward", master_fp32=False)} == {"gemm", "attention",
                                                                                             "reduction"}


def test_split_k_plan_matches_the_launcher():
    from revtriton.ops.gemm import split_k_plan

    for m, n, k in [(768, 768, 8192), (768, 3072, 8192), (1024, 1024, 8192), (4096, 4096, 8192), (768, 768, 1000),
                    (64, 64, 65536), (6144, 4096, 8192)]:
        assert rl._split_k(m, n, k) == split_k_plan(m, n, k, 132)[0], (m, n, k)


def test_op_time_by_hand():
    gemm = Op("g", "gemm", 10**12, 10**6)
    # compute-bound: 1e12 / (989.4e12 * 0.5) s, plus one 4 us launch
    assert rl.op_time(gemm, H100, (0.5, 1.0), launch_overhead_s=4e-6) == pytest.approx(1 / 494.7 + 4e-6)
    assert rl.limited_by(gemm, H100) == "compute"
    copy = Op("c", "elementwise", 0, 3_350_000_000)
    assert rl.op_time(copy, H100, rl.ROOF) == pytest.approx(1e-3)  # 3.35 GB at 3.35 TB/s
    assert rl.op_time(copy, H100) == pytest.approx(1e-3 / 0.85 + 4e-6)
    assert rl.op_time(copy, H200, rl.ROOF) == pytest.approx(1e-3 * 3.35 / 4.8)
    assert rl.limited_by(copy, H100) == "memory"
    attn_bwd = Op("a", "attention", 10**12, 0, backward=True)
    assert rl.op_time(attn_bwd, H100) == pytest.approx(1e12 / (989.4e12 * 0.35) + 4e-6)
    with pytest.raises(ValueError):
        rl.op_time(copy, H100, (0.0, 1.0))
    with pytest.raises(ValueError):
        Op("bad", "matmul", 0, 0)


def test_efficiency_for_substitutes_only_what_it_returns():
    ops = rl.half_ops("gpt2", "mlp", "forward", "fused")
    base = rl.phase_time(ops, H100)
    assert rl.phase_time(ops, H100, efficiency_for=lambda op: None) == pytest.approx(base)
    # a static model saying the fused GEMMs run at 0.375 of peak (half the default) costs exactly
    # the GEMMs' compute time once more
    slow = rl.phase_time(ops, H100, efficiency_for=lambda op: (0.375, 0.85) if op.kind == "gemm" else None)
    gemm_time = sum(op.flops / (H100.peak_flops * 0.75) for op in ops if op.kind == "gemm")
    assert slow - base == pytest.approx(gemm_time)
    # every op at the pure roof and no launch cost gives the bound
    roof = rl.phase_time(ops, H100, rl.ROOF, efficiency_for=lambda op: (1.0, 1.0))
    assert roof == pytest.approx(rl.phase_bound(ops, H100))


def test_wave_quantization():
    waves, eff = rl.wave_quantization(36, 132)
    assert waves == pytest.approx(0.2727, abs=1e-4) and eff == pytest.approx(0.27, abs=0.005)
    assert rl.wave_quantization(264, 132) == (2.0, 1.0)
    assert rl.wave_quantization(133, 132)[1] == pytest.approx(133 / 264)
    assert rl.gemm_tiles(768, 768) == 36 and rl.gemm_tiles(8192, 3072, 128, 256) == 64 * 12
    assert rl.gemm_tiles(100, 1, 64, 64) == 2
    dw_proj = _one(rl.fused_ops(SHAPES["vit_b"], "attention", "backward"), "dw_proj")
    assert dw_proj.mnk == (768, 768, M)
    assert rl.gemm_wave_efficiency(dw_proj, H100) == pytest.approx(36 / 132)
    assert rl.gemm_wave_efficiency(dw_proj, rl.A100) == pytest.approx(36 / 108)
    # SwiGLU's GEMM1 is one dual-accumulator kernel: its tile grid spans the hidden width once
    gemm1 = _one(rl.fused_ops(SHAPES["llama7b"], "mlp", "forward"), "gemm1_swiglu")
    assert gemm1.mnk == (M, 11008, 4096) and gemm1.flops == 2 * 2 * M * 11008 * 4096
    # attention programs: 2 query blocks of 128 x 32 images x 12 heads = 768; backward adds dk/dv programs
    assert rl.attention_programs(SHAPES["vit_b"]) == 768
    assert rl.attention_programs(SHAPES["llama3_8b"], 128, backward=True) == 64 * (8 + 32)


def test_gpu_specs():
    assert (H100.peak_flops, H100.bandwidth, H100.sms) == (989.4e12, 3.35e12, 132)
    assert (H200.peak_flops, H200.bandwidth, H200.sms) == (989.4e12, 4.8e12, 132)
    assert (rl.A100.peak_flops, rl.A100.bandwidth, rl.A100.sms) == (312e12, 2.039e12, 108)


def test_table_markdown_and_main(tmp_path):
    rows = rl.table()
    assert len(rows) == len(SHAPES) * 2 * 3 * 2
    for r in rows:
        for g in (H100.name, H200.name):
            assert 0 < r.bound_us[g] < r.est_us[g]
        assert r.bound_us[H200.name] <= r.bound_us[H100.name]  # same peak, more bandwidth
    text = rl.markdown(rows)
    assert "| vit_b | mlp | forward | fused |" in text and "step (fwd+recompute+bwd)" in text
    out = io.StringIO()
    with redirect_stdout(out):
        assert rl.main(["--shapes", "gpt2", "--json", str(tmp_path / "r.json")]) == 0
    assert "| gpt2 | attention | backward | unfused |" in out.getvalue()
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["rows"]) == 12 and doc["speedups"][-1]["half"] == "block"


def test_bad_arguments():
    with pytest.raises(ValueError):
        rl.half_ops("gpt2", "ffn", "forward", "fused")
    with pytest.raises(ValueError):
        rl.half_ops("gpt2", "mlp", "inverse", "fused")
    with pytest.raises(ValueError):
        rl.half_ops("gpt2", "mlp", "forward", "compiled")
    with pytest.raises(ValueError):
        rl.wave_quantization(0, 132)
