"""Argument checks every layer shares. An int option must be an int, and not a bool (which Python
counts as one: ``depth=True`` would build one block), within its bounds; the message names it."""
from __future__ import annotations


def checked_int(name: str, value, low: int, high: int | None = None, *, note: str = "") -> int:
    """``value`` when it is an int (not a bool) with ``low <= value`` (and ``<= high`` when given);
    else ValueError naming ``name`` and its bounds (``note`` added after them)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high):
        return value
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{name} must be an int {bounds}{note}, got {value!r}")
