"""Autotune configs per architecture for the fused GEMM and norm kernels.

The GEMM kernel is tuned on (a power-of-two bucket of M, N, K, variant flags, dtypes), with
``cache_results=True`` so a shape tunes once per machine. Its config list is the union of the
sm_90 and sm_80 lists; :func:`prune_for_device` keeps the running device's list at tuning time,
fitted to the launch (wide tiles for light epilogues, pipeline stages that fit at the operands'
width).
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


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), host arithmetic for launchers and tuning keys:
    triton.next_power_of_2 is a constexpr function (a wrapper unwraps every argument), about 5 us a
    call on the host."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


def config_key(config) -> tuple:
    """What tells two configs apart: their meta-parameters, warps, stages and register cap."""
    return tuple(sorted(config.kwargs.items())) + (config.num_warps, config.num_stages, config.maxnreg)


def _gemm(bm, bn, bk, warps, stages, group_m=8, tma=False, persistent=False):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "USE_TMA": tma,
                          "PERSISTENT": persistent}, num_warps=warps, num_stages=stages)


def _tma(bm, bn, bk, warps, stages, group_m=8, persistent=False):
    """A Hopper config: tiles by TMA where the launcher found the operands descriptor-ready;
    ``persistent``: one program per SM walking the output tiles (kernels/gemm.py)."""
    return _gemm(bm, bn, bk, warps, stages, group_m, tma=True, persistent=persistent)


# Every config below compiles for its arch without spilling for every launch variant of its list
# (ahead of time, tests/test_static.py). With raw operands the main loop is the tutorial-03 /
# tutorial-09 matmul, so the Hopper list is that family (128-wide M tiles, 64-deep K, 3-4
# stages); the epilogues that load extra tiles (residual, pre-activation) next to the fp32
# accumulator cap the tile at 128 x 128 per two 4-warp groups. BLOCK_M is a multiple of 64
# everywhere (kernels/gemm.py's column-sum partial rows are 64 rows of C).

# Hopper (wgmma, a 4-warp group per 64 rows). 128 x 256 tiles (the tutorial-09 / cuBLAS shape:
# half the operand traffic per FLOP of 128 x 128) hold a 128-register accumulator a thread, which
# leaves no room for an epilogue that loads tiles: :func:`prune_for_device` keeps them for light
# epilogues only (bias / activation, 16-bit output).
# Persistent configs (one program per SM walking the tiles, tensor descriptors built once per SM
# instead of once per tile): on triton 3.9 the tile loop around an exact residual epilogue took
# 235-255 registers (179-204 one tile a program), a float one up to 241, a dual accumulator or a
# 128 x 256 tile 255 with a stack, and on 3.6 a split of K or an ALIGNED_8 fp32 output 241-250, so
# they serve the other launches only (:func:`fit_to_launch`; a split of K fills the SMs with one
# tile a program anyway). The tile loop is not flattened into the K loop (tutorial 09 does): that
# put the residual epilogues and the 128 x 256 tile at 250-255 registers, most with a stack.
GEMM_CONFIGS_SM90 = [
    _tma(128, 256, 64, 8, 3),
    _tma(128, 128, 64, 8, 4),
    _tma(128, 128, 64, 8, 4, persistent=True),
    _tma(128, 128, 64, 8, 3),
    _tma(64, 128, 64, 4, 4),
]
# Ampere (mma.sync + cp.async).
GEMM_CONFIGS_SM80 = [
    _gemm(128, 64, 32, 8, 4),
    _gemm(64, 128, 32, 8, 4),
    _gemm(64, 64, 32, 4, 3),
]
# Dual-accumulator (SwiGLU gate and up) and SwiGLU-gradient variants: two fp32 tiles in the epilogue.
GEMM_DUAL_CONFIGS_SM90 = [
    _tma(128, 128, 64, 8, 3),
    _tma(128, 64, 64, 8, 3),
    _tma(128, 64, 64, 8, 4),
    _tma(64, 128, 64, 8, 3),
    _tma(64, 64, 64, 4, 4),
]
# Gradient GEMMs whose epilogue is heavy: SwiGLU's (two stored pre-activation tiles) and exact
# GELU's (erf and exp per element); narrower tiles per warp keep them from spilling.
GEMM_ACT_GRAD_CONFIGS_SM90 = [
    _tma(128, 64, 128, 8, 3),
    _tma(128, 64, 128, 8, 3, persistent=True),
    _tma(64, 128, 128, 8, 3),
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
GEMM_CONFIG_INTERPRETER = _tma(64, 64, 64, 4, 1, group_m=4)

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


# Shared memory a config may ask for (bytes; sm_90 227 KiB, sm_80 163 KiB a block).
MAX_SHARED = {90: 227 * 1024, 80: 163 * 1024}
LIGHT_EPILOGUE_TILE = 128 * 128  # output tiles larger than this only for light epilogues


def _light_epilogue(named_args, kwargs) -> bool:
    """No tile loaded in the epilogue (residual, stored pre-activation), no column sums, no second
    K segment, no erf (exact GELU), a 16-bit output and a K-major B by TMA (the forward's weight;
    an N-major B tile 256 wide costs 60 more registers): what a 128 x 256 tile leaves room for."""
    return (not kwargs.get("RESIDUAL") and not kwargs.get("ACT_BWD") and not kwargs.get("COL_SUM")
            and not kwargs.get("SECOND_K") and kwargs.get("ACT") != 2 and kwargs.get("B_K_MAJOR")
            and named_args["c_ptr"].element_size() == 2)


def _stage_bytes(config, named_args, kwargs) -> int:
    """Shared memory of one pipeline stage: the A tile and the B tile(s) at the operands' width."""
    meta = config.kwargs
    b_tiles = 2 if kwargs.get("DUAL_B") else 1
    return (meta["BLOCK_M"] + b_tiles * meta["BLOCK_N"]) * meta["BLOCK_K"] * named_args["a_ptr"].element_size()


def fit_to_launch(config, named_args, kwargs, arch: int):
    """The config as this launch on ``arch`` can take it, or None: wide output tiles go to light
    epilogues only, persistent ones to launches without a residual epilogue, a split of K or
    widths that are multiples of 8 only, and the pipeline keeps the stages that fit in shared
    memory at the operands' width (fp32 operands, a correctness path, get fewer stages than the
    16-bit tiles were tuned with; a config left with one stage is dropped)."""
    meta = config.kwargs
    wide = meta["BLOCK_M"] * meta["BLOCK_N"] > LIGHT_EPILOGUE_TILE and not kwargs.get("DUAL_B")
    if wide and not _light_epilogue(named_args, kwargs):
        return None
    persistent_unfit = kwargs.get("RESIDUAL") or kwargs.get("SPLIT_K", 1) > 1 or kwargs.get("ALIGNED_8")
    if meta.get("PERSISTENT") and persistent_unfit:
        return None
    stages = min(config.num_stages, MAX_SHARED[arch] // _stage_bytes(config, named_args, kwargs))
    if stages == config.num_stages:
        return config
    return triton.Config(dict(meta), num_warps=config.num_warps, num_stages=stages) if stages >= 2 else None


def prune_for_device(configs, named_args, **kwargs):
    """early_config_prune: the configs of the device the kernel runs on, fitted to the launch
    (:func:`fit_to_launch`; duplicates after fitting dropped)."""
    if len(configs) <= 1:
        return configs
    import torch  # only reached on a GPU

    arch = 90 if torch.cuda.get_device_capability()[0] >= 9 else 80
    own = [c for c in configs if _ARCH_OF.get(id(c)) == arch] or configs[:1]
    fitted, seen = [], set()
    for config in own:
        config = fit_to_launch(config, named_args, kwargs, arch)
        key = None if config is None else config_key(config)
        if config is not None and key not in seen:
            seen.add(key)
            fitted.append(config)
    return fitted or own[:1]


def norm_num_warps(block_n: int) -> int:
    """Warps for a row kernel holding ``block_n`` elements of a row in registers."""
    # ~16 fp32 elements of each row array per thread; at 16 warps ptxas capped registers and spilled.
    return min(max(block_n // 512, 1), 8) if not interpreter_enabled() else 1
