"""Triton launches, counted: every launch in revtriton goes through :func:`launch`, so
:func:`count_launches` sees all of them (tests and perf/ assert launch budgets with it).

The bottom of the dispatch layer (ops.backend measures candidates with launches uncounted;
ops.dispatch re-exports these names).
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter

import torch

_counters: list[Counter] = []


# Host arithmetic for grids: triton.cdiv is a constexpr function (a wrapper unwraps every
# argument), about 5 us a call on the host, several per launch (kernels/configs.py has
# next_power_of_2 for the same reason).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def interpreter_enabled() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``). Read once: Triton
    decides when it decorates a kernel (revtriton.kernels' import) whether it is interpreted, so a
    later change of the variable changes no kernel; and the launchers ask at every launch (an
    environment read is about a microsecond)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class NullPointer:
    """A kernel's unused pointer argument: a null address of a given dtype. Triton specialises it as
    it does a 16-byte aligned tensor of that dtype (the same compiled kernel and tuning key as the
    tensor that takes its place in another launch, e.g. the rebuild's saved pre-activation), and
    its CUDA launcher passes it without asking the driver: for every tensor argument the launcher
    checks the address with ``cuPointerGetAttribute``, one driver call each, except for a null one.
    A GEMM launch has up to ten pointer arguments, six of them unused in a plain forward."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    @staticmethod
    def data_ptr() -> int:
        return 0

    def __repr__(self) -> str:
        return f"NullPointer({self.dtype})"


def unused_pointer(like: torch.Tensor, dtype: torch.dtype | None = None):
    """What to pass for a pointer argument the launch does not read or write: a :class:`NullPointer`
    of ``dtype`` (default ``like``'s) for a compiled CUDA launch; ``like`` itself (viewed as
    ``dtype``) where a real tensor is needed (the interpreter reads every argument, the static
    model's recording runs on meta tensors, torch.compile traces Triton launches of tensors)."""
    dtype = like.dtype if dtype is None else dtype
    if like.is_cuda and not interpreter_enabled() and not torch.compiler.is_compiling():
        return NullPointer(dtype)
    return like if dtype == like.dtype else like.reshape(-1).view(dtype)


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


# ---------------------------------------------------------------- launch plans

PLANS_PER_OP = 64  # signatures kept per op (a training run has a handful: forward, rebuild, eval)


class CallKey:
    """A call's signature as a dict key whose hash is computed once: a call's key is looked up and
    stored in several dicts (the choice, the key string, the launch plans), and a tuple hashes its
    whole nested contents at every lookup (about 1 us each). Raises TypeError when a value is
    unhashable, as the tuple would."""

    __slots__ = ("values", "hash")

    def __init__(self, values: tuple):
        self.values, self.hash = values, hash(values)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return self is other or (type(other) is CallKey and self.hash == other.hash and self.values == other.values)

    def __repr__(self):
        return f"CallKey{self.values!r}"


def call_signature(*values) -> tuple:
    """A hashable key of a call: each tensor's shape, strides, dtype and device (what the launchers'
    checks and launch arguments depend on; not its data, nor its address: the launches check their
    base addresses themselves), each other value as it is."""
    return tuple([(v.shape, v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else v for v in values])


class LaunchPlan:
    """The launches of one op call signature: each built at the first call that makes it (its
    launcher's checks passed, its arguments but the tensors worked out) and reused by every later
    call of the signature, which then only allocates its outputs and launches."""

    __slots__ = ("launches", "options")

    def __init__(self, options=None):
        self.launches = {}
        self.options = options  # what the op worked out with the checks (e.g. the operand dtype)

    def launch(self, index, build):
        """The plan's launch at call site ``index`` (any hashable: a number, or a tuple with what
        else the launch depends on), built by ``build()`` at the first call."""
        made = self.launches.get(index)
        if made is None:
            made = self.launches[index] = build()
        return made


def plan_key(op: str, scale, res, x, *values):
    """The key of a couple call's launch plan: the op, autocast's dtype, the metadata of its tensors
    and its other arguments as they are; None for a scaled coupling (its scale's checks and
    arguments are each call's) or a non-tensor input (the op's checks say what is wrong)."""
    if scale is not None or not isinstance(x, torch.Tensor):
        return None
    device_type = x.device.type
    autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    return call_signature(op, autocast, res, x, *values)


class PlanCache:
    """An op's launch plans by call signature (at most PLANS_PER_OP; all dropped when full). Under
    torch.compile no plan is kept: the op is traced, its Python runs once."""

    def __init__(self):
        self.plans: dict = {}

    def get(self, key):
        if key is None or torch.compiler.is_compiling():
            return None
        try:
            return self.plans.get(key)
        except TypeError:  # an unhashable argument: the op's checks will say what is wrong with it
            return None

    def keep(self, key, plan: LaunchPlan):
        if key is None or torch.compiler.is_compiling():
            return
        if len(self.plans) >= PLANS_PER_OP:
            self.plans.clear()
        try:
            self.plans[key] = plan
        except TypeError:
            pass

    def clear(self):
        self.plans.clear()
