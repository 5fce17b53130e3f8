"""Triton launches, counted: every launch in revtriton goes through :func:`launch`, so
:func:`count_launches` sees all of them (tests and perf/ assert launch budgets with it).

The bottom of the dispatch layer (ops.backend measures candidates with launches uncounted;
ops.dispatch re-exports these names).
"""
from __future__ import annotations

import contextlib
from collections import Counter

_counters: list[Counter] = []


# Host arithmetic for grids: triton.cdiv is a constexpr function (a wrapper unwraps every
# argument), about 5 us a call on the host, several per launch (kernels/configs.py has
# next_power_of_2 for the same reason).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch(kernel, grid, *args, **meta):
    """Launch ``kernel[grid](*args, **meta)`` and count it under every active counter."""
    name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))
    for counter in _counters:
        counter[name] += 1
    return kernel[grid](*args, **meta)


@contextlib.contextmanager
def uncounted():
    """Launches inside are not counted (the backend's measuring runs)."""
    saved = _counters[:]
    _counters.clear()
    try:
        yield
    finally:
        _counters[:] = saved


@contextlib.contextmanager
def count_launches():
    """Count Triton launches made inside the block: ``with count_launches() as c: ...; c.total()``."""
    counter = Counter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)
