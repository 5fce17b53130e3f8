"""Triton launches, counted: every launch in revtriton goes through :func:`launch`, so
:func:`count_launches` sees all of them (tests and perf/ assert launch budgets with it).

The bottom of the dispatch layer (ops.backend measures candidates with launches uncounted;
ops.dispatch re-exports these names).
"""
from __future__ import annotations

import contextlib
from collections import Counter

_counters: list[Counter] = []


# Host arithmetic for grids and keys. triton.cdiv / triton.next_power_of_2 are constexpr functions
# (a wrapper unwraps every argument): about 5 us a call on the host, several per launch.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


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
