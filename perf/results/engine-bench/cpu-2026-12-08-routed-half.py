"""One generic G half (LayerNorm, Linear, GELU, Linear, nn.Dropout(0.1); width 16, 4 tokens, one thread)
as the engine runs a half that draws with no generator: plain, recorded (its forward under the RNG
routing mode) and replayed (its recompute), beside a CPU generator state swap and a fork; medians of
20 rounds of 300 calls, each round every case once (perf/README, host rows).

    PYTHONPATH=. python perf/results/engine-bench/cpu-2026-12-08-routed-half.py"""
import statistics
import time

import torch
from torch import nn

from revtriton.engine.replay import HalfRandomness

torch.set_num_threads(1)
half = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.Dropout(0.1))
x = torch.randn(1, 4, 16)
sink = []
with HalfRandomness.recorded(sink, "routed"):
    half(x)
draws = sink[0]
generator, default = torch.Generator(), torch.default_generator


def plain():
    half(x)


def recorded():
    with HalfRandomness.recorded([], "routed"):
        half(x)


def replayed():
    with HalfRandomness.replayed(draws):
        half(x)


def state_swap():  # _with_global_generator's CPU path
    saved = default.get_state()
    default.set_state(generator.get_state())
    generator.set_state(default.get_state())
    default.set_state(saved)


def fork():
    generator.clone_state()


cases = [plain, recorded, replayed, state_swap, fork]
times = {case.__name__: [] for case in cases}
for _ in range(20):
    for case in cases:
        begin = time.perf_counter()
        for _ in range(300):
            case()
        times[case.__name__].append((time.perf_counter() - begin) / 300 * 1e6)
for name, values in times.items():
    print(f"{statistics.median(values):8.1f} us  {name}")
