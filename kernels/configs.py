"""Autotune configs per architecture for the fused GEMM and norm kernels.

The GEMM kernel is tuned on (a power-of-two bucket of M, N, K, variant flags, dtypes), with
``cache_results=True`` so a shape tunes once per machine. Its config list is the union of the
sm_90 and sm_80 lists; :func:`prune_for_device` keeps the running device's list at tuning time.
Under the interpreter (``TRITON_INTERPRET=1``) there is a single config: multi-config autotune
needs a GPU.

Every config here is compiled ahead of time for sm_90 and sm_80 by ``revtriton.aot`` and must
use no local memory (no spills); see tests/test_static.py (the static model, perf/static.py).
"""
from __future__ import annotations

import os

import triton


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _gemm(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


# Every config below compiles for its arch without spilling for every launch variant of its list
# (ahead of time, tests/test_static.py). With raw operands the main loop is the tutorial-03 /
# tutorial-09 matmul, so the Hopper list is that family (128-wide M tiles, 64-deep K, 3-4
# stages); the epilogues load extra tiles (residual, pre-activation) next to the fp32
# accumulator, which caps the tile at 128 x 128 per 4-warp group. BLOCK_M is a multiple of 64
# everywhere (kernels/gemm.py's column-sum partial rows are 64 rows of C).

# Hopper (wgmma, a 4-warp group per 64 rows).
GEMM_CONFIGS_SM90 = [
    _gemm(128, 128, 64, 8, 4),
    _gemm(128, 128, 64, 8, 3),
    _gemm(64, 128, 64, 4, 4),
]
# Ampere (mma.sync + cp.async).
GEMM_CONFIGS_SM80 = [
    _gemm(128, 64, 32, 8, 4),
    _gemm(64, 128, 32, 8, 4),
    _gemm(64, 64, 32, 4, 3),
]
# Dual-accumulator (SwiGLU gate and up) and SwiGLU-gradient variants: two fp32 tiles in the epilogue.
GEMM_DUAL_CONFIGS_SM90 = [
    _gemm(128, 64, 64, 8, 3),
    _gemm(128, 64, 64, 8, 4),
    _gemm(64, 128, 64, 8, 3),
    _gemm(64, 64, 64, 4, 4),
]
# Gradient GEMMs whose epilogue is heavy: SwiGLU's (two stored pre-activation tiles) and exact
# GELU's (erf and exp per element); narrower tiles per warp keep them from spilling.
GEMM_ACT_GRAD_CONFIGS_SM90 = [
    _gemm(128, 64, 128, 8, 3),
    _gemm(64, 128, 128, 8, 3),
]
GEMM_ACT_GRAD_CONFIGS_SM80 = [
    _gemm(128, 64, 32, 8, 3),
    _gemm(64, 128, 32, 8, 3),
    _gemm(64, 64, 32, 4, 3),
]
GEMM_DUAL_CONFIGS_SM80 = [
    _gemm(128, 64, 32, 8, 3),
    _gemm(64, 128, 32, 8, 3),
    _gemm(64, 64, 32, 4, 3),
]

# The interpreter runs programs serially on numpy: big tiles mean few programs (fast), and
# tl.dot accepts any tile there.
GEMM_CONFIG_INTERPRETER = _gemm(64, 64, 64, 4, 1, group_m=4)

CONFIG_LISTS = {"regular": {90: GEMM_CONFIGS_SM90, 80: GEMM_CONFIGS_SM80},
                "dual": {90: GEMM_DUAL_CONFIGS_SM90, 80: GEMM_DUAL_CONFIGS_SM80},
                "act_grad": {90: GEMM_ACT_GRAD_CONFIGS_SM90, 80: GEMM_ACT_GRAD_CONFIGS_SM80}}
# The arch each config object belongs to (prune_for_device keeps the running device's).
_ARCH_OF = {id(c): arch for lists in CONFIG_LISTS.values() for arch, configs in lists.items() for c in configs}


def gemm_configs(kind: str = "regular") -> list:
    """The config list a GEMM kernel wrapper is decorated with (both archs; one config when interpreted)."""
    if interpreter_enabled():
        return [GEMM_CONFIG_INTERPRETER]
    return CONFIG_LISTS[kind][90] + CONFIG_LISTS[kind][80]


def configs_for_arch(kind: str, arch: int) -> list:
    """The configs of one arch (90 or 80) for a kernel kind ("regular", "dual" or "act_grad")."""
    return CONFIG_LISTS[kind][arch]


def prune_for_device(configs, named_args, **kwargs):
    """early_config_prune: keep the configs of the device the kernel runs on."""
    if len(configs) <= 1:
        return configs
    import torch  # only reached on a GPU

    arch = 90 if torch.cuda.get_device_capability()[0] >= 9 else 80
    kept = [c for c in configs if _ARCH_OF.get(id(c)) == arch]
    return kept or configs[:1]


def norm_num_warps(block_n: int) -> int:
    """Warps for a row kernel holding ``block_n`` elements of a row in registers."""
    # ~16 fp32 elements of each row array per thread; at 16 warps ptxas capped registers and spilled.
    return min(max(block_n // 512, 1), 8) if not interpreter_enabled() else 1
