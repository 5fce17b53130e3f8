"""Ahead-of-time compilation of the fused norm+MLP half's kernels for sm_90 and sm_80 (CPU only).

Every kernel variant the half launches x every autotune config of the arch that runs it
(revtriton.ops.fused_mlp.aot_specs) compiles with triton.compile for GPUTarget("cuda", 90 / 80, 32),
uses no local memory and no stack (a spill, see revtriton/aot.py), and the sm_90 GEMMs use wgmma.
The compilation runs once, in a subprocess without the interpreter, on all cores.
"""
import pytest

from revtriton import aot
from revtriton.ops import fused_mlp

MLP_LABELS = [s.label for s in fused_mlp.aot_specs()]
MLP_PATTERN = r"^(gemm\[(fwd|bwd|couple)_|row_stats\[|norm_bwd\[|sum_partials\[)"


def test_specs_cover_every_variant_and_config():
    import re

    from revtriton.kernels import configs

    specs = fused_mlp.aot_specs()
    assert len(MLP_LABELS) == len(set(MLP_LABELS))
    assert all(re.search(MLP_PATTERN, label) for label in MLP_LABELS)
    names = {s.name.split("/")[0] for s in specs if s.name.startswith("gemm[")}
    for name in names:  # each GEMM variant appears once per config of its list, on each arch
        for arch in (90, 80):
            kinds = {"dual" if "[fwd_rmsnorm_swiglu]" in name or "[bwd_dh_swiglu]" in name else "regular"}
            (kind,) = kinds
            got = [s for s in specs if s.name.split("/")[0] == name and s.arch == arch]
            assert len(got) == len(configs.configs_for_arch(kind, arch)), (name, arch)
    assert {"gemm[fwd_layernorm_gelu_tanh]", "gemm[fwd_rmsnorm_swiglu]", "gemm[couple_exact]", "gemm[couple_float]",
            "gemm[bwd_dh_gelu]", "gemm[bwd_dw2_relu]", "gemm[bwd_dw1_layernorm]", "gemm[bwd_dx_swiglu]"} <= names
    assert all(s.arch in (80, 90) for s in specs)


@pytest.fixture(scope="module")
def compiled():
    results = aot.run_in_subprocess(MLP_PATTERN)
    print("\n" + aot.format_table(results))
    return {r.label: r for r in results}


@pytest.mark.parametrize("label", MLP_LABELS)
def test_compiles_without_spills(compiled, label):
    r = compiled[label]
    assert r.error is None, r.error
    assert r.local == 0, f"{label}: {r.local} bytes of local memory (spill)"
    assert r.stack == 0, f"{label}: {r.stack} bytes of stack at {r.registers} registers (spill)"
    assert 0 < r.registers <= 255
    if r.expect_wgmma:
        assert r.has_wgmma, f"{label}: no wgmma in the sm_90 PTX"
