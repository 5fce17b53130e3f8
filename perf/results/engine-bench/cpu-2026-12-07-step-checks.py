"""The per-step host work of issue 44's stack-level checks and block phases, timed alone (timeit, one thread):
the host rows' generic stack at depth 24 (265 modules, 240 parameter slots). Run from a checkout's root:
``PYTHONPATH=. python perf/results/engine-bench/cpu-2026-12-07-step-checks.py``; the .txt beside it holds
its runs on the code before the checks' change (1361571), between the two changes (47574cc) and after (9ff6048, the engine as at 6c12648)."""
import timeit

import torch

from perf.engine_bench import build_host
from revtriton.engine import plan as P
from revtriton.engine import state as S
from revtriton.engine.fsdp import PhaseResult, run_block_phase

torch.set_num_threads(1)
stack = build_host("generic", "revtriton-float", 24)
plan = P.plan_of(stack)
segment = next(part for kind, _, part in plan.parts if kind == "segment")
watch = S.StateWatch(segment)
watch.record_versions()
block = next(iter(stack._modules.values()))


def work(f, g):
    return (PhaseResult(None),)


def us(fn, n=2000):
    fn()
    return timeit.timeit(fn, number=n) / n * 1e6


rows = {"plan_of (the plan's validity)": lambda: P.plan_of(stack), "StateWatch()": lambda: S.StateWatch(segment),
        "record_versions": watch.record_versions, "StateWatch.check": watch.check,
        "run_block_phase (one phase)": lambda: run_block_phase(block, work),
        "coupling_halves": block.coupling_halves}
for name, fn in rows.items():
    print(f"{name:32s} {us(fn):8.2f} us")
per_step = us(rows["plan_of (the plan's validity)"]) + us(rows["StateWatch()"]) + us(rows["record_versions"]) \
    + us(rows["StateWatch.check"])
print(f"{'checks a step (the four above)':32s} {per_step:8.2f} us")
