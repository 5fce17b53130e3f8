"""Shared by the training examples: compare the reversible and stored-activation loss curves."""


def compare_curves(rev, ref, window, tolerance, atol):
    """Print per-step and trailing-mean (the plotted loss curve) gaps; True if the curves agree within
    ``tolerance`` (relative) + ``atol`` (absolute, for losses near zero) at every step."""
    def trailing_mean(xs):
        return [sum(xs[max(0, i - window + 1): i + 1]) / len(xs[max(0, i - window + 1): i + 1]) for i in range(len(xs))]

    rev_curve, ref_curve = trailing_mean(rev), trailing_mean(ref)
    marks = sorted({0, len(rev) // 4, len(rev) // 2, 3 * len(rev) // 4, len(rev) - 1})
    print(f"{'step':<22}" + "  ".join(f"{s:>7}" for s in marks))
    for label, xs in (("rev: step loss", rev), ("stored: step loss", ref), (f"rev: mean of {window}", rev_curve),
                      (f"stored: mean of {window}", ref_curve)):
        print(f"{label:<22}" + "  ".join(f"{xs[s]:>7.4f}" for s in marks))
    for label, a, b in (("per step", rev, ref), (f"curve (trailing mean of {window} steps)", rev_curve, ref_curve)):
        gaps = [abs(x - y) / y for x, y in zip(a, b)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        print(f"loss gap |rev - stored| / stored, {label}: max {gaps[worst]:.3%} (step {worst}), final {gaps[-1]:.3%}")
    return all(abs(x - y) <= tolerance * y + atol for x, y in zip(rev_curve, ref_curve))
