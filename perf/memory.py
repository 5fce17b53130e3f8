"""Peak memory of a step for perf/: CUDA allocator statistics on a GPU, live tensor bytes on a CPU.

On a CPU there are no allocator statistics, and the profiler's allocation events
(``revtriton.profiling.peak_memory``) go through its private API and print to stderr on every
use. :class:`LiveBytes` instead watches every op through a ``TorchDispatchMode``: each output
whose storage is new (not an input's, not seen before) adds its bytes, and a ``weakref`` callback
on that storage subtracts them when it is freed (torch keeps one Python object per storage
while any tensor uses it, so the callback runs when the memory goes). Storages that existed
before the mode started are never counted, neither when they are written in place nor when
they are freed: the peak is what the watched code allocates above what was live at its start.

What it cannot see: memory an op allocates and frees inside itself without returning it (the
CPU flash-attention kernel's per-thread scratch buffers, for one), and tensors made by code that
bypasses the dispatcher (``torch.from_numpy``). Against the profiler's allocation events on the
quick sweep's shapes (one thread): equal for stored activations, 0.5-1.5% lower for the
reversible and checkpointed stacks, whose peak falls in backward beside such buffers
(tests/test_perf.py checks it). Its cost: a step under it takes about 2x a plain step (the
profiler's way, about 3x).
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from revtriton import profiling

__all__ = ["LiveBytes", "peak_memory"]


def _input_keys(args, kwargs) -> set:
    """Storage ids of the tensors among an op's arguments (and in list arguments)."""
    keys = set()
    for group in (args, kwargs.values() if kwargs else ()):
        for a in group:
            if isinstance(a, (list, tuple)):
                items = a
            else:
                items = (a,)
            for t in items:
                if isinstance(t, torch.Tensor):
                    try:
                        keys.add(t.untyped_storage()._cdata)
                    except (RuntimeError, NotImplementedError, TypeError):
                        pass
    return keys


class _StorageRef(weakref.ref):
    """A weak reference to a counted storage that remembers what to subtract when it dies."""

    __slots__ = ("key", "nbytes")


class LiveBytes(TorchDispatchMode):
    """Count bytes of tensor storages allocated while the mode is active (on ``device``'s type).

    ``live``: bytes allocated since entry and still alive; ``peak``: the largest ``live`` seen.
    Usable once or several times (``reset()`` puts the peak back to the current live bytes).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        self.device_type = torch.device(device).type
        self.live = 0
        self.peak = 0
        self._refs = {}  # storage id (_cdata) -> _StorageRef (key, bytes counted)
        self._lock = threading.Lock()  # frees may come from the autograd engine's threads

    def reset(self) -> None:
        with self._lock:
            self.peak = self.live

    def _freed(self, ref) -> None:
        with self._lock:
            if self._refs.get(ref.key) is ref:
                del self._refs[ref.key]
                self.live -= ref.nbytes

    def _outputs(self, out):
        if isinstance(out, torch.Tensor):
            return (out,)
        if isinstance(out, (list, tuple)):
            flat = []
            for item in out:
                if isinstance(item, torch.Tensor):
                    flat.append(item)
                elif isinstance(item, (list, tuple)):
                    flat.extend(t for t in item if isinstance(t, torch.Tensor))
            return flat
        return ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        cpu = self.device_type == "cpu"
        for t in self._outputs(out):
            if (not t.is_cpu) if cpu else t.device.type != self.device_type:
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, subclasses
                continue
            key = storage._cdata
            ref = self._refs.get(key)
            if ref is None:
                if inputs is None:
                    inputs = _input_keys(args, kwargs)
                if key in inputs:
                    continue  # a view or an in-place result of a storage older than the mode
                ref = _StorageRef(storage, self._freed)  # an empty one too: resize_ may grow it later
                ref.key, ref.nbytes = key, storage.nbytes()
                with self._lock:
                    self._refs[key] = ref
                    self.live += ref.nbytes
                    self.peak = max(self.peak, self.live)
            else:
                nbytes = storage.nbytes()
                if nbytes != ref.nbytes:  # resized in place (resize_, out= ops)
                    with self._lock:
                        self.live += nbytes - ref.nbytes
                        ref.nbytes = nbytes
                        self.peak = max(self.peak, self.live)
        return out


def peak_memory(fn, device: torch.device | str | None = None) -> int:
    """Peak bytes allocated while ``fn()`` runs, above the bytes allocated when it started.

    CUDA: the caching allocator's statistics. CPU (and any other device): :class:`LiveBytes`.
    Nothing is printed.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return profiling.peak_memory(fn, device)
    with LiveBytes(device) as meter:
        fn()
    return meter.peak
