"""What the backward's recompute replays from the forward: the RNG states before each half call and
the autocast settings (DESIGN.md section 5)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


def _rng_devices(tensor: torch.Tensor):
    return [tensor.device] if tensor.is_cuda else []


class RngTape:
    """RNG states recorded before each half that draws random numbers, replayed in backward.

    Which halves draw is probed once (the stack's plan keeps it): a recording forward whose plan
    does not know yet reads the state around every half (:meth:`record`, :meth:`same`), and later
    forwards read it only before the halves that drew. A stack whose halves draw nothing reads no
    state at all, in forward or backward.

    CUDA generators are read and set graph-safely (``clone_state`` / ``graphsafe_set_state``: a
    snapshot generator, no copy of the state to the host), the CPU generator by its state tensor.
    """

    def __init__(self, devices):
        self.generators = [torch.cuda.default_generators[torch.cuda.current_device() if d.index is None else d.index]
                           for d in devices]
        self.recorded = False  # some state was recorded: the backward replays it, then restores the caller's

    def record(self):
        self.recorded = True
        return torch.get_rng_state(), tuple(g.clone_state() for g in self.generators)

    @staticmethod
    def same(a, b) -> bool:
        """Whether two recorded states are the same position of every generator (nothing drew between)."""
        return torch.equal(a[0], b[0]) and all(
            (x.initial_seed(), x.get_offset()) == (y.initial_seed(), y.get_offset()) for x, y in zip(a[1], b[1]))

    def set(self, state):
        """Replay ``state`` (None: the half draws nothing, so there is nothing to set)."""
        if state is None:
            return
        torch.set_rng_state(state[0])
        for generator, snapshot in zip(self.generators, state[1]):
            generator.graphsafe_set_state(snapshot.clone_state())  # the tape's snapshot stays as recorded

    @contextlib.contextmanager
    def preserved(self):
        """Leave the caller's RNG as it was (the backward replays forward states); free when nothing was recorded."""
        if not self.recorded:
            yield
            return
        cpu, cuda = torch.get_rng_state(), tuple(g.graphsafe_get_state() for g in self.generators)
        try:
            yield
        finally:
            torch.set_rng_state(cpu)
            for generator, state in zip(self.generators, cuda):
                generator.graphsafe_set_state(state)


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
