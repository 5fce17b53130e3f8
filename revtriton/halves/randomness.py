"""The generators a half draws its random numbers from inside a reversible stack.

The engine runs each half that draws (dropout, drop-path, noise) inside :class:`HalfGenerators`:
generators of the half's own, one per device, so that its recompute in backward draws the
forward's numbers whatever the process-wide generators did since (another thread may draw from
them meanwhile). A half draws from them either by asking (:func:`half_generator`, what
revtriton's own halves do: nothing else to run) or, for code that draws from the global
generator (``nn.Dropout``, a timm ``DropPath``), through the engine's routing mode
(``engine.replay``), which hands them to its random ops.

Outside a stack's recorded forward and its recompute :func:`half_generator` is None: the global
generator, as ``generator=None`` means everywhere in torch.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_active = threading.local()  # .stack: this thread's HalfGenerators, innermost last
# The GraphDraws of the CapturedStep call running, process-wide: on CUDA the backward's recomputes run in
# autograd's device thread, not the caller's.
_graph_plan = None


def device_key(device) -> torch.device | None:
    """The device whose generator a draw uses: the CPU or one CUDA device (None: another kind of
    device, left to its own generator)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return device if device.type == "cpu" else None


def default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    return torch.default_generator


class HalfGenerators:
    """One half call's generators, one per device it draws on.

    Recording (``start`` None): a device's generator is forked at the half's first draw on it from
    the generator the draw would otherwise use (the global one, or the enclosing half's when a stack
    runs inside another's half; ``clone_state``: on CUDA a graph-safe snapshot, no copy to the
    host), and its starting state kept (:attr:`start`) for the replay; :meth:`advance_source` then
    sets the source past the half's draws, as if the half had drawn from it. Replaying: each
    device's generator starts at the recorded state.
    """

    def __init__(self, start: dict | None = None):
        self.replaying = start is not None
        self.start = {} if start is None else start  # device -> generator at the half's first draw
        self.generators = {}  # device -> the generator the half draws from
        self.parent = None

    def __enter__(self):
        stack = _active.__dict__.setdefault("stack", [])
        self.parent = stack[-1] if stack else None
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _active.stack.pop()

    def source(self, device: torch.device) -> torch.Generator:
        """Where this half's draws on ``device`` would come from if it had no generators of its own."""
        return self.parent.generator(device) if self.parent is not None else default_generator(device)

    def generator(self, device: torch.device) -> torch.Generator:
        generator = self.generators.get(device)
        if generator is None:
            plan = _graph_plan
            if graph_capturing(device):
                if plan is None:  # a capture of the user's own, not CapturedStep's
                    raise NotImplementedError(CAPTURED_DRAW_MESSAGE)
                generator = plan.captured_generator(self, device)
            else:
                start = self.start.get(device)
                if isinstance(start, _CapturedFork):
                    raise RuntimeError("revtriton: a half's forward was captured in a CUDA graph and its recompute "
                                       "runs outside it: run the backward inside the captured step")
                if start is None:  # recording (replaying: a device the forward did not draw on; nothing kept)
                    start = self.source(device).clone_state()
                    if not self.replaying:
                        self.start[device] = start
                generator = start.clone_state()  # the kept start stays as recorded
                if plan is not None:
                    plan.seen(self, device, start)
            self.generators[device] = generator
        return generator

    def advance_source(self):
        """Leave each generator the half's draws were forked from where those draws left it: later
        draws (the next half's, the caller's) are those of a plain run. In place (``set_state``): the
        source keeps its state object, which a CUDA graph may have registered (:class:`GraphDraws`)."""
        for device, generator in self.generators.items():
            source = self.source(device)
            if generator is not source:  # (a captured forward draws from its source itself)
                source.set_state(generator.get_state())


# A capture that is not CapturedStep's: PyTorch draws inside a CUDA graph only from generator states
# registered with the graph before its capture began, and only CapturedStep registers the halves' (GraphDraws).
CAPTURED_DRAW_MESSAGE = (
    "revtriton: a half that draws random numbers (dropout, drop-path) ran inside a CUDA graph capture that is "
    "not revtriton.CapturedStep's: its recompute replays the forward's numbers from a generator of its own, and "
    "a graph draws only from generator states registered before its capture, which CapturedStep does. Capture "
    "the step with revtriton.CapturedStep, or with dropout and drop-path at 0")


def graph_capturing(device: torch.device) -> bool:
    """Whether a draw on ``device`` would be captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def active_half() -> HalfGenerators | None:
    """The innermost half call of this thread that draws from generators of its own, or None."""
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def half_generator(device) -> torch.Generator | None:
    """The generator a half's draw on ``device`` should use (``generator=`` of torch's random ops):
    the half's own inside a stack's recorded forward or recompute, else None (the global one)."""
    half = active_half()
    if half is None:
        return None
    device = device_key(device)
    return None if device is None else half.generator(device)


def _graph_generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device)


class _CapturedFork:
    """What a captured forward keeps of a half's draws on a device: which fork of the step they were."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


_DIFFERENT = ("revtriton: the captured step's halves drew random numbers differently from its last warm-up call "
              "({}): CapturedStep sets each recompute's generator from what the warm-up recorded, so the warm-up "
              "calls must run the step as the captured one (the same model, modes and branches)")

_NESTED = ("revtriton: a reversible stack inside a half that draws random numbers cannot be captured in a CUDA graph "
           "yet: its halves fork from that half's generator, not from a state the graph registers")


class GraphDraws:
    """The halves' random draws in a step captured in one CUDA graph (``engine.graphs.CapturedStep``).

    Eagerly a half forks its generator from the global one at its first draw and its recompute
    replays the fork (:class:`HalfGenerators`). A graph cannot fork: it draws only from generator
    states registered before its capture, each at an offset its replays move on (PyTorch's
    graph-safe Philox states). So:

    * a warm-up call records the step's forks in order, each with where the global generator stood
      at it, counted from the step's start (Philox offsets: host values, no sync), and which fork
      each recompute replays;
    * before the capture, one generator per recompute is made, to be registered with the graph;
    * in the capture a half's forward draws from the global generator itself (the numbers its fork
      would draw) and its recompute from its own registered generator;
    * before each replay (:meth:`place`) each registered generator is set to the global
      generator's seed and offset plus its fork's: the recompute draws the forward's numbers, as
      eagerly, and the global generator ends the step where an eager step leaves it.

    The capture checks that it forks and replays as the warm-up did, and refuses what a graph cannot
    replay: a stack inside a half that draws (its fork is from that half's generator). The plan is
    process-wide while a CapturedStep call runs (the backward's recomputes run in autograd's device
    thread on CUDA): another thread running a reversible stack with drawing halves meanwhile is
    counted with the step, and its capture raises.
    """

    def __init__(self):
        self.forks = []  # per fork of the step, in order: (device, the global offset from the step's start or None)
        self.replays = []  # per recompute, in order: the index of the fork it replays (None: none recorded)
        self.generators = []  # per recompute: its generator (registered with the graph on CUDA)
        self.nested = False  # a fork from another half's generator was seen
        self._mode = None  # "warm-up", "captured" or None
        self._step_start = {}  # CUDA device -> the global generator's offset at the warm-up call's start
        self._forks_of = {}  # id(a fork's start) -> (its index, the start), in the warm-up call
        self._sources = {}  # CUDA device -> the global generator's state (the one the graph registers)
        self._next_fork = self._next_replay = 0

    @contextlib.contextmanager
    def _activated(self, mode: str):
        global _graph_plan
        previous = _graph_plan, self._mode
        _graph_plan, self._mode = self, mode
        try:
            yield
        finally:
            _graph_plan, self._mode = previous

    @contextlib.contextmanager
    def warming_up(self):
        """One eager call of the step: its forks and recomputes recorded (the last call's are kept)."""
        self.forks, self.replays, self.nested, self._forks_of = [], [], False, {}
        self._step_start = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = device_key("cuda")
            self._step_start[device] = default_generator(device).get_offset()
        try:
            with self._activated("warm-up"):
                yield
        finally:
            self._forks_of = {}  # (the starts themselves stay with the step's autograd graph, or go)

    def seen(self, half: HalfGenerators, device: torch.device, start: torch.Generator):
        """A half's generator made eagerly: recorded in a warm-up call, counted in a captured one (a
        draw on a device the graph does not capture: the CPU's)."""
        if self._mode == "captured":
            if half.replaying:
                self._next_replay += 1
            else:
                self._next_fork += 1
            return
        if self._mode != "warm-up":
            return
        if half.replaying:
            fork = self._forks_of.get(id(start))
            self.replays.append(None if fork is None else fork[0])
            return
        offset = None
        if half.parent is not None:
            self.nested = True
        elif device in self._step_start:
            offset = half.source(device).get_offset() - self._step_start[device]
        self._forks_of[id(start)] = (len(self.forks), start)
        self.forks.append((device, offset))

    def prepare(self) -> list:
        """The capture's generators, one per recompute: made before the capture, which registers the
        returned ones (CUDA's) with its graph."""
        if self.nested:
            raise NotImplementedError(_NESTED)
        if None in self.replays:
            raise NotImplementedError(_DIFFERENT.format("a recompute drew on a device its forward did not draw on"))
        if any(device.type == "cuda" and offset is None for device, offset in self.forks):
            raise RuntimeError(_DIFFERENT.format("CUDA was not initialised when its warm-up call began"))
        self.generators = [_graph_generator(self.forks[fork][0]) for fork in self.replays]
        self._sources = {device: default_generator(device).graphsafe_get_state()
                         for device in {device for device, _ in self.forks if device.type == "cuda"}}
        return [generator for generator, fork in zip(self.generators, self.replays)
                if self.forks[fork][0].type == "cuda"]

    @contextlib.contextmanager
    def captured(self, capture: bool = False):
        """The step captured (``capture``) or replayed: its halves draw as this plan says. A capture
        that forked or replayed otherwise than the warm-up raises."""
        self._next_fork = self._next_replay = 0
        with self._activated("captured"):
            yield
        if capture and (self._next_fork, self._next_replay) != (len(self.forks), len(self.replays)):
            raise RuntimeError(_DIFFERENT.format(
                f"{self._next_fork} forks and {self._next_replay} recomputes against {len(self.forks)} and "
                f"{len(self.replays)}"))

    def captured_generator(self, half: HalfGenerators, device: torch.device) -> torch.Generator:
        """The generator a half draws from on ``device`` while the step is captured."""
        if half.replaying:
            start = half.start.get(device)
            index = self._next_replay
            self._next_replay += 1
            if not isinstance(start, _CapturedFork) or index >= len(self.replays) or self.replays[index] != start.index:
                raise RuntimeError(_DIFFERENT.format(f"recompute {index}"))
            return self.generators[index]
        if half.parent is not None:
            raise NotImplementedError(_NESTED)
        index = self._next_fork
        self._next_fork += 1
        if index >= len(self.forks) or self.forks[index][0] != device:
            raise RuntimeError(_DIFFERENT.format(f"fork {index} on {device}"))
        half.start[device] = _CapturedFork(index)
        source = half.source(device)
        if device.type != "cuda":  # a stand-in graph (tests): it runs now, so its recomputes start from here
            state = source.get_state()
            for generator, fork in zip(self.generators, self.replays):
                if fork == index:
                    generator.set_state(state)
        return source

    def place(self):
        """Before each replay: each recompute's generator at the global generator's seed and offset plus
        its fork's (host values, no sync; the graph reads them at its replay)."""
        for generator, fork in zip(self.generators, self.replays):
            device, offset = self.forks[fork]
            if device.type == "cuda":
                source = self._sources[device]
                generator.manual_seed(source.initial_seed())
                generator.set_offset(source.get_offset() + offset)
