"""What the backward's recompute replays from the forward: the RNG states before each half call and
the autocast settings (DESIGN.md section 5)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


def _rng_devices(tensor: torch.Tensor):
    return [tensor.device] if tensor.is_cuda else []


class RngTape:
    """RNG states recorded before each half call in forward, replayed in backward.

    A state is stored only when it differs from the last one recorded, so halves that draw no
    random numbers share one state and the tape does not grow with depth.
    """

    def __init__(self, devices):
        self.devices = list(devices)
        self._last = None

    def record(self):
        state = (torch.get_rng_state(), tuple(torch.cuda.get_rng_state(d) for d in self.devices))
        last = self._last
        if last is not None and torch.equal(last[0], state[0]) and all(
            torch.equal(a, b) for a, b in zip(last[1], state[1])
        ):
            return last
        self._last = state
        return state

    def set(self, state):
        torch.set_rng_state(state[0])
        for device, cuda_state in zip(self.devices, state[1]):
            torch.cuda.set_rng_state(cuda_state, device)

    @contextlib.contextmanager
    def preserved(self):
        """Leave the caller's global RNG as it was (the backward replays forward states)."""
        saved = (torch.get_rng_state(), tuple(torch.cuda.get_rng_state(d) for d in self.devices))
        try:
            yield
        finally:
            self.set(saved)


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
