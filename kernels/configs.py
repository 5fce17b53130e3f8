"""Autotune configs per architecture for the fused GEMM and norm kernels.

The GEMM kernel is tuned on (N, K, variant flags, dtypes), never on the token count M, with
``cache_results=True`` so a shape tunes once per machine. Its config list is the union of the
sm_90 and sm_80 lists; :func:`prune_for_device` keeps the running device's list at tuning time.
Under the interpreter (``TRITON_INTERPRET=1``) there is a single config: multi-config autotune
needs a GPU.

Every config here is compiled ahead of time for sm_90 and sm_80 by ``revtriton.aot`` and must
use no local memory (no spills); see tests/test_aot.py.
"""
from __future__ import annotations

import os

import triton


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _gemm(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


# Hopper: wgmma wants 4-warp groups and a 64-row granule; 128x128 fp32 accumulators need 8 warps
# (with 4 warps the epilogue tiles push a 128x128 tile to ~254 registers and stack use).
GEMM_CONFIGS_SM90 = [
    _gemm(128, 128, 64, 8, 3),
    _gemm(128, 64, 64, 4, 4),
    _gemm(64, 128, 64, 4, 4),
    _gemm(64, 64, 64, 4, 4),
]

# Ampere: mma.sync, cp.async pipelines; smaller tiles keep the register budget.
GEMM_CONFIGS_SM80 = [
    _gemm(128, 128, 32, 8, 3),
    _gemm(128, 64, 32, 4, 4),
    _gemm(64, 128, 32, 4, 4),
    _gemm(64, 64, 32, 4, 3),
]

# The interpreter runs programs serially on numpy: big tiles mean few programs (fast), and
# tl.dot accepts any tile there.
GEMM_CONFIG_INTERPRETER = _gemm(32, 32, 32, 4, 1, group_m=4)

# Tags the arch of every config object (a config may appear in several lists only once).
_ARCH_OF = {id(c): 90 for c in GEMM_CONFIGS_SM90} | {id(c): 80 for c in GEMM_CONFIGS_SM80}


def gemm_configs() -> list:
    """The config list the GEMM kernel is decorated with."""
    if interpreter_enabled():
        return [GEMM_CONFIG_INTERPRETER]
    return GEMM_CONFIGS_SM90 + GEMM_CONFIGS_SM80


def configs_for_arch(capability_major: int) -> list:
    """sm_90 and newer get the Hopper list, everything else the Ampere list."""
    return GEMM_CONFIGS_SM90 if capability_major >= 9 else GEMM_CONFIGS_SM80


def prune_for_device(configs, named_args, **kwargs):
    """early_config_prune: keep the configs of the device the kernel runs on."""
    if len(configs) <= 1:
        return configs
    import torch  # only reached on a GPU

    major = torch.cuda.get_device_capability()[0]
    wanted = {id(c) for c in configs_for_arch(major)}
    kept = [c for c in configs if id(c) in wanted]
    return kept or configs[:1]


def norm_num_warps(block_n: int) -> int:
    """Warps for a row kernel holding ``block_n`` elements of a row in registers."""
    return min(max(block_n // 256, 1), 16) if not interpreter_enabled() else 1
