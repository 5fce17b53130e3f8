"""``python -m perf.kernels_attention``: flash attention and the fused attention block on a GPU.

Cases (bf16): ViT-B-like (dim 768, 12 heads, 197 tokens, full attention), GPT-2-like
(dim 768, 12 heads, 1024 tokens, causal), LLaMA-like (head dim 128, 4096 tokens, causal) and
Phi-like (head dim 80: a padded head). For each:

* flash attention forward and backward (revtriton.ops.fused_attention) in TFLOP/s against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same q, k, v with its flash backend
  (bar: >= 0.9 x);
* for the first two, a whole fused block (F = LayerNormAttention, G = LayerNormMLP, exact streams) forward
  (two couple calls) and backward (recompute with grad + the two half backwards), against the
  same block in PyTorch eager ops (the reference path run on the GPU, float streams).

Writes one CSV row per measurement with the GPU name (``--csv``). Without a CUDA GPU there is
nothing to measure: the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

CASES = {  # name: (batch, tokens, dim, heads, causal, whole-block benchmark too)
    "vit-b": (64, 197, 768, 12, False, True),
    "gpt2": (8, 1024, 768, 12, True, True),
    "llama-d128": (2, 4096, 4096, 32, True, False),
    "phi-d80": (4, 2048, 2560, 32, True, False),
}
BAR_ATTENTION = 0.9


def attention_flops(batch, tokens, heads, head_dim, causal, backward=False):
    """2 GEMMs of 2*T*T*D flops per head forward, 5 in backward (dq, dk, dv, dp, and the recomputed s)."""
    flops = 4 * batch * heads * tokens * tokens * head_dim * (2.5 if backward else 1.0)
    return flops / 2 if causal else flops


def _bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)  # ms


def bench_attention(name, batch, tokens, dim, heads, causal, device):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from revtriton.ops import fused_attention as fa

    head_dim = dim // heads
    qkv = torch.randn(batch, tokens, 3 * heads, head_dim, device=device, dtype=torch.bfloat16)
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads:2 * heads], qkv[:, :, 2 * heads:]
    o, lse = fa.attention_fwd(q, k, v, causal=causal)
    do = torch.randn_like(o)
    rows = []
    ms = _bench(lambda: fa.attention_fwd(q, k, v, causal=causal))
    rows.append((name, "attention_fwd", "revtriton", ms, attention_flops(batch, tokens, heads, head_dim, causal)))
    ms = _bench(lambda: fa.attention_bwd(q, k, v, o, lse, do, causal=causal))
    rows.append((name, "attention_bwd", "revtriton", ms,
                 attention_flops(batch, tokens, heads, head_dim, causal, backward=True)))

    qh, kh, vh = (t.transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = _bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal))
        rows.append((name, "attention_fwd", "sdpa", ms, attention_flops(batch, tokens, heads, head_dim, causal)))
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
        doh = torch.randn_like(out)
        ms = _bench(lambda: torch.autograd.grad(out, (qh, kh, vh), doh, retain_graph=True))
    rows.append((name, "attention_bwd", "sdpa", ms,
                 attention_flops(batch, tokens, heads, head_dim, causal, backward=True)))
    return rows


def bench_block(name, batch, tokens, dim, heads, causal, device):
    from revtriton import LayerNormAttention, LayerNormMLP
    from revtriton.ops import attention as ref_attention
    from revtriton.ops import mlp as ref_mlp
    from revtriton.ops.streams import to_fixed

    f = LayerNormAttention(dim, heads, causal=causal).to(device)
    g = LayerNormMLP(dim, 4 * dim).to(device)
    x1, x2 = torch.randn(2, batch, tokens, dim, device=device).unbind(0)
    s1, s2 = to_fixed(x1, 16), to_fixed(x2, 16)
    dy1, dy2 = torch.randn_like(x1), torch.randn_like(x2)
    amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731

    def fused_forward():
        with torch.no_grad(), amp():
            y1, _ = f.couple(s1, x2, 1, 16)
            y2, _ = g.couple(s2, y1.float() * 2.0**-16, 1, 16)
        return y1, y2

    def fused_backward():  # recover + grads of one block, as the engine runs it
        with amp():
            y1v = x1.detach().requires_grad_(True)
            r2, port_g = g.couple(s2, y1v, -1, 16)
            x2v = (r2.float() * 2.0**-16).requires_grad_(True)
            _, port_f = f.couple(s1, x2v, -1, 16)
        torch.autograd.backward(port_g, -dy2)
        torch.autograd.backward(port_f, -(dy1 + y1v.grad))

    def eager_h_f(x):
        return ref_attention.norm_attention_reference(x, f.norm.weight, f.norm.bias, f.qkv.weight, f.qkv.bias,
                                                      f.proj.weight, f.proj.bias, heads=heads, causal=causal)

    def eager_h_g(x):
        return ref_mlp.norm_mlp_reference(x, g.norm.weight, g.norm.bias, g.fc1.weight, g.fc1.bias, g.fc2.weight,
                                          g.fc2.bias, activation=g.activation)

    def eager_forward():
        with torch.no_grad(), amp():
            y1 = x1 + eager_h_f(x2)
            return y1, x2 + eager_h_g(y1)

    def eager_backward():
        with amp():
            a = x2.detach().requires_grad_(True)
            y1 = x1 + eager_h_f(a)
            y2 = a + eager_h_g(y1)
        torch.autograd.backward((y1, y2), (dy1, dy2))

    rows = []
    for label, fn in (("fused", fused_forward), ("eager", eager_forward)):
        rows.append((name, "block_fwd", label, _bench(fn), 0.0))
    for label, fn in (("fused", fused_backward), ("eager", eager_backward)):
        rows.append((name, "block_bwd", label, _bench(fn), 0.0))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m perf.kernels_attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    ap.add_argument("--csv", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("perf.kernels_attention needs a CUDA GPU (none found): nothing measured.")
        return 0
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    print(f"perf.kernels_attention on {gpu}")
    rows = []
    for name in args.cases.split(","):
        batch, tokens, dim, heads, causal, block = CASES[name]
        rows += bench_attention(name, batch, tokens, dim, heads, causal, device)
        if block:
            rows += bench_block(name, batch, tokens, dim, heads, causal, device)
    by_key = {(r[0], r[1], r[2]): r for r in rows}
    print(f"{'case':10s} {'what':14s} {'impl':10s} {'ms':>9s} {'TFLOP/s':>8s} {'vs baseline':>11s}")
    for case, what, impl, ms, flops in rows:
        base = by_key.get((case, what, "sdpa" if what.startswith("attention") else "eager"))
        ratio = base[3] / ms if base is not None else float("nan")
        tflops = flops / ms / 1e9 if flops else float("nan")
        print(f"{case:10s} {what:14s} {impl:10s} {ms:9.3f} {tflops:8.1f} {ratio:11.2f}")
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["gpu", "case", "what", "impl", "ms", "tflops"])
            for case, what, impl, ms, flops in rows:
                writer.writerow([gpu, case, what, impl, f"{ms:.4f}", f"{flops / ms / 1e9:.2f}" if flops else ""])
    return 0


if __name__ == "__main__":
    sys.exit(main())
