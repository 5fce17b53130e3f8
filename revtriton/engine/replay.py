"""What the backward's recompute replays from the forward: each half's random draws (from generators
of its own, forked from the global ones) and the autocast settings (DESIGN.md section 5)."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _rng_devices(tensor: torch.Tensor):
    """The devices besides the CPU whose generators ``torch.random.fork_rng`` must keep for ``tensor``."""
    return [tensor.device] if tensor.is_cuda else []


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    return torch.default_generator


def _device_key(device) -> torch.device | None:
    """The device whose generator an op draws from: the CPU or one CUDA device (None: another kind,
    left to its own generator)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return device if device.type == "cpu" else None


_active = threading.local()  # .modes: this thread's _OwnGenerators, innermost last

_PASS, _SWAP = "pass", "swap"
_ROUTES: dict = {}  # aten overload -> _PASS, _SWAP or the overload that takes ``generator``


def _route(func):
    """How a half's own generator reaches ``func``: its ``generator`` argument, the overload of the
    same op that has one (``rand.default`` -> ``rand.generator``), or, for the few random ops that
    take none (``native_dropout``, the fused attention kernels, cuDNN RNNs), the global generator
    swapped for the half's own around the one call (_SWAP). Ops that draw nothing pass (_PASS)."""
    route = _ROUTES.get(func)
    if route is not None:
        return route
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        route = func
    elif torch.Tag.nondeterministic_seeded in func.tags:
        route = _SWAP
        packet = func.overloadpacket
        for overload in packet.overloads():
            other = getattr(packet, overload)
            other_names = [a.name for a in other._schema.arguments]
            if "generator" in other_names and sorted(other_names) == sorted(names + ["generator"]):
                route = other
                break
    else:
        route = _PASS
    _ROUTES[func] = route
    return route


def _device_of(args, kwargs) -> torch.device | None:
    device = kwargs.get("device")
    if device is None:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                return _device_key(arg.device)
        return _device_key(torch.get_default_device())
    return _device_key(device)


class _OwnGenerators(TorchDispatchMode):
    """Every random op a half runs draws from generators of its own, one per device, instead of the
    process-wide ones (mode stacks are per thread, so another thread's draws never reach them).

    Recording (``start`` None): a device's generator is forked from the global one at the half's
    first draw on it (``clone_state``: on CUDA a graph-safe snapshot, no copy to the host) and its
    starting state kept for the replay. Replaying: each device's generator starts at the recorded
    state, so the recompute draws the forward's numbers whatever the global generators did since.
    """

    def __init__(self, start: dict | None = None):
        super().__init__()
        self.replaying = start is not None
        self.start = {} if start is None else start  # device -> generator at the half's first draw
        self.generators = {}  # device -> the generator the half draws from

    def __enter__(self):
        self.parent = _active.modes[-1] if getattr(_active, "modes", None) else None
        _active.__dict__.setdefault("modes", []).append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.modes.pop()
        return super().__exit__(*exc)

    def source(self, device: torch.device) -> torch.Generator:
        """The generator this half's draws come from when not replayed: the enclosing half's (a stack
        inside a half of another), else the global one."""
        return self.parent.generator(device) if self.parent is not None else _default_generator(device)

    def generator(self, device: torch.device) -> torch.Generator:
        generator = self.generators.get(device)
        if generator is None:
            start = self.start.get(device)
            if start is None:  # recording (replaying: a device the forward did not draw on; nothing kept)
                start = self.source(device).clone_state()
                if not self.replaying:
                    self.start[device] = start
            generator = self.generators[device] = start.clone_state()  # the kept start stays as recorded
        return generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _route(func)
        if route is _PASS or kwargs.get("generator") is not None:  # (a generator the half chose: its own)
            return func(*args, **kwargs)
        device = _device_of(args, kwargs)
        if device is None:
            return func(*args, **kwargs)
        generator = self.generator(device)
        if route is _SWAP:
            return _with_global_generator(device, generator, func, args, kwargs)
        return route(*args, **kwargs, generator=generator)

    def advance_source(self):
        """Leave each generator the half's draws were forked from where those draws left it, as if the
        half had drawn from it: later draws (the next half's, the caller's) are those of a plain run."""
        for device, generator in self.generators.items():
            source = self.source(device)
            if device.type == "cuda":
                source.graphsafe_set_state(generator.clone_state())
            else:
                source.set_state(generator.get_state())


def _with_global_generator(device, generator, func, args, kwargs):
    """``func`` (a random op with no ``generator`` argument) drawing from ``generator``: the global
    generator's state swapped for it around the call only (another thread drawing from the global
    generator during this one call would see the half's state)."""
    default = _default_generator(device)
    if device.type == "cuda":  # graph-safe: the generator shares ``generator``'s state for the call
        saved = default.graphsafe_get_state()
        default.graphsafe_set_state(generator)
        try:
            return func(*args, **kwargs)
        finally:
            default.graphsafe_set_state(saved)
    saved = default.get_state()
    default.set_state(generator.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        generator.set_state(default.get_state())
        default.set_state(saved)


class HalfRandomness:
    """What a half drew: the states its own generators started from (None: it drew nothing).

    :meth:`recorded` runs a half's forward on generators forked from the global ones at its first
    draw, then moves the global ones past those draws (the masks and the global stream are those of a
    plain run); :meth:`replayed` runs its recompute from the recorded states. Which halves draw is
    probed once (the stack's plan keeps it); a half known to draw nothing runs with no mode at all
    and records nothing, so a step of a stack whose halves draw nothing reads no RNG state.
    """

    @staticmethod
    @contextlib.contextmanager
    def recorded(sink: list):
        """Run a half's forward; appends to ``sink`` its recorded start states (None: it drew nothing)."""
        mode = _OwnGenerators()
        with mode:
            yield
        mode.advance_source()
        sink.append(mode.start or None)

    @staticmethod
    def replayed(start: dict | None):
        """Run a half's recompute drawing the forward's numbers (``start`` None: it draws nothing)."""
        return _NOTHING_TO_REPLAY if start is None else _OwnGenerators(start)


_NOTHING_TO_REPLAY = contextlib.nullcontext()


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings of the forward, restored around every recompute."""

    settings: tuple

    @staticmethod
    def capture():
        settings = []
        for device_type in ("cpu", "cuda"):
            enabled = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type)
            settings.append((device_type, enabled, dtype))
        return AutocastState(tuple(settings))

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.settings:
                if device_type == "cuda" and not torch.cuda.is_available():
                    continue
                if torch.is_autocast_enabled(device_type) == enabled and (
                        not enabled or torch.get_autocast_dtype(device_type) == dtype):
                    continue  # already as the forward had it (the common case): nothing to enter
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield
