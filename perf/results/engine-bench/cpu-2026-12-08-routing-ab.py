"""The RNG routing's host cost, old (a TorchDispatchMode, every aten op) against new (a TorchFunctionMode,
every torch call), alternating in one process: the host rows' generic halves + nn.Dropout(0.1) at depth 24,
width 16, 4 tokens, one thread (perf/engine_bench --host's row), each step timed, medians of rounds.

    PYTHONPATH=. python perf/results/engine-bench/cpu-2026-12-08-routing-ab.py OLD_REPLAY_PY

OLD_REPLAY_PY: engine/replay.py of the code before (git show 675a833:revtriton/engine/replay.py)."""
import importlib.util
import statistics
import sys
import time

import torch

from perf.engine_bench import HOST_DIM, HOST_TOKENS, build_host
from revtriton.engine import replay

torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("revtriton.engine._replay_before", sys.argv[1])
before = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
routings = {"dispatch mode (before)": before._RoutedToHalf, "function mode (after)": replay._RoutedToHalf}
x = torch.randn(1, HOST_TOKENS, 2 * HOST_DIM, requires_grad=True)
grad = torch.randn_like(x)
models = {"plain": build_host("generic+dropout", "plain", 24)}
models.update({name: build_host("generic+dropout", "revtriton-float", 24) for name in routings})


def step(model):
    model.zero_grad(set_to_none=False)
    x.grad = None
    model(x).backward(grad)


times = {name: [] for name in models}
for name, model in models.items():  # warm-up: the probe, then steps as planned
    if name in routings:
        replay._RoutedToHalf = routings[name]
    for _ in range(5):
        step(model)
for r in range(15):
    for name, model in models.items():
        if name in routings:
            replay._RoutedToHalf = routings[name]
        begin = time.perf_counter()
        for _ in range(10):
            step(model)
        times[name].append((time.perf_counter() - begin) / 10 * 1e3)
plain = statistics.median(times["plain"])
for name, t in times.items():
    m = statistics.median(t)
    over = (m - plain) / 24 * 1e3
    print(f"{name:24s} {m:7.2f} ms a step  {m / plain:5.3f}x plain  {over:7.0f} us a block over plain")
