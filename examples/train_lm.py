"""Train a small reversible GPT on real text that is available offline: the Python standard
library's own source files, byte by byte (vocabulary 256).

The same run is repeated with the stored-activation model of identical architecture, initial
weights and batches (plain autograd), and the two loss curves are compared step by step. With
exact streams (the default) the two compute the same rounded function with the same float
summation order, so they train identically, loss for loss; ``--baseline float`` compares with
plain float streams instead (what the fixed-point rounding itself changes).

    python examples/train_lm.py                 # both runs: ~4 min on one CPU core
    python examples/train_lm.py --smoke         # a few steps (used by the tests)
    python examples/train_lm.py --style llama   # RMSNorm, SwiGLU, RoPE, grouped-query attention
    python examples/train_lm.py --baseline float  # compare with float streams
"""
from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

from loss_curves import add_common_args, autocast, compare_curves, stored_activation_baseline  # examples/
from revtriton.models import GPTConfig, RevGPT, count_parameters
from revtriton.profiling import peak_memory, saved_bytes


def stdlib_text(max_bytes: int) -> bytes:
    """Concatenated .py files of the running Python's standard library (sorted, so reproducible)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if size == 0:
        raise RuntimeError(f"no Python sources found under {root}")
    return b"\n".join(chunks)[:max_bytes]


def get_batch(data: torch.Tensor, batch: int, seq: int, seed: int):
    """A deterministic batch of (inputs, next-byte targets) for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    window = torch.stack([data[s: s + seq + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def train(model, data, args, desc):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, tokens, elapsed = [], 0, 0.0
    bar = tqdm(range(args.steps), desc=desc, disable=args.no_bar, dynamic_ncols=True)
    for step in bar:
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        lr *= 0.5 * (1 + math.cos(math.pi * step / args.steps)) if args.cosine else 1.0
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = get_batch(data, args.batch, args.seq, seed=args.seed * 100_000 + step)
        start = time.perf_counter()
        with autocast(args):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step > 0:  # step 0 pays one-time start-up costs
            elapsed += time.perf_counter() - start
            tokens += x.numel()
        losses.append(loss.item())
        if args.no_bar and (step % 50 == 0 or step == args.steps - 1):
            print(f"{desc} step {step}: loss {losses[-1]:.4f}", flush=True)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens / max(elapsed, 1e-9):,.0f}")
    return losses, tokens / max(elapsed, 1e-9)


def memory(model, data, args):
    """(peak bytes of one training step, bytes the forward keeps for backward)."""
    x, y = get_batch(data, args.batch, args.seq, seed=123_456_789)

    def loss():
        with autocast(args):
            return model(x, y)[1]

    def step():
        model.zero_grad(set_to_none=True)
        loss().backward()

    peak = peak_memory(step)
    kept = saved_bytes(loss, module=model)
    model.zero_grad(set_to_none=True)
    return peak, kept


@torch.no_grad()
def evaluate(model, data, args, batches=8):
    model.eval()
    with autocast(args):
        total = sum(model(*get_batch(data, args.batch, args.seq, seed=10**9 + i))[1].item() for i in range(batches))
    model.train()
    return total / batches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--style", choices=["gpt2", "llama"], default="gpt2",
                        help="gpt2: LayerNorm, GELU MLP, learned positions; llama: RMSNorm, SwiGLU, RoPE, "
                             "grouped-query attention")
    parser.add_argument("--steps", type=int, default=300, help="training steps (each model)")
    parser.add_argument("--batch", type=int, default=16, help="sequences a batch")
    parser.add_argument("--seq", type=int, default=128, help="bytes a sequence (the context length)")
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--depth", type=int, default=6, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=30, help="steps of linear learning-rate warm-up")
    parser.add_argument("--cosine", action="store_true", help="cosine decay after warmup")
    parser.add_argument("--float-streams", action="store_true", help="exact=False (default: exact int32 streams)")
    parser.add_argument("--data-bytes", type=int, default=4_000_000,
                        help="bytes of standard-library source to train on")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and batches (both models get the same)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add_common_args(parser)
    parser.add_argument("--no-bar", action="store_true", help="no progress bar: a line every 50 steps instead")
    parser.add_argument("--smoke", action="store_true", help="a few small steps (tests)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # 1 avoids thread oversubscription on a busy machine
    if args.smoke:
        args.steps, args.batch, args.seq, args.depth, args.dim, args.data_bytes = 4, 4, 64, 2, 64, 200_000
        args.warmup = 2

    torch.manual_seed(args.seed)
    text = stdlib_text(args.data_bytes)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(0.9 * data.numel())
    train_data, val_data = data[:split], data[split:]
    config = GPTConfig(style=args.style, vocab_size=256, block_size=args.seq, dim=args.dim, depth=args.depth,
                       heads=args.heads, kv_heads=args.heads // 2 if args.style == "llama" else None)
    model = RevGPT(config, exact=not args.float_streams)
    baseline = stored_activation_baseline(model, args.baseline)
    precision = ", bf16 autocast" if args.bf16 else ""
    print(f"data: {len(text):,} bytes of {sysconfig.get_paths()['stdlib']}/*.py; model: {args.style}, "
          f"{count_parameters(model):,} parameters, {args.depth} blocks, dim {args.dim}, "
          f"{'float' if args.float_streams else 'exact'} streams, {args.baseline} baseline{precision}; "
          f"torch threads: {torch.get_num_threads()}")

    results = {}
    for name, m in (("reversible", model), ("stored-activation", baseline)):
        losses, tokens_per_s = train(m, train_data, args, name)
        peak, kept = memory(m, train_data, args)
        results[name] = dict(losses=losses, tokens_per_s=tokens_per_s, peak=peak, kept=kept,
                             val=evaluate(m, val_data, args))

    mib = 2.0**20
    print(f"\n{'model':<18} {'final loss':>10} {'val loss':>9} {'tokens/s':>9} {'peak MiB':>9} {'kept MiB':>9}")
    for name, r in results.items():
        print(f"{name:<18} {r['losses'][-1]:>10.4f} {r['val']:>9.4f} {r['tokens_per_s']:>9,.0f} "
              f"{r['peak'] / mib:>9.1f} {r['kept'] / mib:>9.2f}")
    rev, ref = results["reversible"]["losses"], results["stored-activation"]["losses"]
    title = f"{args.style} on stdlib bytes: reversible vs stored ({args.baseline} baseline{precision})"
    track = compare_curves(rev, ref, args, title)
    return 1 if args.strict and not track else 0


if __name__ == "__main__":
    raise SystemExit(main())
