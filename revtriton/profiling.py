"""Memory measurements used by the tests and perf/.

* :func:`saved_bytes`: bytes a forward keeps for backward — every tensor autograd saves
  (seen through ``saved_tensors_hooks``) plus tensors custom Functions keep on ``ctx``
  (found by walking the graph), each storage counted once, parameters and buffers excluded.
* :func:`peak_memory`: peak bytes allocated while a callable runs (a training step, say),
  above what was allocated when it started: CUDA's allocator statistics on a GPU, live tensor
  bytes (:class:`LiveBytes`, a ``TorchDispatchMode``) on the CPU. Nothing is printed.
* :func:`profiler_peak_memory`: the same on the CPU from the profiler's allocation events (every
  allocation and free, in order), which also see what an op allocates and frees inside itself, but
  go through the profiler's private API and print to stderr on every use (kept as a cross-check).

:class:`LiveBytes` watches every op: each output whose storage is new (not an input's, not seen
before) adds its bytes, and a ``weakref`` callback on that storage subtracts them when it is freed
(torch keeps one Python object per storage while any tensor uses it, so the callback runs when the
memory goes). Storages that existed before the mode started are never counted, neither when they
are written in place nor when they are freed: the peak is what the watched code allocates above
what was live at its start. What it cannot see: memory an op allocates and frees inside itself
without returning it (the CPU flash-attention kernel's per-thread scratch buffers, for one), and
tensors made by code that bypasses the dispatcher (``torch.from_numpy``). Against the profiler's
events on the quick sweep's shapes (one thread): equal for stored activations, 0.5-1.5% lower for
the reversible and checkpointed stacks, whose peak falls in backward beside such buffers
(tests/test_perf.py checks it). Its cost: a step under it takes about 2x a plain step (the
profiler's way, about 3x).
"""
from __future__ import annotations

import dataclasses
import threading
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes", "peak_memory", "profiler_peak_memory", "saved_bytes"]


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr(), storage.nbytes())


def _tensors_in(obj, depth=0, seen=None):
    """Tensors reachable from a ctx attribute (lists, tuples, dicts, dataclasses), modules skipped."""
    seen = set() if seen is None else seen
    if depth > 6 or id(obj) in seen or isinstance(obj, (nn.Module, str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value, depth + 1, seen)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from _tensors_in(value, depth + 1, seen)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name), depth + 1, seen)


def _graph_nodes(outputs):
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


def _flatten_outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _flatten_outputs(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in _flatten_outputs(item)]
    return [t for t in vars(out).values() if isinstance(t, torch.Tensor)] if hasattr(out, "__dict__") else []


def saved_bytes(fn, module: nn.Module | None = None) -> int:
    """Bytes kept for backward by ``fn()`` (a forward returning its output tensors).

    ``module``'s parameters and buffers are not counted (they are not activations).
    """
    excluded = set()
    if module is not None:
        excluded = {_storage_key(t) for t in list(module.parameters()) + list(module.buffers())}
    kept = {}

    def pack(t):
        if not isinstance(t, nn.Parameter):
            key = _storage_key(t)
            if key not in excluded:
                kept[key] = key[3]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    for node in _graph_nodes(_flatten_outputs(out)):
        if hasattr(node, "saved_tensors") and hasattr(node, "__dict__"):  # a custom Function's ctx
            for t in _tensors_in(vars(node)):
                key = _storage_key(t)
                if key not in excluded and not isinstance(t, nn.Parameter):
                    kept[key] = key[3]
    del out
    return sum(kept.values())


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
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with LiveBytes(device) as meter:
        fn()
    return meter.peak


def profiler_peak_memory(fn) -> int:
    """:func:`peak_memory` on the CPU from the profiler's allocation events (prints to stderr)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type()
              == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
