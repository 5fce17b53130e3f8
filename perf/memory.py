"""Peak memory of a step for perf/: CUDA allocator statistics on a GPU, live tensor bytes on a CPU.

On a CPU there are no allocator statistics, and the profiler's allocation events
(``revtriton.profiling.profiler_peak_memory``) go through its private API and print to stderr on
every use. :class:`LiveBytes` (``revtriton.profiling``, where the tests and the engine benchmark
use it too) instead watches every op through a ``TorchDispatchMode``: each output whose storage is
new adds its bytes, and a ``weakref`` callback on that storage subtracts them when it is freed.
See ``revtriton.profiling`` for what it cannot see and how it compares with the profiler.
"""
from __future__ import annotations

from revtriton.profiling import LiveBytes, peak_memory

__all__ = ["LiveBytes", "peak_memory"]
