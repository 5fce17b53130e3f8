"""What the backward's recompute replays from the forward: each half's random draws (from generators
of its own, forked from the global ones) and the autocast settings (DESIGN.md section 5)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..halves.randomness import HalfGenerators, default_generator, device_key


def _rng_devices(tensor: torch.Tensor):
    """The devices besides the CPU whose generators ``torch.random.fork_rng`` must keep for ``tensor``."""
    return [tensor.device] if tensor.is_cuda else []


_PASS = "pass"
_ROUTES: dict = {}  # aten overload -> _PASS, a _Swap or the overload that takes ``generator``


class _Swap:
    """The route of a random op that takes no generator: the global generator's state swapped for the
    half's around the call. Such ops say by an argument whether they draw at all (SDPA's
    ``dropout_p``, ``native_dropout``'s ``p`` and ``train``): a call with a zero rate or ``train``
    False draws nothing and passes."""

    def __init__(self, schema):
        # (position, name, default) of the arguments that say so
        said = [(i, a.name, a.default_value if a.has_default_value() else None)
                for i, a in enumerate(schema.arguments)]
        self.rates = [arg for arg in said if arg[1] in ("p", "dropout_p", "dropout")]
        self.train = [arg for arg in said if arg[1] == "train"]

    def draws(self, args, kwargs) -> bool:
        def value(i, name, default):
            return args[i] if i < len(args) else kwargs.get(name, default)

        if any(value(*arg) == 0 for arg in self.rates):
            return False
        return not any(value(*arg) is False for arg in self.train)


def _route(func):
    """How a half's own generator reaches ``func``: its ``generator`` argument, the overload of the
    same op that has one (``rand.default`` -> ``rand.generator``), or, for the few random ops that
    take none (``native_dropout``, the fused attention kernels, cuDNN RNNs), the global generator
    swapped for the half's own around the one call (a _Swap). Ops that draw nothing pass (_PASS)."""
    route = _ROUTES.get(func)
    if route is not None:
        return route
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        route = func
    elif torch.Tag.nondeterministic_seeded in func.tags:
        route = _Swap(func._schema)
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
                return device_key(arg.device)
        return device_key(torch.get_default_device())
    return device_key(device)


class _RoutedToHalf(TorchDispatchMode):
    """Hands a half's generators (:class:`HalfGenerators`) to the random ops its code runs with
    none (``nn.Dropout``, ``torch.rand_like``...): it sees every aten op, so it costs host time
    (about 20 us an op on a 2-core CPU) and runs only around halves that draw that way. Mode stacks
    are per thread: another thread's draws never come here. ``routed``: whether any op was routed."""

    def __init__(self, half: HalfGenerators):
        super().__init__()
        self.half = half
        self.routed = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _route(func)
        if route is _PASS or kwargs.get("generator") is not None:  # (a generator the half chose: its own)
            return func(*args, **kwargs)
        swap = isinstance(route, _Swap)
        device = _device_of(args, kwargs)
        if device is None or (swap and not route.draws(args, kwargs)):
            return func(*args, **kwargs)
        self.routed = True
        generator = self.half.generator(device)
        if swap:
            return _with_global_generator(device, generator, func, args, kwargs)
        return route(*args, **kwargs, generator=generator)


def _with_global_generator(device, generator, func, args, kwargs):
    """``func`` (a random op with no ``generator`` argument) drawing from ``generator``: the global
    generator's state swapped for it around the call only (another thread drawing from the global
    generator during this one call would see the half's state)."""
    default = default_generator(device)
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


@dataclass(frozen=True)
class HalfDraws:
    """What one half call drew: its generators' start states, and whether its draws needed routing
    (code that draws with no generator) or all asked for the half's (``halves.randomness``)."""

    start: dict
    routed: bool


class HalfRandomness:
    """Runs a half's forward on generators of its own and replays them in its recompute.

    :meth:`recorded` runs the forward on generators forked from the global ones at its first draw,
    then sets the global ones past those draws (the masks and the global stream are those of a plain
    run); :meth:`replayed` runs the recompute from the recorded start. Which halves draw, and how,
    is probed once (the stack's plan keeps it): a half known to draw nothing runs as it is and
    records nothing (a step of a stack whose halves draw nothing reads no RNG state), one whose
    draws all ask for the half's generator runs with no routing mode.
    """

    @staticmethod
    @contextlib.contextmanager
    def recorded(sink: list, routed: bool = True):
        """Run a half's forward; appends to ``sink`` its :class:`HalfDraws` (None: it drew nothing).
        ``routed``: route the random ops that take no generator (False: the half is known not to run any)."""
        with HalfGenerators() as half, (_RoutedToHalf(half) if routed else _NO_ROUTING) as mode:
            yield
        half.advance_source()
        sink.append(HalfDraws(half.start, routed and mode.routed) if half.start else None)

    @staticmethod
    def replayed(draws: HalfDraws | None):
        """Run a half's recompute drawing the forward's numbers (``draws`` None: it draws nothing)."""
        if draws is None:
            return _NO_ROUTING
        half = HalfGenerators(draws.start)
        return _routed(half) if draws.routed else half


@contextlib.contextmanager
def _routed(half: HalfGenerators):
    with half, _RoutedToHalf(half):
        yield


_NO_ROUTING = contextlib.nullcontext()


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
