"""Host syncs and RNG-state reads, counted on CPU (issues 21, 44, 45): a training step (forward and
backward) of a stack makes no host sync and reads no RNG state, except the one sync at the end of
an exact stack's eager backward that resolves its checks (engine.checks); inside
``deferred_checks()`` not even that one, and ``check_step()`` is the one sync.

A host sync is what ``.item()``, ``bool()``, ``int()``, ``if tensor:`` and friends do
(``aten._local_scalar_dense``), what ops with a data-dependent output shape do (``nonzero``,
``masked_select``, ``unique``...), and comparisons that answer on the host (``equal``,
``allclose``). A TorchDispatchMode sees every one of them on CPU too, where
``torch.cuda.synchronize`` is never called. tests/test_gpu.py checks the same on a GPU with
``torch.cuda.set_sync_debug_mode("error")``.
"""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import revtriton
from revtriton import engine
from revtriton.halves.randomness import HalfGenerators
from test_pareprop import build

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "masked_scatter", "unique_consecutive", "_unique",
           "_unique2", "unique_dim", "repeat_interleave", "is_nonzero", "item", "nonzero_numpy", "argwhere",
           "equal", "allclose"}


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


class CountRngReads:
    """Counts reads of the RNG state: CPU state tensors, CUDA states, and the engine's forks of a
    generator for a half that draws (``HalfGenerators.source``, whose generator it snapshots)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for owner, name in ((torch, "get_rng_state"), (torch.random, "get_rng_state"),
                            (torch.cuda, "get_rng_state"), (torch.cuda, "get_rng_state_all"),
                            (HalfGenerators, "source")):
            real = getattr(owner, name)
            monkeypatch.setattr(owner, name, self._counted(real))

    def _counted(self, real):
        def read(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)
        return read


def no_dropout(stack):
    """The test stacks' dropout and drop-path switched off (p = 0: they draw nothing)."""
    for module in stack.modules():
        for name in ("p", "drop_prob"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    return stack


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
@pytest.mark.parametrize("dropout", [True, False], ids=["dropout", "no-dropout"])
def test_a_step_makes_no_host_sync_and_reads_no_rng_state(seeded, schedule, exact, dropout, monkeypatch):
    """From the second step on (the first probes which halves draw random numbers): no sync in the
    forward or the per-block backward, one at the end of an exact eager backward; no RNG-state read
    without dropout. Depths 1, 2 and 7 (issue 45), the last with a stage transition."""
    inside = []
    real = engine.segment.run_backward_schedule

    def counted_schedule(*args, **kwargs):  # the per-block part of the backward: no sync at all
        with CountSyncs() as syncs:
            result = real(*args, **kwargs)
        inside.append(syncs.counts)
        return result

    monkeypatch.setattr(engine.segment, "run_backward_schedule", counted_schedule)
    reads = CountRngReads(monkeypatch)
    dtype = torch.float32 if exact else torch.float64
    for depth in (1, 2, 7):
        stack = build(depth, schedule, exact, transition=depth > 3, seed=seeded)
        if not dropout:
            no_dropout(stack)
        x = torch.randn(2, 3, 12, dtype=dtype, requires_grad=True)
        stack(x).square().sum().backward()  # the first step probes
        reads.count = 0
        with CountSyncs() as forward:
            loss = stack(x).square().sum()
        with CountSyncs() as backward:
            loss.backward()
        assert x.grad is not None and all(p.grad is not None for p in stack.parameters())
        assert forward.total() == 0, (depth, forward.counts)
        assert backward.total() == (1 if exact else 0), (depth, backward.counts)
        assert inside and all(not counts for counts in inside), (depth, inside)
        if not dropout:
            assert reads.count == 0, depth
        else:
            assert reads.count > 0, depth  # (the replay itself is held bitwise by the dropout tests)
        inside.clear()


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_deferred_checks_make_a_step_without_any_sync(seeded, schedule):
    stack = build(5, schedule, True, transition=True, seed=seeded)
    x = torch.randn(2, 3, 12, requires_grad=True)
    stack(x).sum().backward()
    with revtriton.deferred_checks():
        with CountSyncs() as step:
            stack(x).square().sum().backward()
            stack(x).square().sum().backward()  # two steps' checks wait together
        assert step.total() == 0, step.counts
        with CountSyncs() as check:
            revtriton.check_step()
        assert check.total() == 1, check.counts
