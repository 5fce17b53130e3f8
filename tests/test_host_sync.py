"""Host syncs, counted on CPU (issue 21): the README promises one sync per forward (the guards)
and one per backward (the checksum), none per block.

A host sync is what ``.item()``, ``bool()``, ``int()``, ``if tensor:`` and friends do
(``aten._local_scalar_dense``) and what ops with a data-dependent output shape do (``nonzero``,
``masked_select``, ``unique``...). A TorchDispatchMode sees every one of them on CPU too, where
``torch.cuda.synchronize`` is never called. tests/test_gpu.py checks the same on a GPU with
``torch.cuda.set_sync_debug_mode("error")``.
"""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from revtriton import engine
from test_pareprop import build

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "masked_scatter", "unique_consecutive", "_unique",
           "_unique2", "unique_dim", "repeat_interleave", "is_nonzero", "item", "nonzero_numpy", "argwhere"}


class CountSyncs(TorchDispatchMode):
    """Counts the host-syncing ops dispatched inside the block (by name)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING or (name == "index" and self._bool_index(args)):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _bool_index(args):
        """t[mask] with a bool mask: the result's size depends on the data (a sync)."""
        indices = args[1] if len(args) > 1 else []
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)

    def total(self):
        return sum(self.counts.values())


def test_the_counter_sees_item_bool_and_nonzero():
    t = torch.ones(3)
    with CountSyncs() as syncs:
        t.sum().item()
        bool(t.sum() > 0)
        _ = int(t[0])
        t.nonzero()
        t[t > 0]
    assert syncs.counts["_local_scalar_dense"] == 3 and syncs.counts["nonzero"] == 1 and syncs.total() >= 5


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
def test_one_sync_per_forward_and_backward_whatever_the_depth(seeded, schedule, exact, monkeypatch):
    inside = []
    real = engine.segment.run_backward_schedule

    def counted_schedule(*args, **kwargs):  # the per-block part of the backward: no sync at all
        with CountSyncs() as syncs:
            result = real(*args, **kwargs)
        inside.append(syncs.counts)
        return result

    monkeypatch.setattr(engine.segment, "run_backward_schedule", counted_schedule)
    dtype = torch.float32 if exact else torch.float64
    for depth in (1, 6):
        stack = build(depth, schedule, exact, transition=depth > 3, seed=seeded)
        x = torch.randn(2, 3, 12, dtype=dtype, requires_grad=True)
        with CountSyncs() as forward:
            loss = stack(x).square().sum()
        with CountSyncs() as backward:
            loss.backward()
        assert x.grad is not None and all(p.grad is not None for p in stack.parameters())
        assert forward.total() == (1 if exact else 0), (depth, forward.counts)
        assert backward.total() == (1 if exact else 0), (depth, backward.counts)
        assert inside and all(not counts for counts in inside), (depth, inside)
        inside.clear()
