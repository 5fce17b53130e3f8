"""Compile what a real launch compiles, for sm_90 and sm_80, without a GPU, and read the result.

A Triton launch specialises its arguments: pointers and integers divisible by 16 get
``tt.divisibility = 16``, integers equal to 1 become constants. Which ones are, depends on the
shapes (M = 8192 tokens is divisible by 16, ViT's 197 x 41 = 8077 is not), and the compiled
kernel depends on it (an un-marked K loses its async-copy pipeline). So this module does not
describe kernels by hand: it runs the library's own fused ops on ``meta`` tensors at a given
shape, records every launch they make (:func:`recording_launches`), and compiles each one with
Triton's own argument binder for ``GPUTarget("cuda", arch, 32)`` and every autotune config the
arch would try. ``triton.compile`` builds PTX and a cubin on a CPU-only machine with the ptxas in
the triton wheel; ``cuobjdump`` (also in the wheel) reports registers / stack / local memory and
prints the SASS that :mod:`revtriton.sass` reads.

What counts as a spill: local memory (``LOCAL > 0``) or a stack frame (``STACK > 0``).

The interpreter (``TRITON_INTERPRET=1``) replaces @triton.jit functions, so compilation runs in a
subprocess without it (:func:`analyze_in_subprocess`). Results are cached on disk per compiled
specialisation (kernel source hash, signature, constants, attributes, options, target, triton
version and this analyser's own source), so a second run only re-reads JSON.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch

from . import sass
from .ops import dispatch

from revtriton.kernels.configs import MAX_SHARED  # noqa: F401  (kernels/: the limit the GEMM prune fits to)

ARCHS = (90, 80)
MAX_REGISTERS = {90: 232, 80: 232}       # of 255: leaves headroom for ptxas
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = {90: 64, 80: 64}
MAX_CTAS_PER_SM = 32


# ---------------------------------------------------------------- recording launches

@dataclasses.dataclass
class Launch:
    """One ``dispatch.launch(kernel, grid, *args, **meta)`` call, recorded instead of run."""
    kernel: object   # a JITFunction or an Autotuner around one
    grid: object     # a tuple, or a callable of the config's meta-parameters
    args: tuple
    meta: dict
    caller: str      # the ops function that launched it (e.g. "linear_couple")

    @property
    def kernel_name(self) -> str:
        return _innermost(self.kernel).__name__

    def grid_size(self, config_kwargs: dict) -> tuple:
        grid = self.grid(dict(self.named_args(), **self.meta, **config_kwargs)) if callable(self.grid) else self.grid
        return tuple(int(g) for g in grid) + (1,) * (3 - len(grid))

    def named_args(self) -> dict:
        return dict(zip(_innermost(self.kernel).arg_names, self.args))


def _innermost(kernel):
    """The kernel function under autotune / heuristics wrappers (jit or interpreted)."""
    while hasattr(kernel, "fn") and not hasattr(kernel, "__name__"):  # wrappers have no __name__
        kernel = kernel.fn
    return kernel


def jit_function(kernel):
    """The JITFunction under autotune / heuristics wrappers (the compiled world, not the interpreter)."""
    from triton.runtime.jit import JITFunction

    fn = _innermost(kernel)
    if not isinstance(fn, JITFunction):
        raise TypeError(f"{kernel!r} is not a @triton.jit kernel (is TRITON_INTERPRET set?)")
    return fn


def _launcher_name(frame) -> str:
    """The launcher a launch came from: the first caller that is not a GEMM launch helper (a
    ``_launch*`` function or a GemmLaunch), a launch plan's entry named by its ``launcher``
    attribute (``gemm.LinearCoupleLaunch`` is ``linear_couple``). Frames, not inspect.stack(),
    which reads source files: slow."""
    while frame.f_back is not None:
        name = frame.f_code.co_name
        if name == "__call__":
            name = getattr(frame.f_locals.get("self"), "launcher", None)
        if name and not name.startswith("_launch"):
            return name
        frame = frame.f_back
    return frame.f_code.co_name


@contextlib.contextmanager
def recording_launches(autocast_dtype: torch.dtype | None = torch.bfloat16):
    """Record every ``dispatch.launch`` instead of running it; ``meta`` tensors act as if under
    ``autocast(dtype=autocast_dtype)`` (meta has no autocast of its own). Yields the list."""
    launches: list[Launch] = []
    real_enabled, real_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def record(kernel, grid, *args, **meta):
        launches.append(Launch(kernel, grid, args, meta, _launcher_name(sys._getframe(1))))

    def enabled(device_type=None):
        if device_type == "meta":
            return autocast_dtype is not None
        return real_enabled() if device_type is None else real_enabled(device_type)

    def dtype(device_type):
        return autocast_dtype if device_type == "meta" else real_dtype(device_type)

    def autocast(device_type, *args, **kwargs):
        return contextlib.nullcontext() if device_type == "meta" else real_autocast(device_type, *args, **kwargs)

    real_autocast = torch.autocast
    patched = ((dispatch, "launch", record), (torch, "is_autocast_enabled", enabled),
               (torch, "get_autocast_dtype", dtype), (torch, "autocast", autocast))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, value in patched:
        setattr(owner, name, value)
    try:
        yield launches
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


# ---------------------------------------------------------------- configs and specialisation

def configs_for_arch(launch: Launch, arch: int) -> list:
    """The autotune configs the kernel would try on ``arch`` (its own early_config_prune, run as if
    on that device); a plain JIT launch has one 'config': its launch options."""
    import triton

    kernel = launch.kernel
    if not hasattr(kernel, "configs"):
        return [triton.Config({}, num_warps=launch.meta.get("num_warps", 4),
                              num_stages=launch.meta.get("num_stages", 3))]
    prune = getattr(kernel, "early_config_prune", None)
    configs = list(kernel.configs)
    if prune is None or len(configs) <= 1:
        return configs
    real = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (arch // 10, arch % 10)
    try:
        return list(prune(configs, launch.named_args(), **launch.meta))
    finally:
        torch.cuda.get_device_capability = real


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """Everything ``triton.compile`` needs for one launch x config x arch (picklable but the fn)."""
    kernel_name: str
    arch: int
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    config: dict     # the config's meta-parameters, num_warps, num_stages (for labels)
    key: str         # hash of the specialisation: one compile per key


@functools.lru_cache(maxsize=None)
def _backend(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    return target, make_backend(target)


def compile_job(launch: Launch, config, arch: int) -> CompileJob:
    """Bind the launch's arguments as ``kernel[grid](...)`` would, with Triton's own binder."""
    from triton.runtime.jit import create_function_from_signature

    fn = jit_function(launch.kernel)
    _, backend = _backend(arch)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch.meta, **config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.maxnreg is not None:  # a register cap (kernels/attention.py): a compile option, as at launch
        kwargs["maxnreg"] = config.maxnreg
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    option_kwargs = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    options, signature, constexprs, attrs = fn._pack_args(backend, option_kwargs, bound_args, specialization, options)
    options = {k: v for k, v in options.__dict__.items()}
    # The key leaves out where triton is installed (extern_libs holds libdevice's path), so every
    # environment with the same triton shares the cached analyses.
    portable = {k: (tuple((lib, os.path.basename(path)) for lib, path in v) if k == "extern_libs" else v)
                for k, v in options.items()}
    key_text = repr((fn.cache_key, sorted(signature.items()),
                     sorted((str(k), str(v)) for k, v in constexprs.items()),
                     sorted((str(k), str(v)) for k, v in attrs.items()),
                     sorted((k, str(v)) for k, v in portable.items()), arch))
    config_desc = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
                   **({"maxnreg": config.maxnreg} if config.maxnreg is not None else {})}
    return CompileJob(fn.__name__, arch, signature, constexprs, attrs, options, config_desc,
                      hashlib.sha256(key_text.encode()).hexdigest()[:20])


# ---------------------------------------------------------------- compile and read

def tool_path(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def cuobjdump_path() -> str:
    return tool_path("cuobjdump")


_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _cuobjdump(cubin: bytes, *flags) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump_path(), *flags, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict:
    """registers / stack / static shared / local bytes of the (single) kernel in a cubin."""
    out = _cuobjdump(cubin, "--dump-resource-usage")
    match = _USAGE.search(out)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    reg, stack, shared, local = map(int, match.groups())
    return {"registers": reg, "stack": stack, "shared": shared, "local": local}


def occupancy(registers: int, shared: int, warps: int, arch: int) -> int:
    """CTAs per SM allowed by registers (allocated per warp in 256-register units), shared memory
    and warps."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // max(per_warp * warps, 1)
    by_smem = MAX_SHARED[arch] // shared if shared else MAX_CTAS_PER_SM
    by_warps = MAX_WARPS_PER_SM[arch] // warps
    return max(0, min(by_regs, by_smem, by_warps, MAX_CTAS_PER_SM))


def _analyzer_version() -> str:
    """Triton's version and a hash of the code that reads a compiled kernel (not of the recording code)."""
    import inspect

    import triton

    h = hashlib.sha256(inspect.getsource(sass).encode())
    for fn in (analyze, resource_usage, occupancy, _cuobjdump):
        h.update(inspect.getsource(fn).encode())
    return f"{triton.__version__}-{h.hexdigest()[:12]}"


def cache_dir() -> str:
    root = os.environ.get("REVTRITON_STATIC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "revtriton", "static")
    return os.path.join(root, _analyzer_version())


def analyze(job: CompileJob, fn) -> dict:
    """Compile the job and read it: resources, occupancy, main loops (SASS) and TTGIR facts."""
    import triton
    from triton.compiler import ASTSource

    path = os.path.join(cache_dir(), job.key + ".json")
    if os.path.exists(path):
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    target, _ = _backend(job.arch)
    result = {"key": job.key, "kernel": job.kernel_name, "arch": job.arch, "config": job.config, "error": None}
    try:
        src = ASTSource(fn=fn, signature=job.signature, constexprs=job.constexprs, attrs=job.attrs)
        compiled = triton.compile(src, target=target, options=job.options)
        usage = resource_usage(compiled.asm["cubin"])
        shared = int(getattr(compiled.metadata, "shared", 0) or 0)
        warps = job.config["num_warps"]
        loops = sass.main_loops(sass.parse_sass(_cuobjdump(compiled.asm["cubin"], "-sass")))
        shared = max(shared, usage["shared"])  # dynamic (Triton's) or static
        result.update(
            registers=usage["registers"], stack=usage["stack"], local=usage["local"], shared=shared,
            occupancy=occupancy(usage["registers"], shared, warps, job.arch),
            mma_sync="mma.sync" in compiled.asm["ptx"], wgmma="wgmma" in compiled.asm["ptx"],
            loops=[{**dataclasses.asdict(loop), "tensor_ops": list(loop.tensor_ops), **loop.cycles(warps, job.arch)}
                   for loop in loops],
            ttgir=sass.parse_ttgir(compiled.asm["ttgir"]).as_dict())
    except Exception as e:  # reported, and a failed gate
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)
    return result


# ---------------------------------------------------------------- many jobs, on all cores

_WORKER_JOBS: dict = {}


def _worker_init(collect):
    global _WORKER_JOBS
    _WORKER_JOBS = {job.key: (job, fn) for job, fn in collect()}


def _worker_analyze(key):
    job, fn = _WORKER_JOBS[key]
    return analyze(job, fn)


def analyze_all(collect, workers: int | None = None) -> dict:
    """Analyse every distinct job that ``collect()`` yields as ``(CompileJob, jit fn)`` pairs, on
    ``workers`` processes (default: all cores); returns {key: result}. ``collect`` must be a
    module-level function (the workers call it again to rebuild the jobs)."""
    if dispatch.interpreter_enabled():
        raise RuntimeError("AOT compilation needs TRITON_INTERPRET unset: use analyze_in_subprocess()")
    jobs = {}
    for job, fn in collect():
        jobs.setdefault(job.key, (job, fn))
    # analyze() reads a cached result itself; only the rest goes to the worker processes.
    cached = {k: analyze(*jobs[k]) for k in jobs if os.path.exists(os.path.join(cache_dir(), k + ".json"))}
    todo = [k for k in jobs if k not in cached]
    workers = max(1, min(len(todo), workers or os.cpu_count() or 1))
    if workers == 1 or len(todo) <= 1:
        fresh = {k: analyze(*jobs[k]) for k in todo}
    else:
        with ProcessPoolExecutor(workers, initializer=_worker_init, initargs=(collect,)) as pool:
            fresh = dict(zip(todo, pool.map(_worker_analyze, todo)))
    return {**cached, **fresh}


def analyze_in_subprocess(module: str, args=(), timeout: float = 3600) -> dict:
    """``python -m <module> --json <args>`` with TRITON_INTERPRET=0 and the JSON it prints (for
    tests running under the interpreter)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = subprocess.run([sys.executable, "-m", module, "--json", *args], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=root)
    if out.returncode != 0:
        raise RuntimeError(f"{module} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)
