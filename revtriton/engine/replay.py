"""What the backward's recompute replays from the forward: each half's random draws (from generators
of its own, forked from the global ones) and the autocast settings (DESIGN.md section 5)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..halves.randomness import HalfGenerators, default_generator, device_key


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


def _set_generator(target: torch.Generator, state: torch.Generator):
    # In place: the target keeps its state object (a CUDA graph may have registered the global one's)
    target.set_state(state.get_state())


class GlobalStart:
    """The global generators' states at a half's start (the CPU's, and the current CUDA device's once
    CUDA is initialised): the replay of draws the routing cannot reach, as the state tape before
    the half's own generators did. A random op with no random tag that draws from the global
    generator inside (a custom op or extension kernel: flash-attn's dropout) passes the routing
    mode; the probe sees the global generator move under a routed half and records such a half
    this way (its routed draws still from its own generators) for as long as it keeps moving. The
    escaped draws are not safe against another thread drawing during the step."""

    def __init__(self):
        devices = [torch.device("cpu")]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices.append(torch.device("cuda", torch.cuda.current_device()))
        self.states = {device: default_generator(device).clone_state() for device in devices}

    def moved(self) -> bool:
        """Whether a global generator drew since (compares the states on the host: the probe, and each
        forward of a half seen escaping, only)."""
        for device, state in self.states.items():
            now = default_generator(device)
            if device.type == "cuda":
                if (now.initial_seed(), now.get_offset()) != (state.initial_seed(), state.get_offset()):
                    return True
            elif not torch.equal(now.get_state(), state.get_state()):
                return True
        return False

    @contextlib.contextmanager
    def replayed(self):
        """The global generators at the recorded start for the recompute, the caller's restored after."""
        saved = {device: default_generator(device).clone_state() for device in self.states}
        for device, state in self.states.items():
            _set_generator(default_generator(device), state)
        try:
            yield
        finally:
            for device, state in saved.items():
                _set_generator(default_generator(device), state)


ESCAPED_DRAW_MESSAGE = ("revtriton: a half's random draws are {} and cannot be captured in a CUDA graph: a "
                        "captured half draws from generators the graph registers (halves.randomness.GraphDraws)")


@dataclass(frozen=True)
class HalfDraws:
    """What one half call drew: its generators' start states, whether its draws needed routing (code
    that draws with no generator) or all asked for the half's (``halves.randomness``), and the global
    generators' start when some draws escaped the routing (:class:`GlobalStart`)."""

    start: dict
    routed: bool
    global_start: GlobalStart | None = None

    @property
    def kind(self) -> str:
        """How later forwards record the half: "global", "routed" or "own"."""
        return "global" if self.global_start is not None else "routed" if self.routed else "own"


class HalfRandomness:
    """Runs a half's forward on generators of its own and replays them in its recompute.

    :meth:`recorded` runs the forward on generators forked from the global ones at its first draw,
    then sets the global ones past those draws (the masks and the global stream are those of a plain
    run); :meth:`replayed` runs the recompute from the recorded start. Which halves draw, and how,
    is probed once (the stack's plan keeps it): a half known to draw nothing runs as it is and
    records nothing (a step of a stack whose halves draw nothing reads no RNG state), one whose
    draws all ask for the half's generator runs with no routing mode, one whose draws escaped the
    routing is recorded by the global generators' state (:class:`GlobalStart`).
    """

    @staticmethod
    @contextlib.contextmanager
    def recorded(sink: list, kind: str | None = None, routing: bool = True):
        """Run a half's forward; appends to ``sink`` its :class:`HalfDraws` (None: it drew nothing).
        ``kind``: how the half draws, from an earlier probe (:attr:`HalfDraws.kind`), or None: probe.
        ``routing`` False: never under the routing mode (its draws with no generator are then
        recorded by the global generators' state)."""
        # The probe, and every forward of a half seen escaping, compare the global generators' states
        # around the half: another thread drawing during the half looks the same as an escape, so a
        # half is recorded by its global start only while the global generator keeps moving under it.
        unrecordable = kind is None or kind == "global"  # (a graph cannot compare the global states)
        if unrecordable and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(ESCAPED_DRAW_MESSAGE.format(
                "not known yet (no eager call of the step came first)" if kind is None else
                "drawn where the engine cannot hand them a generator (an extension kernel reading the global one, "
                "such as flash-attn's dropout)"))
        global_start = GlobalStart() if kind is None or kind == "global" else None
        routed = routing and kind != "own"
        with HalfGenerators() as half, (_RoutedToHalf(half) if routed else _NO_ROUTING) as mode:
            yield
        escaped = global_start is not None and global_start.moved()
        half.advance_source()
        drew = half.start or escaped
        sink.append(HalfDraws(half.start, routed and mode.routed, global_start if escaped else None) if drew else None)

    @staticmethod
    def replayed(draws: HalfDraws | None):
        """Run a half's recompute drawing the forward's numbers (``draws`` None: it draws nothing)."""
        if draws is None:
            return _NO_ROUTING
        if draws.global_start is not None:
            return _replayed_with_global_start(draws)
        half = HalfGenerators(draws.start)
        return _routed(half) if draws.routed else half


@contextlib.contextmanager
def _routed(half: HalfGenerators):
    with half, _RoutedToHalf(half):
        yield


@contextlib.contextmanager
def _replayed_with_global_start(draws: HalfDraws):
    with draws.global_start.replayed(), HalfGenerators(draws.start) as half:
        with _RoutedToHalf(half) if draws.routed else _NO_ROUTING:
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
