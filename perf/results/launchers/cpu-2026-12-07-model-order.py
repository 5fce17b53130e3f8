# The forward couples of 12 blocks in a model's order, launches stubbed (perf/README.md, "In a model's order").
# Run from the repository root: python perf/results/launchers/cpu-2026-12-07-model-order.py
import os, sys, time, gc, statistics, torch
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, ".")
torch.set_num_threads(1)
from revtriton.halves.base import couple_half
from revtriton.ops import backend, dispatch
from perf.stacks import PRESETS, make_halves
from perf.launchers import stubbed_launches, _prefer_triton, DIM, HEADS, TOKENS
DEPTH = 12
for family in ("gpt2", "llama"):
    torch.manual_seed(0)
    preset = PRESETS[family].scaled(dim=DIM, heads=HEADS, tokens=TOKENS)
    blocks = [make_halves(preset) for _ in range(DEPTH)]
    x = torch.randn(1, TOKENS, DIM); res = torch.randn_like(x)
    fixed = torch.randint(-2**20, 2**20, x.shape, dtype=torch.int32)
    def forward(frac_bits=None, r=None):
        with torch.no_grad():
            for f, g in blocks:
                couple_half(f, r, x, 1, frac_bits); couple_half(g, r, x, 1, frac_bits)
    with dispatch.force_triton(), backend.use_timer(_prefer_triton):
        forward(None, res); forward(16, fixed)
        with stubbed_launches() as count:
            for name, fb, r in (("float", None, res), ("exact", 16, fixed)):
                count[0] = 0; forward(fb, r); n = count[0]
                gc.collect(); gc.disable()
                ts = []
                for _ in range(200):
                    b = time.perf_counter(); forward(fb, r); ts.append((time.perf_counter() - b) * 1e6)
                gc.enable()
                m = statistics.median(ts)
                print(f"{family} {name}: {m:.0f} us for {2*DEPTH} couples, {n} launches: {m/n:.1f} us per launch, {m/DEPTH:.1f} per block")
