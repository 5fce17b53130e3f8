"""Checks shared by the launch-plan tests (issue 44 step 5: ops.launches.LaunchPlan)."""
import torch


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view of its shape whose rows lie three times as far apart."""
    wide = torch.empty(*t.shape[:-1], 3 * t.shape[-1], dtype=t.dtype)
    view = wide[..., t.shape[-1]:2 * t.shape[-1]]
    view.copy_(t)
    return view


def assert_kept_plans_change_nothing(plans, calls):
    """Each call made with no plan kept (``plans`` cleared first), then all of them one after the
    other, twice, each finding the plans the earlier calls kept: bitwise the same results."""
    fresh = []
    for call in calls:
        plans.clear()
        fresh.append(call())
    for _ in range(2):
        for call, want in zip(calls, fresh):
            got = call()
            assert len(got) == len(want)
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
