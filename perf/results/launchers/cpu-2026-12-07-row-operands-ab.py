import os, sys, time, statistics, gc
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
torch.set_num_threads(1)
from perf import launchers
from revtriton.ops import backend, dispatch
calls = launchers.cases(torch.device("cpu"))
keys = [("gpt2","G","float"),("gpt2","F","float"),("llama","G","float"),("llama","F","float"),("gpt2","G","exact"),("llama","G","rebuild+backward")]
out = {}
with dispatch.force_triton(), backend.use_timer(launchers._prefer_triton):
    for c in calls.values(): c()
    with launchers.stubbed_launches():
        gc.disable()
        for k in keys:
            call = calls[k]
            for _ in range(50): call()
            ts = []
            for _ in range(400):
                b = time.perf_counter(); call(); ts.append((time.perf_counter() - b) * 1e6)
            out["/".join(k)] = statistics.median(ts)
print(" ".join(f"{k}={v:.1f}" for k, v in out.items()))
