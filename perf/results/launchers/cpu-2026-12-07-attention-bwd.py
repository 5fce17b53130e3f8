import os, sys, cProfile, pstats, time, statistics
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
torch.set_num_threads(1)
from perf import launchers
from revtriton.ops import backend, dispatch
which = tuple(sys.argv[1].split("/")) if len(sys.argv) > 1 else ("gpt2", "G", "float")
calls = launchers.cases(torch.device("cpu"))
with dispatch.force_triton(), backend.use_timer(launchers._prefer_triton):
    for c in calls.values(): c()
    with launchers.stubbed_launches():
        call = calls[which]
        for _ in range(50): call()
        ts = []
        for _ in range(300):
            b = time.perf_counter(); call(); ts.append((time.perf_counter() - b) * 1e6)
        print(which, "median us", statistics.median(ts))
        if "prof" in sys.argv:
            pr = cProfile.Profile(); pr.enable()
            for _ in range(2000): call()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(30)
