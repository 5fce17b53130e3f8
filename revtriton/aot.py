"""Ahead-of-time compilation checks of the Triton kernels, for sm_90 and sm_80, without a GPU.

``triton.compile`` builds PTX and a cubin on a CPU-only machine with the ptxas shipped in the
triton wheel; ``cuobjdump --dump-resource-usage`` (also in the wheel) reports registers, stack
and local memory per kernel. Each fused ops module exposes ``aot_specs() -> list[AotSpec]``:
every kernel variant it launches x every autotune config of the arch that would run it.

What counts as a spill: any local memory (``LOCAL > 0``; ptxas puts spilled registers in local
memory). A non-zero ``STACK`` alone is not a spill: it is the ABI call stack (e.g. the frame of a
non-inlined helper), and stays in L1. A config that needs both many registers and stack is
suspect, so :func:`check` also reports the stack and tests bound it.

The interpreter (``TRITON_INTERPRET=1``) replaces @triton.jit functions, so compilation runs in
a subprocess without it: ``python -m revtriton.aot [--json] [--filter NAME]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

ARCHS = (90, 80)


@dataclasses.dataclass(frozen=True)
class AotSpec:
    """One kernel variant compiled with one config for one arch.

    kernel: the @triton.jit function (an autotuned kernel is unwrapped); signature: every
    argument name -> "*fp16" / "i32" / "fp32" / "constexpr" ...; constexprs: the constexpr values
    (config meta-parameters included); divisible: arguments with tt.divisibility 16 (pointers
    and strides, as the launcher's specialization would see them); arch: the compute capability
    this config list belongs to.
    """
    name: str
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int
    expect_wgmma: bool = False
    arch: int = 90
    divisible: tuple = ()

    @property
    def label(self) -> str:
        return f"{self.name}@sm{self.arch}"


@dataclasses.dataclass
class AotResult:
    label: str
    arch: int
    registers: int
    stack: int
    local: int
    shared: int
    has_wgmma: bool
    expect_wgmma: bool
    seconds: float
    error: str | None = None

    @property
    def spills(self) -> bool:
        return self.local > 0


def _jit_function(kernel):
    """The JITFunction under autotune / heuristics wrappers."""
    from triton.runtime.jit import JITFunction

    fn = kernel
    while not isinstance(fn, JITFunction):
        if not hasattr(fn, "fn"):
            raise TypeError(f"{kernel!r} is not a @triton.jit kernel (is TRITON_INTERPRET set?)")
        fn = fn.fn
    return fn


def cuobjdump_path() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> dict:
    """registers / stack / shared / local bytes of the (single) kernel in a cubin, via cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump_path(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    match = _USAGE.search(out)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    reg, stack, shared, local = map(int, match.groups())
    return {"registers": reg, "stack": stack, "shared": shared, "local": local}


def compile_spec(spec: AotSpec, arch: int | None = None):
    """triton.compile the spec for ``GPUTarget("cuda", arch, 32)``; returns the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_function(spec.kernel)
    missing = [a for a in fn.arg_names if a not in spec.signature]
    if missing:
        raise ValueError(f"{spec.name}: signature lacks {missing}")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible}
    src = ASTSource(fn=fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    target = GPUTarget("cuda", spec.arch if arch is None else arch, 32)
    return triton.compile(src, target=target, options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})


def check(spec: AotSpec) -> AotResult:
    """Compile the spec for its arch and read its resource usage."""
    start = time.time()
    try:
        kernel = compile_spec(spec)
        usage = resource_usage(kernel.asm["cubin"])
        has_wgmma = "wgmma" in kernel.asm["ptx"]
        return AotResult(spec.label, spec.arch, usage["registers"], usage["stack"], usage["local"], usage["shared"],
                         has_wgmma, spec.expect_wgmma, time.time() - start)
    except Exception as e:  # reported, and a failure in the tests
        return AotResult(spec.label, spec.arch, -1, -1, -1, -1, False, spec.expect_wgmma, time.time() - start,
                         error=f"{type(e).__name__}: {e}"[:2000])


SPEC_MODULES = ("revtriton.ops.fused_mlp", "revtriton.ops.fused_attention")


def all_specs() -> list[AotSpec]:
    """Specs of every fused ops module that exists (fused_attention may not yet)."""
    specs = []
    for name in SPEC_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        if hasattr(module, "aot_specs"):
            specs.extend(module.aot_specs())
    labels = [s.label for s in specs]
    duplicates = {l for l in labels if labels.count(l) > 1}
    if duplicates:
        raise ValueError(f"duplicate AOT spec labels: {sorted(duplicates)}")
    return specs


def _check_label(label: str) -> dict:
    spec = next(s for s in all_specs() if s.label == label)
    return dataclasses.asdict(check(spec))


def run_all(pattern: str | None = None, workers: int | None = None) -> list[AotResult]:
    """Compile every spec (matching ``pattern``) in worker processes; needs TRITON_INTERPRET unset."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("AOT compilation needs TRITON_INTERPRET unset: use run_in_subprocess()")
    labels = [s.label for s in all_specs() if pattern is None or re.search(pattern, s.label)]
    workers = workers or max(1, min(len(labels), os.cpu_count() or 1))
    if workers == 1:
        return [AotResult(**_check_label(l)) for l in labels]
    with ProcessPoolExecutor(workers) as pool:
        return [AotResult(**r) for r in pool.map(_check_label, labels)]


def run_in_subprocess(pattern: str | None = None, timeout: float = 900) -> list[AotResult]:
    """run_all in a fresh interpreter with TRITON_INTERPRET=0 (for tests running under the interpreter)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "revtriton.aot", "--json"] + (["--filter", pattern] if pattern else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=root)
    if out.returncode != 0:
        raise RuntimeError(f"AOT subprocess failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return [AotResult(**r) for r in json.loads(out.stdout)]


def format_table(results: list[AotResult]) -> str:
    lines = [f"{'kernel@arch':58s} {'REG':>4s} {'STACK':>5s} {'LOCAL':>5s} {'SHARED':>7s} {'wgmma':>5s} {'s':>5s}"]
    for r in results:
        if r.error:
            lines.append(f"{r.label:58s} ERROR {r.error.splitlines()[0][:100]}")
            continue
        wgmma = ("yes" if r.has_wgmma else "NO") if r.expect_wgmma else ("yes" if r.has_wgmma else "-")
        lines.append(f"{r.label:58s} {r.registers:4d} {r.stack:5d} {r.local:5d} {r.shared:7d} {wgmma:>5s} "
                     f"{r.seconds:5.1f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--filter", default=None, help="regex on kernel@arch labels")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    results = run_all(args.filter, args.workers)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results]))
    else:
        print(format_table(results))
    bad = [r for r in results if r.error or r.spills or (r.expect_wgmma and not r.has_wgmma)]
    return 1 if bad and not args.json else 0


if __name__ == "__main__":
    sys.exit(main())
