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

import threading

import torch

_active = threading.local()  # .stack: this thread's HalfGenerators, innermost last


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
            if graph_capturing(device):
                raise NotImplementedError(CAPTURED_DRAW_MESSAGE)
            start = self.start.get(device)
            if start is None:  # recording (replaying: a device the forward did not draw on; nothing kept)
                start = self.source(device).clone_state()
                if not self.replaying:
                    self.start[device] = start
            generator = self.generators[device] = start.clone_state()  # the kept start stays as recorded
        return generator

    def advance_source(self):
        """Leave each generator the half's draws were forked from where those draws left it: later
        draws (the next half's, the caller's) are those of a plain run."""
        for device, generator in self.generators.items():
            source = self.source(device)
            if device.type == "cuda":
                source.graphsafe_set_state(generator.clone_state())
            else:
                source.set_state(generator.get_state())


# A half's draws are forked from the global generator at its first draw and replayed from that fork
# in the recompute. Inside a CUDA graph capture PyTorch draws only from generator states registered
# with the graph before the capture began (its graph-safe RNG); a fork made during the capture is not
# one, and no registered state can start where the global generator stands at the half's draw.
CAPTURED_DRAW_MESSAGE = (
    "revtriton: a half that draws random numbers (dropout, drop-path) cannot run inside a CUDA graph capture "
    "yet: its recompute replays the forward's numbers from a generator forked at the draw, and a graph draws "
    "only from generator states registered before its capture. Capture the step with dropout and drop-path at "
    "0, or run it eagerly")


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
