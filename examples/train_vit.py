"""Train a small reversible ViT (or RevMViT) on real images available offline: scikit-learn's
bundled handwritten digits (1,797 grey 8x8 images, 10 classes).

The same run is repeated with the stored-activation model of identical architecture, initial
weights and batches (plain autograd), and the two loss curves are compared step by step. With
exact streams (the default) the two compute the same rounded function with the same float
summation order, so they train identically, loss for loss; ``--baseline float`` compares with
plain float streams instead (what the fixed-point rounding itself changes).

    python examples/train_vit.py                  # RevViT, both runs: ~1 min on one CPU core
    python examples/train_vit.py --model mvit     # multiscale: reversible stages + stage transitions
    python examples/train_vit.py --baseline float # compare with float streams
    python examples/train_vit.py --smoke          # a few steps (used by the tests)
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from loss_curves import add_common_args, autocast, compare_curves, stored_activation_baseline  # examples/
from revtriton.models import RevViT, count_parameters, rev_mvit
from revtriton.profiling import peak_memory, saved_bytes


def load_digits_tensors(seed: int):
    """(train images, train labels, test images, test labels); images [N, 1, 8, 8] scaled to [-1, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test, train = order[:297], order[297:]
    return images[train], labels[train], images[test], labels[test]


def get_batch(images, labels, batch: int, seed: int):
    index = torch.randint(0, len(labels), (batch,), generator=torch.Generator().manual_seed(seed))
    return images[index], labels[index]


def build(args):
    exact = not args.float_streams
    if args.model == "mvit":
        return rev_mvit("xs", img_size=8, in_chans=1, num_classes=10, patch_kernel=3, patch_stride=1,
                        drop_path_rate=args.drop_path, exact=exact)
    return RevViT(img_size=8, patch_size=2, in_chans=1, num_classes=10, dim=args.dim, depth=args.depth,
                  heads=args.heads, drop_path_rate=args.drop_path, exact=exact)


def train(model, data, args, desc):
    images, labels = data
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    losses, seen, elapsed = [], 0, 0.0
    bar = tqdm(range(args.steps), desc=desc, disable=args.no_bar, dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        x, y = get_batch(images, labels, args.batch, seed=args.seed * 100_000 + step)
        torch.manual_seed(args.seed * 100_000 + step)  # same drop-path draws for both models
        start = time.perf_counter()
        with autocast(args):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step > 0:  # step 0 pays one-time start-up costs
            elapsed += time.perf_counter() - start
            seen += len(y)
        losses.append(loss.item())
        if args.no_bar and (step % 50 == 0 or step == args.steps - 1):
            print(f"{desc} step {step}: loss {losses[-1]:.4f}", flush=True)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", img_s=f"{seen / max(elapsed, 1e-9):,.0f}")
    return losses, seen / max(elapsed, 1e-9)


def memory(model, data, args):
    """(peak bytes of one training step, bytes the forward keeps for backward)."""
    x, y = get_batch(*data, args.batch, seed=123_456_789)

    def loss():
        with autocast(args):
            return F.cross_entropy(model(x), y)

    def step():
        model.zero_grad(set_to_none=True)
        loss().backward()

    peak = peak_memory(step)
    kept = saved_bytes(loss, module=model)
    model.zero_grad(set_to_none=True)
    return peak, kept


@torch.no_grad()
def accuracy(model, images, labels, args):
    model.eval()
    with autocast(args):
        correct = (model(images).argmax(-1) == labels).float().mean().item()
    model.train()
    return correct


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["vit", "mvit"], default="vit",
                        help="vit: RevViT; mvit: RevMViT (reversible stages joined by stage transitions)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (each model)")
    parser.add_argument("--batch", type=int, default=128, help="images a batch")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--depth", type=int, default=6, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    parser.add_argument("--drop-path", type=float, default=0.1,
                        help="stochastic depth rate (both models draw the same masks)")
    parser.add_argument("--float-streams", action="store_true", help="exact=False (default: exact int32 streams)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data split, weights and batches (both models get the same)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add_common_args(parser)
    parser.add_argument("--no-bar", action="store_true", help="no progress bar: a line every 50 steps instead")
    parser.add_argument("--smoke", action="store_true", help="a few small steps (tests)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # 1 avoids thread oversubscription on a busy machine
    if args.smoke:
        args.steps, args.batch, args.depth, args.dim, args.warmup = 4, 16, 2, 32, 2

    train_x, train_y, test_x, test_y = load_digits_tensors(args.seed)
    torch.manual_seed(args.seed)
    model = build(args)
    baseline = stored_activation_baseline(model, args.baseline)
    precision = ", bf16 autocast" if args.bf16 else ""
    print(f"data: scikit-learn digits, {len(train_y)} train / {len(test_y)} test images (8x8); model: {args.model}, "
          f"{count_parameters(model):,} parameters, {'float' if args.float_streams else 'exact'} streams, "
          f"{args.baseline} baseline{precision}; "
          f"torch threads: {torch.get_num_threads()}")

    results = {}
    for name, m in (("reversible", model), ("stored-activation", baseline)):
        losses, images_per_s = train(m, (train_x, train_y), args, name)
        peak, kept = memory(m, (train_x, train_y), args)
        results[name] = dict(losses=losses, images_per_s=images_per_s, peak=peak, kept=kept,
                             acc=accuracy(m, test_x, test_y, args))

    mib = 2.0**20
    print(f"\n{'model':<18} {'final loss':>10} {'test acc':>9} {'images/s':>9} {'peak MiB':>9} {'kept MiB':>9}")
    for name, r in results.items():
        print(f"{name:<18} {r['losses'][-1]:>10.4f} {r['acc']:>9.3f} {r['images_per_s']:>9,.0f} "
              f"{r['peak'] / mib:>9.1f} {r['kept'] / mib:>9.2f}")
    rev, ref = results["reversible"]["losses"], results["stored-activation"]["losses"]
    title = f"{args.model} on digits: reversible vs stored ({args.baseline} baseline{precision})"
    track = compare_curves(rev, ref, args, title)
    return 1 if args.strict and not track else 0


if __name__ == "__main__":
    raise SystemExit(main())
