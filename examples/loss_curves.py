"""Shared by the training examples: options, the stored-activation baseline, the loss-curve comparison."""
import copy

import torch

from revtriton.engine import ReversibleStack
from revtriton.models import to_stored_activations

BASELINES = ("same", "float")


def add_common_args(parser):
    parser.add_argument("--bf16", action="store_true", help="forward under bf16 autocast (both models)")
    parser.add_argument("--baseline", choices=BASELINES, default="same",
                        help="stored-activation baseline: 'same' is the identical model (with exact streams, the "
                             "same rounded function), 'float' has plain float streams (shows what the rounding "
                             "itself changes)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="relative gap the two losses must stay within at every step")
    parser.add_argument("--atol", type=float, default=0.0,
                        help="absolute slack of that check (relative gaps mean little as a loss nears zero)")
    parser.add_argument("--window", type=int, default=0, help="steps in the curves' trailing mean (0: steps / 15)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the losses do not stay within it")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write both loss curves to this image")


def autocast(args):
    """The forward's precision: bf16 autocast with --bf16 (the engine restores it in its recompute)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)


def stored_activation_baseline(model, baseline: str):
    """A copy of ``model`` (same weights) trained with plain autograd instead of reversible backward."""
    twin = to_stored_activations(copy.deepcopy(model))
    if baseline == "float":
        for module in twin.modules():
            if isinstance(module, ReversibleStack):
                module.exact = False
    return twin


def trailing_mean(xs, window):
    return [sum(xs[max(0, i - window + 1): i + 1]) / len(xs[max(0, i - window + 1): i + 1]) for i in range(len(xs))]


def plot_curves(rev, ref, window, path, title):
    """Step losses (faint) and their trailing means of both runs, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for losses, label, color, style in ((ref, "stored-activation", "tab:blue", "-"),
                                        (rev, "reversible", "tab:orange", "--")):
        ax.plot(losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(trailing_mean(losses, window), color=color, linestyle=style, label=f"{label} (mean of {window})")
    ax.set(xlabel="step", ylabel="training loss", yscale="log", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curves written to {path}")


def compare_curves(rev, ref, args, title="reversible vs stored-activation"):
    """Print per-step and trailing-mean (the plotted loss curve) gaps; return whether the per-step losses
    agree within ``args.tolerance`` (relative) + ``args.atol`` at every step, as printed."""
    window = args.window or max(1, len(rev) // 15)
    rev_curve, ref_curve = trailing_mean(rev, window), trailing_mean(ref, window)
    marks = sorted({0, len(rev) // 4, len(rev) // 2, 3 * len(rev) // 4, len(rev) - 1})
    print(f"{'step':<22}" + "  ".join(f"{s:>7}" for s in marks))
    for label, xs in (("rev: step loss", rev), ("stored: step loss", ref), (f"rev: mean of {window}", rev_curve),
                      (f"stored: mean of {window}", ref_curve)):
        print(f"{label:<22}" + "  ".join(f"{xs[s]:>7.4f}" for s in marks))
    for label, a, b in (("per step", rev, ref), (f"curve (trailing mean of {window} steps)", rev_curve, ref_curve)):
        gaps = [abs(x - y) / y for x, y in zip(a, b)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        print(f"loss gap |rev - stored| / stored, {label}: max {gaps[worst]:.3%} (step {worst}), final {gaps[-1]:.3%}")
    identical = sum(x == y for x, y in zip(rev, ref))
    print(f"identical losses: {identical} of {len(rev)} steps")
    track = all(abs(x - y) <= args.tolerance * y + args.atol for x, y in zip(rev, ref))
    slack = f" + {args.atol}" if args.atol else ""
    print(f"losses within {args.tolerance:.1%}{slack} at every step: {'yes' if track else 'NO'}")
    if args.plot:
        plot_curves(rev, ref, window, args.plot, title)
    return track
