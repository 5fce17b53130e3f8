import os, time, statistics
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
torch.set_num_threads(1)
from perf import launchers
from revtriton.ops import backend, dispatch, fused_attention as fa
new = fa._split_heads
def old(qkv, batch, tokens, heads, kv_heads, head_dim):
    packed = qkv.view(batch, tokens, heads + 2 * kv_heads, head_dim)
    return packed[:, :, :heads], packed[:, :, heads:heads + kv_heads], packed[:, :, heads + kv_heads:]
calls = launchers.cases(torch.device("cpu"))
res = {("old", k): [] for k in ("float", "rebuild+backward")}
res.update({("new", k): [] for k in ("float", "rebuild+backward")})
with dispatch.force_triton(), backend.use_timer(launchers._prefer_triton):
    for c in calls.values(): c()
    with launchers.stubbed_launches():
        for rnd in range(40):
            for name, f in (("old", old), ("new", new)) if rnd % 2 else (("new", new), ("old", old)):
                fa._split_heads = f
                for kind in ("float", "rebuild+backward"):
                    call = calls[("gpt2", "F", kind)]
                    for _ in range(5): call()
                    ts = []
                    for _ in range(50):
                        b = time.perf_counter(); call(); ts.append(time.perf_counter() - b)
                    res[(name, kind)].append(statistics.median(ts) * 1e6)
for k, v in res.items():
    print(k, "median of round medians", round(statistics.median(v), 1))
